"""PowerSGD's error-feedback residual ``M - P Q^T`` written over ``M`` in row blocks."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm
from jaxcomm._src.compress import powersgd as powersgd_module
from platform_paths import use_accelerator_path


def former_outer_sum_rows(p, q):
  """Session 19's decode: ``p``'s columns read where they lie (stride ``r``)."""
  total = q[:, None, 0] * p[None, :, 0]
  for column in range(1, q.shape[-1]):
    total = total + q[:, None, column] * p[None, :, column]
  return total


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 70), m=st.integers(1, 40), rank=st.integers(1, 4),
       block=st.sampled_from([1, 16, 64, 200]), seed=st.integers(0, 2**16))
def test_blocked_subtraction_is_the_plain_expression_bit_for_bit(n, m, rank, block, seed):
  """Blocks of ``block`` elements (so one block, several, and several with a shorter tail),
  against ``rows - outer_sum_rows(p, q)`` and the former expression (``p`` not transposed)
  exactly, and the float64 product up to rounding."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  rows = jax.random.normal(keys[0], (n, m))
  p = jax.random.normal(keys[1], (m, rank))
  q = jax.random.normal(keys[2], (n, rank))
  with mock.patch.object(powersgd_module, "SUBTRACT_BLOCK", block):
    blocked = jax.jit(powersgd_module.subtract_outer_sum_rows)(rows, p, q)
  plain = jax.jit(lambda rows, p, q: rows - powersgd_module.outer_sum_rows(p, q))(rows, p, q)
  np.testing.assert_array_equal(blocked, plain)
  former = jax.jit(lambda rows, p, q: rows - former_outer_sum_rows(p, q))(rows, p, q)
  np.testing.assert_array_equal(blocked, former)
  dense = np.asarray(rows, np.float64) - np.asarray(q, np.float64) @ np.asarray(p, np.float64).T
  np.testing.assert_allclose(blocked, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("shape", [(2048, 1024), (3, 3, 300, 512)])
def test_error_feedback_residual_is_x_minus_decode_bit_for_bit(shape, accelerator, monkeypatch,
                                                                request):
  """Above two blocks (the CPU's loop), and in the accelerators' one expression,
  ``ef(powersgd)``'s residual is ``x + e - decode``."""
  if accelerator:
    use_accelerator_path(monkeypatch, request)
  compressor = jaxcomm.error_feedback(jaxcomm.powersgd(4))
  keys = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(keys[0], shape)
  state = compressor.init(shape, jnp.float32)
  state = state._replace(residual=jax.random.normal(keys[1], shape))
  payload, after = jax.jit(lambda x, state: compressor.encode(x, state, None))(x, state)
  expected = jax.jit(lambda x, e, payload: x + e - compressor.decode(payload, shape))(
      x, state.residual, payload)
  np.testing.assert_array_equal(after.residual, expected)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a claim about XLA's CPU backend")
# The gradient is donated, as benchmarks/compressors.py donates it. No output aliases it, so
# jax warns that it is "not usable", yet XLA writes the corrected input into it: without its
# donation (the state alone donated) the temporaries grow from 0.3 to 16.3 MiB here.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_error_feedback_encode_makes_no_temporary_of_the_input_size():
  """XLA's CPU backend materializes the residual (two consumers) in a fresh temporary, paged
  in anew every call, unless it is written over the corrected input in place."""
  shape = (2048, 2048)
  compressor = jaxcomm.error_feedback(jaxcomm.powersgd(4))
  x = jnp.zeros(shape)
  encode = jax.jit(lambda x, state: compressor.encode(x, state, None), donate_argnums=(0, 1))
  compiled = encode.lower(x, compressor.init(shape, jnp.float32)).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < x.nbytes // 4
