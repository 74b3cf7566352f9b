"""compressed_allreduce as an optax transformation: training, state sharding, errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from update_helpers import update_fn
from models.data import teacher_classification
from models.mlp import classification_loss, init_mlp
import fast_random

AXES = ("host", "local")
COMPRESSORS = {
    "full": (None, True),
    "identity": (jaxcomm.identity(), False),
    "sign-ef": (jaxcomm.sign(), True),
    "topk-ef": (jaxcomm.topk(0.05), True),
    "int8": (jaxcomm.quantize(8), False),
}


@pytest.fixture(scope="module")
def problem():
  graphdef, params = init_mlp(16, [32], 4, seed=0)
  data = teacher_classification(0, 8 * 16 * 60, 16, 4)
  return classification_loss(graphdef), params, data


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_training_loss_decreases_for_every_compressor(problem, name):
  loss_fn, params, (inputs, labels) = problem
  compressor, feedback = COMPRESSORS[name]
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = optax.chain(jaxcomm.compressed_allreduce(compressor, feedback=feedback),
                   optax.adam(3e-3))
  params = jax.device_put(params, NamedSharding(mesh, P()))  # as the step returns it
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
  losses = []
  for i in range(60):
    batch = (inputs[i * 128:(i + 1) * 128], labels[i * 128:(i + 1) * 128])
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  assert np.mean(losses[-10:]) < 0.85 * np.mean(losses[:5]), losses
  chex.assert_tree_all_finite(params)


def test_state_specs_mark_residuals_device_local_and_the_rest_replicated(problem):
  _, params, _ = problem
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.1)), optax.adam(1e-3))
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  allreduce_specs, adam_specs = specs[0], specs[1]
  for spec in jax.tree.leaves(allreduce_specs.level_states,
                              is_leaf=lambda s: isinstance(s, P)):
    assert spec == P(AXES)
  assert allreduce_specs.key == P() and allreduce_specs.count == P()
  assert all(s == P() for s in jax.tree.leaves(adam_specs, is_leaf=lambda s: isinstance(s, P)))
  leaf_order = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  residual = state[0].level_states[leaf_order.index("['hidden'][0]['kernel']")][1].residual
  chex.assert_shape(residual, (8 * (16 * 32 // 4),))  # one 1/G shard per device
  assert residual.sharding.spec == P(AXES)


def test_sharded_init_state_equals_plain_mean_of_devices_with_identity(problem):
  loss_fn, params, (inputs, labels) = problem
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.identity(), feedback=False),
                   optax.sgd(0.1))
  params = jax.device_put(params, NamedSharding(mesh, P()))  # as the step returns it
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
  batch = (inputs[:128], labels[:128])
  new_params, _, _ = step(params, opt_state, batch)
  per_device = [jax.grad(loss_fn)(params, (inputs[i * 16:(i + 1) * 16], labels[i * 16:(i + 1) * 16]))
                for i in range(8)]
  mean_grad = jax.tree.map(lambda *g: sum(g) / 8, *per_device)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, mean_grad)
  chex.assert_trees_all_close(new_params, expected, atol=1e-6)


def _update_in(mesh, tx, grads_spec=P(AXES), pre=lambda g: g):
  params = {"w": jnp.zeros((8, 4))}

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(grads_spec,), out_specs=P())
  def run(grads):
    state = tx.init(params)
    updates, _ = tx.update(pre(grads), state)
    return updates

  return jax.jit(run)


def test_already_reduced_gradients_are_refused():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.5))
  run = _update_in(mesh, tx, grads_spec=P(), pre=lambda g: {"w": g})
  with pytest.raises(ValueError, match="not varying over mesh axis '(host|local)'.*local_grad"):
    run(jnp.zeros((8, 4)))


def test_unknown_axis_names_are_named_in_the_error():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.5), slow_axis="pod")
  with pytest.raises(ValueError, match="mesh axis 'pod' is not available"):
    _update_in(mesh, tx, pre=lambda g: {"w": g[0]})(jnp.zeros((64, 4)))
  with pytest.raises(ValueError, match="outside jax.shard_map"):
    tx.init({"w": jnp.zeros(3)})


@pytest.mark.parametrize("kwargs, match", [
    ({"compressor": "topk"}, "compressor"),
    ({"compressor": None, "fast_axis": ""}, "fast_axis"),
    ({"compressor": None, "fast_axis": "host"}, "must differ"),
    ({"compressor": None, "seed": 1.5}, "seed"),
    ({"compressor": None, "feedback": "yes"}, "feedback"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomm.compressed_allreduce(**kwargs)


def test_integer_gradients_are_rejected_with_their_path():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.5))
  run = _update_in(mesh, tx, pre=lambda g: {"w": g[0].astype(jnp.int32)})
  with pytest.raises(TypeError, match=r"grads\['w'\] must be a float32, bfloat16 or float16"):
    run(jnp.zeros((64, 4)))


def test_integer_parameters_are_rejected():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.5))
  with pytest.raises(TypeError, match=r"params\['n'\] must be a float32"):
    jaxcomm.optim.sharded_init(tx, {"n": jnp.zeros(4, jnp.int32)}, mesh)


def test_a_policy_compresses_only_the_leaves_it_chooses():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"dense": {"kernel": jnp.zeros((64, 64)), "bias": jnp.zeros(64)},
            "head": {"kernel": jnp.zeros((64, 8))}}
  chooser = jaxcomm.policy(jaxcomm.topk(0.1), rules=[(r"head", jaxcomm.sign())], min_bytes=0)
  tx = jaxcomm.compressed_allreduce(chooser)
  state, step = update_fn(tx, params, mesh)
  grads = jax.tree.map(lambda p: fast_random.normal(jax.random.PRNGKey(0), (8, *p.shape)), params)
  means, _ = step(grads, state)
  chex.assert_trees_all_close(means["dense"]["bias"], jnp.mean(grads["dense"]["bias"], 0),
                              atol=1e-6)  # bias: full precision by default
  report = jaxcomm.accounting.measure(step, grads, state, mesh=mesh)
  host = report.link_bytes()["host"]
  topk_bytes = int(0.1 * 64 * 64 / 4) * 8
  sign_bytes = 64 * 8 // 4 // 8 + 4
  bias_bytes = 2 * (2 - 1) / 2 * 64 * 4 / 4  # dense reduce over host of the bias shard
  flag_bytes = 2 * (8 - 1) / 8 * 4  # nonfinite='skip': the int32 pmax over all 8 devices
  assert host == pytest.approx(topk_bytes + sign_bytes + bias_bytes + flag_bytes)
