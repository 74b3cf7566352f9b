"""float16 communication with dynamic loss scaling: one decision for every device."""

import functools

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.collectives import level
import fast_random

AXES = ("host", "local")


def _fp16_allreduce():
  return jaxcomm.compressed_allreduce(levels=[level("local", dtype=jnp.float16),
                                              level("host", jaxcomm.cast(jnp.float16))])


def _setup(mesh, **kwargs):
  params = {"w": jnp.ones((8, 16), jnp.float32)}
  tx = jaxcomm.optim.dynamic_loss_scale(_fp16_allreduce(), optax.sgd(0.5), axes=AXES, **kwargs)
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXES)),
                     out_specs=(P(), specs))
  def step(params, opt_state, grads):
    scaled = jax.tree.map(lambda g: (g[0] * opt_state.scale).astype(jnp.float16), grads)
    updates, opt_state = tx.update(scaled, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return params, state, step


def test_scaled_float16_communication_gives_the_mean_gradient_step():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, state, step = _setup(mesh, initial_scale=1024.0)
  grads = {"w": fast_random.normal(jax.random.PRNGKey(0), (8, 8, 16)) * 1e-4}
  new_params, new_state = step(params, state, grads)
  expected = params["w"] - 0.5 * jnp.mean(grads["w"], 0)
  chex.assert_trees_all_close(new_params["w"], expected, atol=1e-7, rtol=1e-3)
  assert int(new_state.skipped) == 0 and float(new_state.scale) == 1024.0


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_non_finite_gradient_on_one_device_skips_the_step_everywhere(bad):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, state, step = _setup(mesh, initial_scale=1024.0)
  grads = {"w": jnp.full((8, 8, 16), 1e-3).at[5, 2, 3].set(bad)}
  new_params, new_state = step(params, state, grads)
  chex.assert_trees_all_equal(new_params, params)
  assert int(new_state.skipped) == 1 and float(new_state.scale) == 512.0
  chex.assert_trees_all_equal(new_state.allreduce, state.allreduce)
  chex.assert_tree_all_finite(new_state.optimizer)
  after, final = step(new_params, new_state, {"w": jnp.full((8, 8, 16), 1e-3)})
  assert int(final.skipped) == 1
  assert float(jnp.max(jnp.abs(after["w"] - params["w"]))) > 0  # training continues


def test_overflow_of_the_float16_sum_is_caught_and_the_scale_grows_back():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, state, step = _setup(mesh, initial_scale=2.0**20, growth_interval=2)
  grads = {"w": jnp.full((8, 8, 16), 1.0)}  # 1.0 * 2**20 overflows float16 (max 65504)
  scales = []
  for _ in range(10):
    params, state = step(params, state, grads)
    scales.append(float(state.scale))
  # 2**20 .. 2**16 overflow (5 skips); 2**15 = 32768 is finite; growing back to 2**16
  # overflows once more (a 6th skip).
  assert int(state.skipped) == 6
  assert scales[:5] == [2.0**19, 2.0**18, 2.0**17, 2.0**16, 2.0**15]
  assert scales[5:] == [2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**16]
  chex.assert_tree_all_finite(params)


@pytest.mark.parametrize("kwargs, match", [
    ({"initial_scale": 0.0}, "initial_scale"), ({"growth_interval": 0}, "growth_interval"),
    ({"factor": 1.0}, "factor"), ({"axes": ()}, "axes"),
])
def test_bad_arguments(kwargs, match):
  arguments = {"axes": AXES, **kwargs}
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomm.optim.dynamic_loss_scale(_fp16_allreduce(), optax.sgd(0.1), **arguments)
