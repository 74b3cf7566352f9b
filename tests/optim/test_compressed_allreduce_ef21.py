"""compressed_allreduce with EF21 estimates: the replicated estimate is exactly the mean of the
devices' estimates, every device returns it, and it converges to the true mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm.collectives import TwoPhaseState
from jaxcomm._src.compress.error_feedback import EstimateFeedbackState
from update_helpers import update_fn

PARAMS = {"b": jnp.zeros((5,)), "w": jnp.zeros((6, 7))}
SIZE = 5 + 42


def _grads(step: int, devices: int):
  keys = jax.random.split(jax.random.PRNGKey(step), 2)
  return {"b": jax.random.normal(keys[0], (devices, 5)),
          "w": jax.random.t(keys[1], 2.0, (devices, 6, 7))}


def _check_invariant(state, hosts: int, local: int, out=None) -> None:
  """Estimate of the mean (each device holds its fast-axis shard: laid out over 'local' it is
  the zero-padded bucket) == sum over hosts of the devices' estimates of their (pre-divided)
  shards; with ``out``, every device returned exactly that estimate, unpadded."""
  sizes = {"b": 5, "w": 42}
  for leaf_states, estimate, size in zip(state.level_states, state.estimates, sizes.values()):
    workers = leaf_states[1]
    assert isinstance(workers, EstimateFeedbackState)
    per_device = np.asarray(workers.estimate).reshape(hosts, local, -1)
    mean_of_workers = per_device.sum(axis=0).reshape(-1)  # inputs are pre-divided by N
    assert estimate.shape == (-(-size // local) * local,)
    np.testing.assert_allclose(np.asarray(estimate), mean_of_workers, rtol=1e-5, atol=1e-6)
  if out is None:
    return
  flat = np.concatenate([np.asarray(out[k]).reshape(out[k].shape[0], -1) for k in sorted(out)],
                        axis=1)
  np.testing.assert_array_equal(flat, np.broadcast_to(flat[:1], flat.shape))  # all devices
  estimates = np.concatenate([np.asarray(e)[:size]
                              for e, size in zip(state.estimates, sizes.values())])
  np.testing.assert_array_equal(flat[0], estimates)


@pytest.mark.parametrize("mesh_shape, compressor, strategy", [
    ((2, 4), jaxcomm.sign(), None),
    ((8, 1), jaxcomm.topk(0.1), None),
    ((4, 2), jaxcomm.quantize(4), "gather"),
    ((2, 4), jaxcomm.randomk(0.25), "linear"),
    ((4, 2), jaxcomm.compress.count_sketch(16, 1), "linear"),  # depth 1: linear decode
])
def test_replicated_estimate_is_the_mean_of_the_device_estimates(mesh_shape, compressor,
                                                                 strategy):
  hosts, local = mesh_shape
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  tx = jaxcomm.compressed_allreduce(compressor, strategy=strategy, feedback="estimate", seed=3)
  state, update = update_fn(tx, PARAMS, mesh, every_device=True)
  for step in range(4):
    out, state = update(_grads(step, hosts * local), state)
    _check_invariant(state, hosts, local, out)


def test_output_converges_to_the_true_mean_of_a_fixed_gradient():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.sign())
  state, update = update_fn(tx, PARAMS, mesh)
  grads = _grads(0, 8)
  mean = {k: np.asarray(v).mean(axis=0) for k, v in grads.items()}
  errors = []
  for _ in range(40):
    out, state = update(grads, state)
    errors.append(sum(np.sum((np.asarray(out[k]) - mean[k]) ** 2) for k in mean))
  assert all(b <= a * (1 + 1e-5) for a, b in zip(errors, errors[1:]))  # never overshoots
  assert errors[-1] < 1e-2 * errors[0]


@pytest.mark.parametrize("nonfinite", ["skip", "zero"])
def test_a_nan_on_one_device_keeps_the_invariant(nonfinite):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.2), feedback="estimate",
                                    nonfinite=nonfinite)
  state, update = update_fn(tx, PARAMS, mesh, every_device=True)
  _, state = update(_grads(0, 8), state)
  before = state
  bad = _grads(1, 8)
  bad["w"] = bad["w"].at[5, 2, 3].set(jnp.nan)
  out, state = update(bad, state)
  _check_invariant(state, 2, 4, out if nonfinite == "zero" else None)
  if nonfinite == "skip":  # zero updates, state as it was
    assert not np.any(np.asarray(out["w"]))
    for new, old in zip(jax.tree.leaves(state.estimates), jax.tree.leaves(before.estimates)):
      np.testing.assert_array_equal(new, old)
    assert int(state.skipped_steps) == 1


def test_skip_returns_the_kept_estimate_when_it_overflows_from_finite_inputs():
  # Every input is finite, but the change -3e38 - 3e38 overflows to -Inf: the estimate keeps
  # its old entries, no step is skipped, and the mean sent on is the kept, finite estimate.
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.sign(), feedback="estimate")
  state, update = update_fn(tx, {"w": jnp.zeros((16,))}, mesh, every_device=True)
  huge = {"w": jnp.full((8, 16), 3e38, jnp.float32)}
  first, state = update(huge, state)
  kept = jax.tree.map(np.asarray, state.estimates)
  second, state = update(jax.tree.map(jnp.negative, huge), state)
  assert int(state.skipped_steps) == 0
  for new, old in zip(jax.tree.leaves(state.estimates), jax.tree.leaves(kept)):
    np.testing.assert_array_equal(new, old)
  for leaf in jax.tree.leaves((first, second)):
    assert np.all(np.isfinite(np.asarray(leaf)))
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("compressor, mesh_shape, kind", [
    (jaxcomm.sign(), (8, 1), EstimateFeedbackState),  # biased, contracts 0.64: EF21, gather
    (jaxcomm.topk(0.01), (8, 1), jaxcomm.compress.ErrorFeedbackState),  # contracts 0.08: residuals
    (jaxcomm.quantize(8), (8, 1), TwoPhaseState),  # unbiased: residuals, two-phase on > 2
    (jaxcomm.quantize(8), (2, 4), jaxcomm.compress.ErrorFeedbackState),  # ... gather on 2 hosts
])
def test_default_feedback_and_strategy_follow_the_measured_rules(compressor, mesh_shape, kind):
  mesh = jaxcomm.make_mesh(hosts=mesh_shape[0], local=mesh_shape[1])
  state, _ = update_fn(jaxcomm.compressed_allreduce(compressor), PARAMS, mesh)
  assert {type(levels[1]) for levels in state.level_states} == {kind}
  assert all(isinstance(e, jax.Array) == (kind is EstimateFeedbackState)
             for e in state.estimates)


def test_default_feedback_bounds_a_sparsifiers_residual_by_the_current_input():
  """top-1% (contraction 0.08) gets 'bounded' residuals: under a gradient that shrinks 4x per
  step each device's residual stays within RESIDUAL_BOUND of its (pre-divided) input, where
  classic residuals ('residual') grow to many times it."""
  from jaxcomm._src.optim.compressed_allreduce import RESIDUAL_BOUND
  mesh = jaxcomm.make_mesh(hosts=8, local=1)
  ratios = {}
  for feedback in (True, "residual"):
    tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.01), feedback=feedback)
    state, update = update_fn(tx, PARAMS, mesh)
    for step in range(6):
      grads = jax.tree.map(lambda g: g * 0.25 ** step, _grads(step, 8))
      _, state = update(grads, state)
    residual = np.asarray(state.level_states[1][1].residual).reshape(8, -1)
    inputs = np.asarray(grads["w"]).reshape(8, -1) / 8
    ratios[feedback] = np.linalg.norm(residual, axis=1) / np.linalg.norm(inputs, axis=1)
  assert np.all(ratios[True] <= RESIDUAL_BOUND * (1 + 1e-5))
  assert np.all(ratios["residual"] > 10 * RESIDUAL_BOUND)


def test_default_feedback_keeps_residuals_where_estimates_cannot_be_exact():
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  for kwargs in ({"strategy": "two_phase"}, {"residual_dtype": jnp.bfloat16}):
    state, _ = update_fn(jaxcomm.compressed_allreduce(jaxcomm.sign(), **kwargs), PARAMS, mesh)
    assert state.estimates == ((), ())
    kinds = {type(levels[1]) for levels in state.level_states}
    assert kinds <= {TwoPhaseState, jaxcomm.compress.ErrorFeedbackState}


@pytest.mark.parametrize("kwargs, match", [
    ({"feedback": "estimate", "strategy": "two_phase"}, "two_phase"),
    ({"feedback": "estimate", "residual_dtype": jnp.bfloat16}, "residual_dtype=bfloat16"),
    ({"feedback": "bounded", "strategy": "two_phase"}, "feedback='bounded'"),
    ({"feedback": "memory"}, "feedback must be one of estimate, bounded, residual, none"),
    ({"feedback": 1}, "feedback must be a bool"),
])
def test_bad_feedback_raises_at_construction(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomm.compressed_allreduce(jaxcomm.sign(), **kwargs)


@pytest.mark.parametrize("feedback", ["estimate", "bounded"])
def test_matrix_compressors_refuse_feedback_they_do_not_keep(feedback):
  with pytest.raises(ValueError, match=f"feedback='{feedback}' is not available for powersgd"):
    jaxcomm.compressed_allreduce(jaxcomm.powersgd(2), feedback=feedback)


def test_contraction_probe_matches_the_closed_forms():
  from jaxcomm._src.optim.compressed_allreduce import contraction
  assert contraction(jaxcomm.sign()) == pytest.approx(2 / np.pi, abs=0.02)
  assert contraction(jaxcomm.identity()) == pytest.approx(1.0)
  assert 0.01 < contraction(jaxcomm.topk(0.01)) < 0.12  # k/d plus the tail's energy share
  assert contraction(jaxcomm.randomk(0.1)) < 0  # unbiased, variance d/k - 1 = 9
