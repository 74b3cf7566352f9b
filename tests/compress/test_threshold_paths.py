"""The threshold compressors' encode against the plain expression, and its temporaries.

The encode packs its mask into bit words and compacts them; when more elements pass than
there are slots it takes the largest of them by ``largest_k(x, slots, at_least=t)``, whose
masked magnitudes are recomputed inside each pass instead of written into a temporary of the
input's size. The reference below is the plain expression: ``nonzero`` of the mask, or
``jax.lax.top_k`` of the masked magnitudes, positions sorted.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm
from jaxcomm.compress import adaptive_threshold, threshold
from jaxcomm._src.compress.hashing import hash_bits
from jaxcomm._src.compress.select import EXACT_PIECE, MIN_FAST_SIZE, largest_k

KEY = jax.random.PRNGKey(7)
# glibc serves allocations above its mmap threshold (at most 32 MiB on 64-bit) by mmap, so a
# larger block of temporaries is mapped and page-faulted anew on every call.
MMAP_THRESHOLD_MAX = 32 << 20


def masked_top(flat: np.ndarray, threshold_value: float, k: int) -> np.ndarray:
  """Sorted positions of the ``k`` largest ``where(|x| >= t, |x|, 0)``, ties to the lower."""
  magnitude = jnp.abs(jnp.asarray(flat))
  masked = jnp.where(magnitude >= threshold_value, magnitude, 0.0)
  return np.sort(np.asarray(jax.lax.top_k(masked, k)[1]))


def reference_payload(flat: np.ndarray, threshold_value: float, slots: int):
  """``(values, indices, count)`` of the plain expression."""
  above = np.nonzero(np.abs(flat) >= threshold_value)[0]
  count = min(len(above), slots)
  sent = above if len(above) <= slots else masked_top(flat, threshold_value, slots)
  indices = np.zeros(slots, np.int32)
  indices[:count] = sent[:count]
  values = np.where(np.arange(slots) < count, flat[indices], 0.0).astype(np.float32)
  return values, indices, np.array([count], np.int32)


def adaptive_reference_threshold(flat: np.ndarray, density: float, sample: float, key):
  """The documented estimate: the ``floor(density m)``-th largest of ``m`` hashed draws."""
  drawn = max(1, math.ceil(sample * flat.shape[0]))
  positions = np.asarray(hash_bits(key, (drawn,)) % jnp.uint32(flat.shape[0]))
  rank = max(1, math.floor(density * drawn))
  return np.sort(np.abs(flat[positions]))[::-1][rank - 1]


def assert_payload(payload, expected):
  for got, want in zip(payload, expected):
    np.testing.assert_array_equal(np.asarray(got), want)
  # bit for bit: -0.0 and 0.0 differ on the wire
  np.testing.assert_array_equal(np.asarray(payload.values).view(np.int32),
                                expected[0].view(np.int32))


def special_input(size: int, seed: int, ties: bool, nonfinite: int) -> np.ndarray:
  """Normal values, rounded to a few levels with ``ties``, with ``nonfinite`` NaN/Inf."""
  rng = np.random.default_rng(seed)
  flat = rng.standard_normal(size).astype(np.float32)
  if ties:
    flat = np.round(flat * 2) / 2
  where = rng.integers(0, size, nonfinite)
  flat[where] = rng.choice(np.array([np.nan, np.inf, -np.inf, -np.nan], np.float32), nonfinite)
  return flat


@settings(max_examples=12, deadline=None)
@given(size=st.one_of(st.integers(1, 300), st.integers(MIN_FAST_SIZE - 5, MIN_FAST_SIZE + 4100)),
       value=st.sampled_from([0.25, 1.5, 2.5]), capacity=st.sampled_from([0.02, 0.3]),
       ties=st.booleans(), nonfinite=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_threshold_matches_the_plain_expression(size, value, capacity, ties, nonfinite, seed):
  """Sizes below and above the sampled path of ``largest_k`` (and not multiples of 32);
  thresholds that fit and that overflow the slots; ties; NaN and infinities (never sent)."""
  flat = special_input(size, seed, ties, min(nonfinite, size))
  compressor = threshold(value, capacity=capacity)
  payload, _ = jax.jit(compressor.encode)(jnp.asarray(flat), (), KEY)
  slots = min(size, max(1, math.ceil(capacity * size)))
  assert_payload(payload, reference_payload(flat, value, slots))


@pytest.mark.parametrize("size, density, ties", [(MIN_FAST_SIZE + 77, 0.01, False),
                                                 (MIN_FAST_SIZE + 77, 0.3, True),
                                                 (1000, 0.05, False), (5, 0.5, True)])
def test_adaptive_threshold_matches_the_plain_expression(size, density, ties):
  """The same estimate from the same hashed positions, and the plain expression's payload;
  ``capacity == density`` makes the ties overflow the slots."""
  flat = special_input(size, size, ties, 0)
  flat[3] = np.inf
  compressor = adaptive_threshold(density, capacity=density, sample=0.05)
  payload, _ = jax.jit(compressor.encode)(jnp.asarray(flat), (), KEY)
  value = adaptive_reference_threshold(flat, density, 0.05, KEY)
  slots = min(size, max(1, math.ceil(density * size)))
  assert_payload(payload, reference_payload(flat, value, slots))


@pytest.mark.parametrize("size, at_least, share", [
    (MIN_FAST_SIZE + 1234, 1.0, 0.01),       # the sampled path
    (MIN_FAST_SIZE + 1234, 3.0, 0.01),       # fewer pass than k: the exact branch, ties at 0
    (2 * EXACT_PIECE + 4099, 3.0, 0.01),     # the same for one long row, in pieces
])
def test_largest_k_at_least_is_top_k_of_the_masked_magnitudes(size, at_least, share):
  flat = special_input(size, 11, False, 5)
  k = math.ceil(share * size)
  got = jax.jit(lambda x: largest_k(x, k, at_least=jnp.float32(at_least)))(jnp.asarray(flat))
  np.testing.assert_array_equal(np.asarray(got), masked_top(flat, at_least, k))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a claim about XLA's CPU backend")
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("make", [lambda: threshold(2.5, capacity=0.02),
                                  lambda: adaptive_threshold(0.01, capacity=0.02),
                                  lambda: jaxcomm.error_feedback(adaptive_threshold(0.01))])
def test_encode_temporaries_stay_below_the_mmap_threshold(make):
  """At 16M elements the overflow branch's masked magnitudes were a 64 MiB temporary (95 MiB
  in all), which put the whole block, the usual path's few MiB included, above glibc's mmap
  threshold: about 2,400 page faults per call."""
  compressor, x = make(), jnp.zeros(1 << 24)
  encode = jax.jit(lambda x, state: compressor.encode(x, state, KEY), donate_argnums=(0, 1))
  compiled = encode.lower(x, compressor.init(x.shape, x.dtype)).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < MMAP_THRESHOLD_MAX
