"""The narrow-float conversion on accelerators rounds explicitly, so that a compiler that removes
a float32 -> narrow -> float32 round trip cannot leave error feedback an unrounded estimate.

The accelerators' formulation (``backends.by_platform``'s ``accelerator``) runs here on the CPU
by replacing ``backends.by_platform`` with one that always takes it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm._src.compress.cast import CAST_DTYPES, cast, narrow, round_to, saturate
from jaxcomm._src.compress.error_feedback import estimate_feedback
from jaxcomm.compress import error_feedback, topk

from platform_paths import use_accelerator_path

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None)
ROUND_TO = jax.jit(round_to, static_argnums=1)


def _bits(x) -> np.ndarray:
  return np.asarray(x).view(np.uint32)


def _inputs(dtype, seed: int) -> jax.Array:
  """Random float32 bit patterns; values around ``dtype``'s subnormal, normal and top ends; ties."""
  rng = np.random.default_rng(seed)
  info = jnp.finfo(dtype)
  anywhere = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32).view(np.float32)
  ends = [float(info.smallest_subnormal), float(info.smallest_normal), 1.0, float(info.max)]
  near = np.concatenate([rng.uniform(-4, 4, 1024) * end for end in ends])
  near = np.clip(near, -np.finfo(np.float32).max, np.finfo(np.float32).max)
  odd = 2 * np.arange(2**info.nmant) + 1  # ties: halfway between neighbours, both parities
  ties = np.concatenate([odd * 2.0**-(info.nmant + 1) + 1.0,  # in [1, 2)
                         (np.arange(-64, 65) + 0.5) * float(info.smallest_subnormal)])
  special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
  x = np.concatenate([anywhere, near.astype(np.float32), ties.astype(np.float32), special])
  return saturate(jnp.asarray(x, jnp.float32), dtype)  # what the compressors hand over


@pytest.mark.parametrize("dtype", CAST_DTYPES, ids=lambda d: jnp.dtype(d).name)
@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_round_to_is_the_round_trip_through_the_narrow_dtype_bit_for_bit(dtype, seed):
  x = _inputs(dtype, seed)
  rounded = ROUND_TO(x, dtype)
  round_trip = x.astype(dtype).astype(jnp.float32)
  finite = np.isfinite(np.asarray(round_trip))
  np.testing.assert_array_equal(_bits(rounded)[finite], _bits(round_trip)[finite])
  # Non-finite inputs stay non-finite (e4m3fn turns Inf into NaN when converted).
  assert not np.isfinite(np.asarray(rounded)[~finite]).any()
  # So a compiler that removes the round trip after round_to changes nothing.
  np.testing.assert_array_equal(_bits(rounded.astype(dtype).astype(jnp.float32))[finite],
                                _bits(rounded)[finite])


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("dtype", CAST_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_narrow_is_the_plain_conversion_bit_for_bit_on_both_paths(dtype, accelerator,
                                                                  monkeypatch, request):
  if accelerator:
    use_accelerator_path(monkeypatch, request)
  x = _inputs(dtype, 0)
  narrowed = jax.jit(narrow, static_argnums=1)(x, dtype)
  plain = x.astype(dtype)
  assert narrowed.dtype == plain.dtype
  unsigned = f"uint{8 * plain.dtype.itemsize}"
  np.testing.assert_array_equal(np.asarray(narrowed.view(unsigned)),
                                np.asarray(plain.view(unsigned)))


FEEDBACK_CASES = {
    "cast_fp16": (estimate_feedback, cast(jnp.float16, axis_size=4)),
    "cast_e4m3_scaled": (estimate_feedback, cast(jnp.float8_e4m3fn, scaled=True)),
    "cast_e5m2": (estimate_feedback, cast(jnp.float8_e5m2)),
    "topk_bf16": (error_feedback, topk(0.2, value_dtype=jnp.bfloat16)),
    "topk_chunk_fp16": (error_feedback, topk(0.2, chunk=8, value_dtype=jnp.float16)),
}


@pytest.mark.parametrize("case", FEEDBACK_CASES)
def test_feedback_keeps_what_the_receivers_decode_on_the_accelerator_path(case, monkeypatch,
                                                                          request):
  """EF21 keeps the sum of the decoded payloads; classic EF the input less the decoded one."""
  use_accelerator_path(monkeypatch, request)
  wrap, inner = FEEDBACK_CASES[case]
  compressor = wrap(inner)
  shape = (6, 5)
  state = compressor.init(shape, jnp.float32)
  encode = jax.jit(compressor.encode)
  total_sent = np.zeros(shape, np.float32)
  total_input = np.zeros(shape, np.float32)
  for step in range(4):
    x = jax.random.normal(jax.random.PRNGKey(step), shape)
    payload, state = encode(x, state, jax.random.PRNGKey(100 + step))
    total_sent += np.asarray(compressor.decode(payload, shape))
    total_input += np.asarray(x)
    if wrap is estimate_feedback:
      np.testing.assert_allclose(state.estimate, total_sent, rtol=1e-6, atol=1e-6)
    else:  # what was not sent is still held: input = sent + residual
      np.testing.assert_allclose(total_sent + np.asarray(state.residual), total_input,
                                 rtol=1e-5, atol=1e-5)


def test_float32_is_returned_as_it_is():
  x = jnp.asarray([1.0 / 3.0, -2.5e-40, np.inf], jnp.float32)
  assert round_to(x, jnp.float32) is x and narrow(x, jnp.float32) is x
