"""Adaptive compression: shared residuals across levels, the three controllers, agreement."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.optim.adaptive import (adaptive_allreduce, bandwidth_controller, loss_controller,
                                         ratio_schedule)
import fast_random

AXES = ("host", "local")
PARAMS = {"w": jnp.zeros((6, 8)), "b": jnp.zeros((8,))}
LADDER = (jaxcomm.topk(0.5), jaxcomm.topk(0.25), jaxcomm.topk(0.1))


def _grads(step):
  return jax.tree.map(
      lambda p: fast_random.normal(jax.random.fold_in(jax.random.PRNGKey(step), p.size),
                                  (8, *p.shape)), PARAMS)


def _stepper(tx, mesh, signals=()):
  """``(state, step)``: ``step(grads, state, *signal_values)`` returns every device's output
  and level (stacked on a device axis) and the new state; signal ``i`` of device ``d`` is
  ``values[i][d]``."""
  state, specs = jaxcomm.optim.sharded_init(tx, PARAMS, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(P(AXES), specs) + (P(AXES),) * len(signals),
                     out_specs=(P(AXES), P(AXES), specs))
  def step(grads, opt_state, *values):
    extra = {name: value[0] for name, value in zip(signals, values)}
    out, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state, **extra)
    return (jax.tree.map(lambda leaf: leaf[None], out), opt_state.level[None], opt_state)

  return state, step


def test_schedule_runs_each_level_on_the_shared_residual_exactly():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = adaptive_allreduce(LADDER, ratio_schedule([2, 4]))
  state, step = _stepper(tx, mesh)
  reducers = [jaxcomm.compressed_allreduce(c, strategy="gather", feedback="residual")
              for c in LADDER]
  steppers = [_stepper_plain(r, mesh) for r in reducers]
  reference = jaxcomm.optim.sharded_init(reducers[0], PARAMS, mesh)[0]
  for t in range(6):
    out, levels, state = step(_grads(t), state)
    level = min(t // 2, 2)
    np.testing.assert_array_equal(levels, level)
    expected, reference = steppers[level](_grads(t), reference)
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], out), expected)
    chex.assert_trees_all_equal(state.allreduce, reference)
  np.testing.assert_array_equal(state.level_steps, [2, 2, 2])


def _stepper_plain(tx, mesh):
  specs = jaxcomm.optim.sharded_init(tx, PARAMS, mesh)[1]

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), specs),
                     out_specs=(P(), specs))
  def step(grads, opt_state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), opt_state)

  return step


def test_loss_controller_agrees_across_devices_with_different_losses():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = adaptive_allreduce(LADDER, loss_controller(patience=2))
  state, step = _stepper(tx, mesh, signals=("value",))
  seen = []
  for t in range(8):
    losses = jnp.linspace(1.0, 2.0, 8) / (t + 1)  # every device different, mean falling
    out, levels, state = step(_grads(t), state, losses)
    assert len(set(np.asarray(levels).tolist())) == 1  # one decision on every device
    for leaf in jax.tree.leaves(out):
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    seen.append(int(levels[0]))
  assert seen == [0, 0, 1, 1, 2, 2, 2, 2], seen


def test_loss_controller_moves_up_while_improving_and_down_when_stalled():
  controller = loss_controller(patience=3, smoothing=0.0)
  state, level, levels = controller.init(4), jnp.int32(0), []
  for value in [10, 9, 8, 7, 6, 5, 4, 4, 4, 4]:
    level, state = controller.update(state, level, 0, {"value": jnp.float32(value)}, 4)
    levels.append(int(level))
  # three improvements move up and restart the reference; three stalls move down
  assert levels == [0, 0, 0, 1, 1, 1, 2, 2, 2, 1], levels


def test_bandwidth_controller_picks_the_least_compression_that_fits():
  controller = bandwidth_controller([1000.0, 100.0, 10.0], budget=1.0, smoothing=0.0)
  state = controller.init(3)
  level, state = controller.update(state, jnp.int32(0), jnp.int32(0),
                                   {"step_time": jnp.float32(0.0),
                                    "compute_time": jnp.float32(1.0)}, 3)
  assert int(level) == 0  # no measurement yet
  # level 0 moved 1000 B in 10 s of link time: 100 B/s; level 1 needs 1 s <= 1 s of compute
  level, state = controller.update(state, jnp.int32(0), jnp.int32(1),
                                   {"step_time": jnp.float32(11.0),
                                    "compute_time": jnp.float32(1.0)}, 3)
  assert int(level) == 1
  np.testing.assert_allclose(state.rate, 100.0)
  # a faster link (100 B in 0.05 s at level 1: 2000 B/s): level 0 fits again
  level, state = controller.update(state, level, jnp.int32(2),
                                   {"step_time": jnp.float32(1.05),
                                    "compute_time": jnp.float32(1.0)}, 3)
  assert int(level) == 0


def test_missing_signal_raises_naming_it():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = adaptive_allreduce(LADDER, loss_controller())
  state, step = _stepper(tx, mesh)
  with pytest.raises(ValueError, match="pass value=..."):
    step(_grads(0), state)


@pytest.mark.parametrize("make, match", [
    (lambda: adaptive_allreduce(LADDER[:1], loss_controller()), "at least two"),
    (lambda: adaptive_allreduce((jaxcomm.randomk(0.5), jaxcomm.topk(0.1)), loss_controller()),
     "must be stateless"),
    (lambda: adaptive_allreduce(LADDER, loss_controller(), strategy=None), "strategy must be"),
    (lambda: adaptive_allreduce(LADDER, loss_controller(), strategy="linear"),
     "strategy='linear' needs a linear compressor"),
    (lambda: adaptive_allreduce(LADDER, ratio_schedule([5])), "needs 2 levels, got 3"),
    (lambda: adaptive_allreduce(LADDER, "loss"), "controller must be"),
    (lambda: adaptive_allreduce(LADDER, loss_controller(), levels=()), "must not set"),
    (lambda: ratio_schedule([5, 5]), r"boundaries\[1\] must be >= 6, got 5"),
    (lambda: ratio_schedule([0]), r"boundaries\[0\] must be >= 1, got 0"),
    (lambda: bandwidth_controller([10.0, 100.0]), "level_bytes must be non-increasing"),
    (lambda: bandwidth_controller([10.0], budget=0.0), "budget must be a finite float > 0"),
    (lambda: loss_controller(patience=0), "patience must be >= 1, got 0"),
    (lambda: loss_controller(tolerance=1.0), r"tolerance must be in \[0, 1\), got 1.0"),
])
def test_bad_arguments_raise_at_construction(make, match):
  with pytest.raises((ValueError, TypeError), match=match):
    make()
