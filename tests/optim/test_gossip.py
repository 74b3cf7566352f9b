"""Gossip: complete graph = allreduce, consensus, CHOCO-SGD, bytes per neighbor, errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.optim.gossip import gossip
from jaxcomm._src.optim.local_training import consensus_distance
from lowcomm_helpers import (AXES, batch, consensus, eval_loss, numpy_roundtrip, problem,
                             sync_sgd, train)

LR = 0.1


def test_complete_graph_with_uniform_weights_is_allreduce():
  expected = sync_sgd(LR, 3)[0]
  params = train(gossip(optax.sgd(LR), "complete"), 3, local=True)[0]
  chex.assert_trees_all_close(consensus(params, True), expected, atol=1e-6)
  uniform = gossip(optax.sgd(LR), mixing_matrix=np.full((8, 8), 1 / 8))
  chex.assert_trees_all_close(train(uniform, 3, local=True)[0], params, atol=1e-6)


def _mixing_step(tx, mesh):
  """One jitted mixing step without gradients, reporting the consensus distance before/after."""
  params = {"w": jnp.zeros((64,))}
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, P(AXES))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), specs),
                     out_specs=(P(AXES), specs, P(), P()))
  def step(params, state):
    updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
    new = optax.apply_updates(params, updates)
    return new, state, consensus_distance(params), consensus_distance(new)

  return step, state


@pytest.mark.parametrize("graph, neighbors", [("ring", 2), ("torus", 3), ("hypercube", 3),
                                              ("exponential", 3), ("random", 1)])
def test_gossip_contracts_consensus_and_sends_one_copy_per_neighbor(graph, neighbors):
  mesh = problem()[3]
  tx = gossip(optax.sgd(0.0), graph)
  step, state = _mixing_step(tx, mesh)
  x = {"w": jax.random.normal(jax.random.PRNGKey(0), (8 * 64,))}
  mean = np.asarray(x["w"]).reshape(8, 64).mean(0)
  new, _, before, after = step(x, state)
  assert float(after) < 0.9 * float(before)
  np.testing.assert_allclose(np.asarray(new["w"]).reshape(8, 64).mean(0), mean, atol=1e-5)
  report = jaxcomm.accounting.measure(step, x, state, mesh=mesh)
  permuted = sum(op.bytes_per_device for op in report.collectives
                 if op.kind == "collective-permute")
  per_step = permuted / ((8 - 1) if graph == "random" else 1)  # one branch of 7 runs
  assert per_step == pytest.approx(neighbors * 64 * 4)


def test_ring_bytes_per_node_do_not_grow_with_the_number_of_nodes():
  small = jaxcomm.make_mesh(hosts=1, local=4, devices=jax.devices()[:4])
  step_small, state_small = _mixing_step(gossip(optax.sgd(0.0), "ring"), small)
  x_small = {"w": jnp.zeros((4 * 64,))}
  step, state = _mixing_step(gossip(optax.sgd(0.0), "ring"), problem()[3])
  bytes_of = lambda report: sum(op.bytes_per_device for op in report.collectives
                                if op.kind == "collective-permute")
  four = bytes_of(jaxcomm.accounting.measure(step_small, x_small, state_small, mesh=small))
  eight = bytes_of(jaxcomm.accounting.measure(step, {"w": jnp.zeros((8 * 64,))}, state,
                                              mesh=problem()[3]))
  assert four == eight == 2 * 64 * 4


@pytest.mark.parametrize("name, make", [
    ("ring", lambda: gossip(optax.sgd(LR), "ring")),
    ("choco_sign", lambda: gossip(optax.sgd(LR), "hypercube", compressor=jaxcomm.sign(),
                                  consensus_step=0.5)),
])
def test_trains_the_mlp_close_to_allreduce_and_resumes_from_numpy(name, make):
  params, state, losses, step, specs = train(make(), 60, local=True)
  assert eval_loss(params, local=True) < eval_loss(sync_sgd(LR, 60)[0]) + 0.1, losses
  assert float(sum(np.var(np.asarray(x).reshape(8, -1), axis=0).sum()
                   for x in jax.tree.leaves(params))) < 5e-2
  data, mesh = problem()[2:]
  two = lambda p, s: step(*step(p, s, batch(data, 60))[:2], batch(data, 61))[:2]
  restored = numpy_roundtrip((params, state), (P(AXES), specs), mesh)
  chex.assert_trees_all_equal(two(params, state), two(*restored))


def test_random_peers_are_drawn_alike_from_a_seed_and_from_its_typed_or_legacy_key():
  mesh = problem()[3]
  x = {"w": jax.random.normal(jax.random.PRNGKey(0), (8 * 64,))}
  tx = lambda seed: gossip(optax.sgd(0.0), "random", seed=seed)
  initial = lambda seed: jaxcomm.optim.sharded_init(tx(seed), {"w": jnp.zeros((64,))}, mesh,
                                              P(AXES))[0]
  # update reads the state's key, never the seed: one compiled step per key layout is enough.
  (legacy_step, seed_state), (typed_step, typed_state) = (
      _mixing_step(tx(seed), mesh) for seed in (3, jax.random.key(3)))

  def mixed(step, state):
    mixed_params = x
    for _ in range(2):
      mixed_params, state, _, _ = step(mixed_params, state)
      jax.block_until_ready(mixed_params)
    return np.asarray(mixed_params["w"])

  from_seed = mixed(legacy_step, seed_state)
  np.testing.assert_array_equal(mixed(legacy_step, initial(jax.random.PRNGKey(3))), from_seed)
  np.testing.assert_array_equal(mixed(typed_step, typed_state), from_seed)
  assert not np.array_equal(mixed(typed_step, initial(jax.random.key(5))), from_seed)


@pytest.mark.parametrize("kwargs, match", [
    ({"graph": "star"}, "graph must be one of .*got 'star'"),
    ({"mixing_matrix": [[0.5, 0.5], [0.6, 0.4]]}, "doubly stochastic.*column sums"),
    ({"mixing_matrix": [[1.5, -0.5], [-0.5, 1.5]]}, "doubly stochastic"),
    ({"mixing_matrix": np.ones((2, 3)) / 3}, r"square matrix, got shape \(2, 3\)"),
    ({"graph": "random", "compressor": jaxcomm.sign()}, "graph='random' cannot carry CHOCO"),
    ({"consensus_step": 1.5}, r"consensus_step must be in \(0, 1\], got 1.5"),
    ({"compressor": "sign"}, "compressor must be a jaxcomm.Compressor"),
    ({"compressor": jaxcomm.compress.randomk(0.5)},
     r"compressor must be stateless for CHOCO-SGD; randomk\(0.5\) keeps state"),
    ({"seed": 1.5}, r"seed must be an int seed, a jax.random.key\(...\) .*got 1.5"),
    ({"seed": True}, "seed must be an int seed"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    gossip(optax.sgd(LR), **kwargs)
