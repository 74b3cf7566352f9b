"""0/1 Adam: thinning variance updates, 1-bit gradients, then local steps and 1-bit syncs."""

import chex
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.optim.zero_one_adam import zero_one_adam

from lowcomm_helpers import (AXES, DEVICES, batch, consensus, eval_loss, numpy_roundtrip,
                             problem, train)
from update_helpers import apply_fn
import fast_random

LR = 1e-2


def per_device(tree):
  """``(devices, n)``: each device's leaves flattened side by side."""
  return np.concatenate([np.asarray(x).reshape(DEVICES, -1) for x in jax.tree.leaves(tree)],
                        axis=1)


def devices_agree(params) -> bool:
  """Equal to rounding: optax applies an update as ``p + (new - p)``, which may round."""
  rows = per_device(params)
  return bool(np.allclose(rows, rows[0], rtol=0, atol=1e-6))


def test_with_every_step_a_variance_step_it_is_adam_on_the_mean_gradient():
  ours = train(zero_one_adam(LR, var_freeze_step=100, var_update_scaler=100), 6, local=True)[0]
  reference = train(optax.chain(jaxcomm.compressed_allreduce(), optax.adam(LR)), 6)[0]
  assert devices_agree(ours)
  chex.assert_trees_all_close(consensus(ours, True), reference, atol=1e-6, rtol=1e-5)


def test_with_a_sync_every_step_after_the_freeze_it_is_onebit_adam():
  # b1 = 0.5: by step 30 the bias correction 1 - b1^t is 1 to 1e-9, so compressing
  # w_t m (0/1 Adam) and m (1-bit Adam) differ by a constant factor sign() is blind to.
  ours = train(zero_one_adam(LR, var_freeze_step=30, var_update_scaler=30,
                             local_step_clipper=1, b1=0.5), 36, local=True)
  reference = train(jaxcomm.onebit_adam(LR, warmup_steps=30, b1=0.5), 36)
  assert devices_agree(ours[0])
  assert int(ours[1].rounds) == 36
  chex.assert_trees_all_close(consensus(ours[0], True), reference[0], atol=1e-5, rtol=1e-4)


def test_variance_updates_thin_out_then_freeze_and_syncs_thin_out_up_to_the_clipper():
  tx = zero_one_adam(LR, var_freeze_step=12, var_update_scaler=2, local_step_scaler=3,
                     local_step_clipper=4)
  params, state, _, step, _ = train(tx, 0, local=True)
  data = problem()[2]
  variance_steps, agreeing_steps, rounds = [], [], []
  for t in range(1, 27):
    old_nu = jax.tree.map(np.asarray, state.nu)
    params, state, _ = step(params, state, batch(data, t))
    if not all(jax.tree.leaves(jax.tree.map(np.array_equal, state.nu, old_nu))):
      variance_steps.append(t)
    if devices_agree(params):
      agreeing_steps.append(t)
    rounds.append(int(state.rounds))
  # T_v: gap 1 for the first 2 updates, then 2 for 2, then 4; nothing after step 12.
  assert variance_steps == [1, 2, 4, 6, 10]
  # T_u after the freeze (s = t - 12): gap 1 for s <= 3, 2 for s <= 6, then 4 (clipped).
  syncs = [13, 14, 15, 17, 21, 25]
  assert agreeing_steps == list(range(1, 13)) + syncs
  assert rounds[-1] == 12 + len(syncs)
  assert int(state.var_updates) == 5 and int(state.count) == 26


def test_trains_the_mlp_close_to_adam_skipping_rounds_and_resumes_from_numpy():
  steps = 80
  tx = zero_one_adam(LR, var_freeze_step=20, var_update_scaler=4, local_step_scaler=8,
                     local_step_clipper=4)
  params, state, losses, step, specs = train(tx, steps, local=True)
  adam = train(optax.chain(jaxcomm.compressed_allreduce(), optax.adam(LR)), steps)[0]
  assert eval_loss(params, local=True) < eval_loss(adam) + 0.1, losses
  assert losses[-1] < 0.8 * losses[0]
  assert int(state.rounds) < 0.6 * steps  # most steps after the freeze do not communicate
  chex.assert_tree_all_finite(state)
  data, mesh = problem()[2:]
  two_steps = lambda p, st: step(*step(p, st, batch(data, steps))[:2], batch(data, steps + 1))
  restored = numpy_roundtrip((params, state), (P(AXES), specs), mesh)
  chex.assert_trees_all_equal(two_steps(params, state)[:2], two_steps(*restored)[:2])


def test_replicated_parameters_are_refused_at_init_with_the_remedy():
  _, params, _, mesh = problem()
  with pytest.raises(ValueError, match="needs device-local parameters.*to_device_local"):
    jaxcomm.optim.sharded_init(zero_one_adam(LR, var_freeze_step=4), params, mesh)


@pytest.mark.parametrize("kwargs, match", [
    (dict(var_freeze_step=0), "var_freeze_step must be >= 1, got 0"),
    (dict(var_freeze_step=4, var_update_scaler=0), "var_update_scaler must be >= 1, got 0"),
    (dict(var_freeze_step=4, local_step_scaler=-1), "local_step_scaler must be >= 1, got -1"),
    (dict(var_freeze_step=4, local_step_clipper=0), "local_step_clipper must be >= 1, got 0"),
    (dict(var_freeze_step=4, b1=1.0), r"b1 must be in \[0, 1\), got 1.0"),
    (dict(var_freeze_step=4, eps=-1.0), "eps must be a finite float >= 0, got -1.0"),
    (dict(var_freeze_step=4, fast_axis="host"), "fast_axis and slow_axis must differ"),
    (dict(var_freeze_step=2.5), "var_freeze_step must be an int, got 2.5"),
])
def test_bad_arguments_raise_at_construction_naming_parameter_and_value(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    zero_one_adam(LR, **kwargs)


def test_a_negative_learning_rate_is_refused():
  with pytest.raises(ValueError, match="learning_rate must be a finite float > 0, got -0.1"):
    zero_one_adam(-0.1, var_freeze_step=4)


def test_skip_nonfinite_makes_a_poisoned_step_a_no_op_in_every_kind_of_step():
  # var_update_scaler=1, freeze 3: t=1 variance, t=2 1-bit, t=3 variance; then with
  # local_step_scaler=1, clipper 2: t=4 sync, t=5 local, t=6 sync.
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.skip_nonfinite(zero_one_adam(0.1, var_freeze_step=3, var_update_scaler=1,
                                            local_step_scaler=1, local_step_clipper=2), AXES)
  params = jaxcomm.optim.to_device_local({"w": np.ones((4, 16), np.float32)}, mesh)
  state, step = apply_fn(tx, params, mesh, P(AXES))
  good = [{"w": fast_random.normal(jax.random.PRNGKey(t), (DEVICES, 4, 16))} for t in range(7)]
  for poisoned_step in range(1, 7):
    p, s = params, state
    for t in range(1, poisoned_step):
      p, s = step(p, s, good[t])
    bad = {"w": good[poisoned_step]["w"].at[5, 1, 2].set(np.nan)}
    after, skipped = step(p, s, bad)
    chex.assert_trees_all_equal((after, skipped.inner), (p, s.inner))
    assert int(skipped.skipped_steps) == 1
    resumed, resumed_state = step(after, skipped, good[poisoned_step])
    chex.assert_tree_all_finite((resumed, resumed_state))
    assert int(resumed_state.inner.count) == poisoned_step
