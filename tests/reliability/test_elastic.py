"""A checkpoint written on 2 hosts x 4 restores on 4 x 2 and on 1 x 8 (simulated devices).

Residuals are filled with random values (as after many steps of training) so every element
carries pending mass. Under ``residuals='sum'`` the pending mass of every gradient element,
summed over hosts (worker residuals plus the two-phase server residual), is the same before and
after, bit for bit. With a compressor that sends everything (top-k at density 1), a step with
zero gradients then sends that same mass on 2 x 4 and on 4 x 2.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import jaxcomm
from jaxcomm import checkpoint

PARAMS = {"w": jnp.arange(35.0).reshape(5, 7) / 10, "b": jnp.ones(3)}
SAVED = (2, 4)


def _allreduce(strategy):
  """Top-k at density 1 sends every pending element: a zero-gradient step sends the mass."""
  return jaxcomm.compressed_allreduce(jaxcomm.topk(1.0), strategy=strategy, seed=5,
                                      feedback="residual")


def _tx(strategy):
  return optax.chain(_allreduce(strategy), optax.adam(1e-2))


def _with_random_residuals(opt_state, seed=0):
  rng = np.random.default_rng(seed)

  def fill(leaf):
    if leaf.dtype != jnp.float32 or leaf.ndim != 1:
      return leaf
    value = rng.standard_normal(leaf.shape).astype(np.float32)
    return jax.device_put(value, leaf.sharding)
  allreduce = opt_state[0]
  return (allreduce._replace(level_states=jax.tree.map(fill, allreduce.level_states)),
          *opt_state[1:])


def _pending_mass(allreduce, hosts, local, sizes):
  """Per bucket, the mass pending for each gradient element, summed over hosts (numpy)."""
  masses = []
  for (_, level), size in zip(allreduce.level_states, sizes):
    shard = -(-size // local)
    if isinstance(level, jaxcomm.compress.ErrorFeedbackState):
      residual = np.asarray(level.residual).reshape(hosts, local * shard)[:, :size]
      masses.append(residual.sum(axis=0))
      continue
    worker = np.asarray(level.worker_residual).reshape(hosts, local, -1)[:, :, :shard]
    server = np.asarray(level.server_residual).reshape(hosts, local, -1).transpose(1, 0, 2)
    owned = server.reshape(local, -1)[:, :shard].reshape(-1)[:size]
    masses.append(worker.reshape(hosts, -1)[:, :size].sum(axis=0) + owned)
  return masses


def _saved(tmp_path, strategy):
  mesh = jaxcomm.make_mesh(hosts=SAVED[0], local=SAVED[1])
  tx = _tx(strategy)
  opt_state, _ = jaxcomm.optim.sharded_init(tx, PARAMS, mesh)
  opt_state = _with_random_residuals(opt_state)
  checkpoint.save(tmp_path, 7, {"params": PARAMS, "opt_state": opt_state})
  return tx, opt_state


def _restored(tmp_path, tx, shape, residuals="sum"):
  mesh = jaxcomm.make_mesh(hosts=shape[0], local=shape[1])
  target = {"params": jax.tree.map(lambda p: jax.device_put(p, NamedSharding(mesh, P())), PARAMS),
            "opt_state": checkpoint.abstract_state(tx, PARAMS, mesh)}
  return mesh, checkpoint.restore(tmp_path, target, tx=tx, params=PARAMS, residuals=residuals)


P = jax.sharding.PartitionSpec
SIZES = [3, 35]  # bucket sizes in jax.tree.leaves order: b, w


def _zero_gradient_mean(strategy, mesh, state):
  """The mean one step with zero gradients returns: the pending mass it sends."""
  axes, allreduce = tuple(mesh.axis_names), _allreduce(strategy)
  zeros = lambda: jax.tree.map(
      lambda p: jax.lax.pcast(jnp.zeros_like(p), axes, to="varying"), PARAMS)
  step = jax.jit(jax.shard_map(lambda s: allreduce.update(zeros(), s)[0], mesh=mesh,
                               in_specs=(jaxcomm.optim.state_specs(allreduce, PARAMS, mesh),),
                               out_specs=P()))
  return jax.tree.map(np.asarray, step(state))


@pytest.mark.parametrize("strategy", ["gather", "two_phase"])
def test_summing_conserves_every_elements_pending_mass_exactly(tmp_path, strategy):
  tx, saved = _saved(tmp_path, strategy)
  before = _pending_mass(saved[0], *SAVED, SIZES)
  sent = _zero_gradient_mean(strategy, jaxcomm.make_mesh(hosts=SAVED[0], local=SAVED[1]),
                             saved[0])
  assert all(np.any(mass != 0) for mass in before) and np.any(sent["w"] != 0)
  for shape in ((4, 2), (1, 8)):
    mesh, restored = _restored(tmp_path, tx, shape)
    after = _pending_mass(restored["opt_state"][0], *shape, SIZES)
    for old, new in zip(before, after):
      np.testing.assert_array_equal(new, old)  # bit for bit
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored["opt_state"][1:]),
                                jax.tree.map(np.asarray, saved[1:]))
    assert int(restored["opt_state"][0].count) == int(saved[0].count)
    for leaf in jax.tree.leaves(restored["opt_state"][0].level_states):
      assert leaf.sharding.mesh.shape == mesh.shape
    if shape[0] > 1:  # on one host no level is compressed: nothing is sent
      chex.assert_trees_all_close(
          _zero_gradient_mean(strategy, mesh, restored["opt_state"][0]), sent,
          rtol=1e-6, atol=1e-7)


def test_reset_zeroes_the_residuals_and_keeps_the_rest(tmp_path):
  tx, saved = _saved(tmp_path, "two_phase")
  _, restored = _restored(tmp_path, tx, (4, 2), residuals="reset")
  for leaf in jax.tree.leaves(restored["opt_state"][0].level_states):
    np.testing.assert_array_equal(leaf, 0)
  np.testing.assert_array_equal(jax.random.key_data(restored["opt_state"][0].key),
                                jax.random.key_data(saved[0].key))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored["params"]), PARAMS)


def test_another_mesh_without_tx_names_the_residual_and_the_meshes(tmp_path):
  tx, _ = _saved(tmp_path, "gather")
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  target = {"params": PARAMS, "opt_state": checkpoint.abstract_state(tx, PARAMS, mesh)}
  with pytest.raises(ValueError, match=r"opt_state\[0\]\.level_states\[0\]\[1\]\.residual has "
                     r"shape \(8,\) in the checkpoint, \(16,\) in the target.*saved on mesh "
                     r"\{'host': 2, 'local': 4\}, the target is on \{'host': 4, 'local': 2\}"):
    checkpoint.restore(tmp_path, target)
  with pytest.raises(ValueError, match="residuals must be one of sum, reset; got 'keep'"):
    checkpoint.restore(tmp_path, target, tx=tx, params=PARAMS, residuals="keep")
