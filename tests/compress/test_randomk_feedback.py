"""Random-k's residual for error feedback: ``x - decode(payload)`` without a dense decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm


def _with_special_values(size: int, seed: int) -> jax.Array:
  x = jax.random.normal(jax.random.PRNGKey(seed), (size,))
  return x.at[:6].set(jnp.array([-0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 3e38]))


@pytest.mark.parametrize("shared", [True, False])
def test_unscaled_randomk_subtract_decoded_is_the_dense_subtraction_bit_for_bit(shared):
  """Infinities, NaN and signed zeros, sent or not, at a density that sends most of the
  special values on some key; error feedback keeps the fast path."""
  compressor = jaxcomm.randomk(0.5, shared=shared, scale=False, seed=7)
  assert jaxcomm.error_feedback(compressor).subtract_decoded is compressor.subtract_decoded
  for seed in range(4):
    x = (_with_special_values(301, seed) if seed % 2 else
         -_with_special_values(301, seed)).reshape(7, 43)
    state = compressor.init(x.shape, x.dtype)
    payload, _ = jax.jit(compressor.encode)(x, state, jax.random.PRNGKey(seed))
    dense = jax.jit(lambda x, p: x - compressor.decode(p, x.shape))(x, payload)
    fast = jax.jit(compressor.subtract_decoded)(x, payload)
    np.testing.assert_array_equal(fast, dense)
    np.testing.assert_array_equal(np.signbit(fast), np.signbit(dense))


def test_scaled_randomk_keeps_the_dense_subtraction():
  # x - v * (d / k) in one fused kernel rounds once (an FMA), the dense path twice.
  assert jaxcomm.randomk(0.5).subtract_decoded is None
