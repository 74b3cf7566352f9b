"""Hypothesis over the whole compressor catalog: what each docstring states, for any shape
(odd sizes, size 1, 0-d), float dtype and seed.

Every expected byte count is computed here from the docstring's formula (:data:`BYTES`),
independently of the compressor's own ``wire_bytes``. Each case is one compiled function per
(compressor, shape, dtype) bucket (cached); hypothesis only varies the values and keys inside
it. ``derandomize=True``: the examples are the same on every run, so nothing is flaky.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm.compress import error_feedback, payload_nbytes
from jaxcomm._src.compress.powersgd import matrix_shape
from test_catalog import CATALOG, NAMES

SETTINGS = settings(max_examples=2, deadline=None, derandomize=True, database=None)
SHAPES = st.sampled_from([(), (1,), (7,), (6, 5), (3, 1, 5)])
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
SEEDS = st.integers(0, 2**16)
EF_STEPS = 3
SAMPLES = 1000


def _size(shape) -> int:
  return math.prod(shape)


def _k(d: int, density: float) -> int:
  return min(d, max(1, math.floor(density * d)))


def _capacity(d: int, capacity: float) -> int:
  return max(1, math.ceil(capacity * d))


def _powersgd_bytes(shape, rank: int = 1, min_rate: float = 1.0) -> int:
  if len(shape) >= 2:
    m, n = matrix_shape(tuple(shape))
    if m * n >= min_rate * rank * (m + n):
      return 4 * rank * (m + n)
  return 4 * _size(shape)


def _chunked_topk_bytes(d: int, density: float, chunk: int) -> int:
  width = min(chunk, d)
  return -(-d // width) * _k(width, density) * (4 + 2)


#: Bytes of each catalog entry for a tensor of ``shape``, from its docstring's formula.
BYTES = {
    "identity": lambda s: 4 * _size(s),
    "cast_bf16": lambda s: 2 * _size(s),
    "cast_fp16_guarded": lambda s: 2 * _size(s),
    "cast_e4m3_scaled": lambda s: _size(s) + 4,
    "cast_e5m2": lambda s: _size(s),
    "int4": lambda s: -(-4 * _size(s) // 8) + 4,
    "int3_nearest_chunked": lambda s: -(-3 * _size(s) // 8) + 4 * -(-_size(s) // 5),
    "qsgd": lambda s: -(-_size(s) * (math.ceil(math.log2(4 + 1)) + 1) // 8) + 4,
    "qsgd_bucketed": lambda s: (-(-_size(s) * (math.ceil(math.log2(3 + 1)) + 1) // 8)
                                + 4 * -(-_size(s) // 4)),
    "terngrad": lambda s: -(-_size(s) // 4) + 4,
    "terngrad_unclipped": lambda s: -(-_size(s) // 4) + 4,
    "terngrad_bucketed": lambda s: -(-_size(s) // 4) + 4 * -(-_size(s) // 4),
    "terngrad_bucketed_clipped": lambda s: -(-_size(s) // 4) + 4 * -(-_size(s) // 4),
    "sign": lambda s: -(-_size(s) // 8) + 4,
    "sign_vote": lambda s: -(-_size(s) // 8),
    "natural": lambda s: _size(s) + -(-_size(s) // 8),
    "topk": lambda s: 8 * _k(_size(s), 0.25),
    "topk_chunked": lambda s: _chunked_topk_bytes(_size(s), 0.25, 8),
    "topk_approximate": lambda s: 8 * _k(_size(s), 0.25),
    "randomk_shared": lambda s: 4 * _k(_size(s), 0.25) + 8,
    "randomk_private": lambda s: 8 * _k(_size(s), 0.25),
    "threshold": lambda s: 8 * _capacity(_size(s), 0.5) + 4,
    "adaptive_threshold": lambda s: 8 * _capacity(_size(s), min(1.0, 2 * 0.25)) + 4,
    # compose: the sparsifier's bytes with its float32 values replaced by the quantizer's.
    "topk_int8": lambda s: 4 * _k(_size(s), 0.25) + (_k(_size(s), 0.25) + 4),
    "threshold_int4": lambda s: (4 * _capacity(_size(s), 0.5) + 4
                                 + -(-4 * _capacity(_size(s), 0.5) // 8) + 4),
    "powersgd": _powersgd_bytes,
    "count_sketch": lambda s: 4 * 3 * 8 + 8,
}


def test_every_catalog_entry_has_a_byte_formula():
  assert sorted(BYTES) == NAMES


def _values(shape, dtype, seed):
  return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


@functools.lru_cache(maxsize=None)
def _contract(name, shape, dtype):
  """One compiled function per bucket: a round trip, and ``EF_STEPS`` steps of error
  feedback returning ``(sum of decoded payloads, sum of inputs, last residual)``."""
  compressor, wrapped = CATALOG[name], error_feedback(CATALOG[name])

  def feedback_step(state, inputs):
    x, key = inputs
    payload, state = wrapped.encode(x, state, key)
    return state, wrapped.decode(payload, shape)

  @jax.jit
  def run(x, steps, key):
    payload, _ = compressor.encode(x, compressor.init(shape, dtype), key)
    keys = jax.random.split(key, EF_STEPS)
    state, sent = jax.lax.scan(feedback_step, wrapped.init(shape, dtype), (steps, keys))
    return (payload, compressor.decode(payload, shape), jnp.sum(sent, axis=0),
            jnp.sum(steps.astype(jnp.float32), axis=0), state.residual)

  return run


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(shape=SHAPES, dtype=DTYPES, seed=SEEDS)
def test_round_trip_bytes_and_error_feedback_telescoping(name, shape, dtype, seed):
  x = _values(shape, dtype, seed)
  steps = _values((EF_STEPS, *shape), dtype, seed + 1)
  payload, decoded, sent, total, residual = _contract(name, shape, jnp.dtype(dtype))(
      x, steps, jax.random.PRNGKey(seed))
  assert decoded.shape == shape and decoded.dtype == jnp.float32
  assert payload_nbytes(payload) == BYTES[name](shape)
  # Error feedback loses nothing: sum_t D(m_t) = sum_t g_t - e_T.
  scale = 1.0 + float(jnp.max(jnp.abs(total), initial=0.0))
  np.testing.assert_allclose(sent, total - residual, rtol=1e-5, atol=1e-5 * EF_STEPS * scale)


UNBIASED = sorted(name for name in NAMES if CATALOG[name].unbiased)


@functools.lru_cache(maxsize=None)
def _samples(name, shape):
  """``SAMPLES`` decodes of one input: successive calls from one state (a compressor with a
  shared key in its state draws anew each call), each with its own key."""
  compressor = CATALOG[name]

  def step(state, inputs):
    x, key = inputs
    payload, state = compressor.encode(x, state, key)
    return state, compressor.decode(payload, shape)

  @jax.jit
  def run(x, key):
    xs = jnp.broadcast_to(x, (SAMPLES, *shape))
    state = compressor.init(shape, jnp.float32)
    return jax.lax.scan(step, state, (xs, jax.random.split(key, SAMPLES)))[1]

  return run


@pytest.mark.parametrize("name", UNBIASED)
@SETTINGS
@given(shape=SHAPES, seed=SEEDS)
def test_unbiased_compressors_are_unbiased_in_expectation(name, shape, seed):
  x = _values(shape, jnp.float32, seed)
  decoded = np.asarray(_samples(name, shape)(x, jax.random.PRNGKey(seed)), np.float64)
  mean, std = decoded.mean(0), decoded.std(0)
  # Five standard errors per element (fixed seeds: a deterministic check), plus rounding.
  bound = 5.0 * std / math.sqrt(SAMPLES) + 1e-5 * (1.0 + np.abs(np.asarray(x)))
  np.testing.assert_array_less(np.abs(mean - np.asarray(x)), bound)


@pytest.mark.parametrize("name", ["topk", "topk_approximate"])
@SETTINGS
@given(shape=SHAPES, seed=SEEDS)
def test_topk_keeps_exactly_k_of_the_largest(name, shape, seed):
  x = np.asarray(_values(shape, jnp.float32, seed)).reshape(-1)
  run = _contract(name, shape, jnp.dtype(jnp.float32))
  decoded = np.asarray(run(x.reshape(shape), jnp.zeros((EF_STEPS, *shape)),
                           jax.random.PRNGKey(seed))[1]).reshape(-1)
  kept = decoded != 0
  assert kept.sum() == _k(x.size, 0.25)
  np.testing.assert_array_equal(decoded[kept], x[kept])
  if not kept.all():
    assert np.abs(x[kept]).min() >= np.abs(x[~kept]).max()
