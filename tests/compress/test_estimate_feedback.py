"""EF21 (estimate_feedback): the estimate is the sum of what was sent, and it contracts."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compress import quantize, sign, topk
from jaxcomm._src.compress.error_feedback import estimate_feedback

from test_catalog import CATALOG, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_estimate_is_exactly_the_sum_of_the_decoded_payloads(name):
  compressor = estimate_feedback(CATALOG[name])
  shape = (6, 5)
  state = compressor.init(shape, jnp.float32)
  encode = jax.jit(compressor.encode)
  total_sent = np.zeros(shape, np.float32)
  for step in range(6):
    x = jax.random.normal(jax.random.PRNGKey(step), shape)
    payload, state = encode(x, state, jax.random.PRNGKey(100 + step))
    total_sent += np.asarray(compressor.decode(payload, shape))
    np.testing.assert_allclose(state.estimate, total_sent, rtol=1e-5, atol=1e-5)


def test_topk_estimate_error_contracts_by_k_over_d_every_step():
  d, k = 50, 5
  compressor = estimate_feedback(topk(k / d))
  state = compressor.init((d,), jnp.float32)
  for step in range(20):
    x = jax.random.normal(jax.random.PRNGKey(step), (d,)) + 3.0  # a drifting target
    before = float(jnp.sum((state.estimate - x) ** 2))
    _, state = compressor.encode(x, state, jax.random.PRNGKey(0))
    after = float(jnp.sum((state.estimate - x) ** 2))
    assert after <= (1 - k / d) * before + 1e-4


def test_sign_estimate_tracks_a_fixed_input_without_overshoot():
  # Classic error feedback would send the whole accumulated residual later; EF21's estimate
  # approaches x monotonically: ||g_hat' - x||^2 = ||g_hat - x||^2 - ||g_hat - x||_1^2 / d.
  x = jnp.asarray(np.random.default_rng(0).standard_t(2, 64), jnp.float32)
  compressor = estimate_feedback(sign())
  state = compressor.init(x.shape, jnp.float32)
  errors = []
  for _ in range(30):
    error = state.estimate - x
    _, state = compressor.encode(x, state, jax.random.PRNGKey(0))
    expected = jnp.sum(error ** 2) - jnp.sum(jnp.abs(error)) ** 2 / x.size
    np.testing.assert_allclose(jnp.sum((state.estimate - x) ** 2), expected, rtol=1e-4,
                               atol=1e-5)
    errors.append(float(jnp.sum((state.estimate - x) ** 2)))
  assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:]))


def test_estimate_and_inner_state_never_take_non_finite_values():
  compressor = estimate_feedback(quantize(8))
  state = compressor.init((4,), jnp.float32)
  _, state = compressor.encode(jnp.array([1.0, 2.0, 3.0, 4.0]), state, jax.random.PRNGKey(0))
  before = state.estimate
  for bad in (jnp.nan, jnp.inf):
    _, state = compressor.encode(jnp.array([1.0, bad, 3.0, 4.0]), state, jax.random.PRNGKey(1))
    chex.assert_trees_all_close(state.estimate, before)


def test_an_estimate_entry_that_overflows_from_finite_input_keeps_its_old_value():
  compressor = estimate_feedback(sign())
  state = compressor.init((2,), jnp.float32)
  _, state = compressor.encode(jnp.array([3e38, 3e38]), state, jax.random.PRNGKey(0))
  before = np.asarray(state.estimate)
  # The change -6e38 overflows to -Inf, so the scale and the new estimate are infinite.
  _, state = compressor.encode(jnp.array([-3e38, -3e38]), state, jax.random.PRNGKey(1))
  np.testing.assert_array_equal(state.estimate, before)


def test_facts_and_bad_input():
  for name in NAMES:
    wrapped = estimate_feedback(CATALOG[name])
    assert wrapped.linear == CATALOG[name].linear and not wrapped.unbiased
    assert wrapped.wire_bytes((7,), jnp.float32) == CATALOG[name].wire_bytes((7,), jnp.float32)
  with pytest.raises(TypeError, match="compressor"):
    estimate_feedback("topk")
  with pytest.raises(TypeError, match="x must be a float32"):
    compressor = estimate_feedback(topk(0.5))
    compressor.encode(jnp.arange(4), compressor.init((4,), jnp.int32), jax.random.PRNGKey(0))
