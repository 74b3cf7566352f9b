"""Exact top-k selection on inputs with NaN, infinities, zeros and subnormals.

The reference orders magnitudes by their int32 bit patterns (NaN above +inf, as XLA's CPU
TopK kernel does) and breaks ties by the lower index.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm._src.compress.select import (MIN_FAST_SIZE, bit_words, kth_largest_bits, largest_k,
                                          words_at_least)

SIZE = MIN_FAST_SIZE + 1234  # on the sampled path
largest = jax.jit(largest_k, static_argnums=1, static_argnames="by_magnitude")


def _reference(values: np.ndarray, k: int) -> np.ndarray:
  bits = np.abs(values).astype(np.float32).view(np.int32).astype(np.int64)
  return np.sort(np.lexsort((np.arange(values.size), -bits))[:k])


def _values(kind: str) -> np.ndarray:
  rng = np.random.default_rng(7)
  values = rng.standard_normal(SIZE).astype(np.float32)
  if kind == "nan_inf":
    values[rng.integers(0, SIZE, 9)] = np.nan
    values[rng.integers(0, SIZE, 4)] = np.inf
    values[rng.integers(0, SIZE, 4)] = -np.inf
  if kind == "zeros":
    values[rng.random(SIZE) < 0.6] = 0.0
    values[rng.random(SIZE) < 0.1] = -0.0
  if kind == "subnormal":
    values = values * np.float32(1e-40)
  return values


@pytest.mark.parametrize("kind", ["nan_inf", "zeros", "subnormal"])
@pytest.mark.parametrize("k", [3, SIZE // 100, 1500])
def test_largest_k_orders_special_values_like_the_bit_patterns(kind, k):
  values = _values(kind)
  expected = _reference(values, k)
  np.testing.assert_array_equal(largest(jnp.asarray(values), k, by_magnitude=True), expected)
  if kind != "nan_inf":  # lax.top_k of the magnitudes: the same set, for finite inputs
    top = np.sort(np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(values)), k)[1]))
    np.testing.assert_array_equal(top, expected)


@pytest.mark.parametrize("size,k", [(500, 3), (2000, 327)])
def test_kth_largest_bits_counts_nan_patterns_as_the_largest(size, k):
  # Both paths of one row: top_k (k small against n) and the digit search.
  rng = np.random.default_rng(size)
  magnitude = np.abs(rng.standard_normal(size)).astype(np.float32)
  magnitude[:2] = np.nan
  bits = magnitude.view(np.int32)
  assert int(jax.jit(kth_largest_bits, static_argnums=1)(jnp.asarray(bits), k)) == np.sort(bits)[-k]


def _packed(mask: np.ndarray) -> np.ndarray:
  """numpy's packing of bool rows: element ``32 w + b`` in bit ``b`` of uint32 word ``w``."""
  padded = np.pad(mask, ((0, 0), (0, (-mask.shape[1]) % 32)))
  return np.packbits(padded, axis=1, bitorder="little").view("<u4")


def test_words_at_least_packs_like_bit_words_with_nan_passing():
  rng = np.random.default_rng(3)
  values = np.abs(rng.standard_normal((2, 1000))).astype(np.float32)
  values[0, 5], values[0, 6], values[1, 7] = np.nan, np.inf, np.inf
  values[1, -40:] = 9.0  # passing up to the end: 1000 = 31 * 32 + 8, the last word padded
  threshold = np.array([1.0, 0.5], np.float32)
  words = jax.jit(words_at_least)(jnp.asarray(values), jnp.asarray(threshold))
  passing = (values >= threshold[:, None]) | np.isnan(values)
  np.testing.assert_array_equal(words, _packed(passing))
  np.testing.assert_array_equal(words, jax.vmap(bit_words)(jnp.asarray(passing)))
