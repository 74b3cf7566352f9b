"""The local block kernel: merge algebra, masked rows, and cuDNN/XLA selection."""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from jaxcomm._src.parallel import blocks
import fast_random


def _qkv(seq_q, seq_k, heads=4, kv_heads=2, dim=8, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (fast_random.normal(keys[0], (2, seq_q, heads, dim), dtype),
          fast_random.normal(keys[1], (2, seq_k, kv_heads, dim), dtype),
          fast_random.normal(keys[2], (2, seq_k, kv_heads, dim), dtype))


@functools.partial(jax.jit, static_argnums=3)
def _whole_and_merged(q, k, v, cut):
  scale = 0.3
  whole = blocks.block_forward(q, k, v, scale=scale, implementation="xla")
  first = blocks.block_forward(q, k[:, :cut], v[:, :cut], scale=scale, implementation="xla")
  second = blocks.block_forward(q, k[:, cut:], v[:, cut:], scale=scale, implementation="xla")
  return whole, blocks.merge_partials(*first, *second)


# A few cut points (each compiles once), many random inputs per cut.
@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(cut=st.sampled_from([1, 4, 9]), seed=st.integers(0, 2**16))
def test_merging_two_key_sets_equals_attending_to_both(cut, seed):
  q, k, v = _qkv(5, 10, seed=seed)
  (whole, whole_lse), (merged, merged_lse) = _whole_and_merged(q, k, v, cut)
  np.testing.assert_allclose(merged, whole, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(merged_lse, whole_lse, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      whole, jax.nn.dot_product_attention(q, k, v, scale=0.3), rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
  q, k, v = _qkv(4, 4)
  out, lse = blocks.block_forward(q, k, v, scale=1.0, mask="strict", implementation="xla")
  assert np.all(np.isneginf(np.asarray(lse[:, 0])))   # query 0 sees no key j < 0
  np.testing.assert_array_equal(out[:, 0], 0.0)
  merged, merged_lse = blocks.merge_partials(out, lse, out, lse)
  assert np.all(np.isfinite(np.asarray(merged)))
  assert np.all(np.isneginf(np.asarray(merged_lse[:, 0])))
  grads = blocks.block_backward(q, k, v, jnp.ones_like(q), lse, jnp.zeros_like(lse), scale=1.0,
                                mask="strict")
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


def test_automatic_selection_is_xla_on_cpu():
  assert jax.default_backend() == "cpu"
  for dtype in (jnp.float32, jnp.bfloat16):
    assert blocks.select_implementation(None, dtype, 64, "causal") == "xla"


def test_selection_on_gpu_follows_cudnn_constraints():
  assert blocks.select_implementation(None, jnp.bfloat16, 64, "causal", backend="gpu") == "cudnn"
  assert blocks.select_implementation(None, jnp.bfloat16, 64, None, backend="gpu") == "cudnn"
  assert blocks.select_implementation(None, jnp.float32, 64, None, backend="gpu") == "xla"
  assert blocks.select_implementation(None, jnp.bfloat16, 64, "strict", backend="gpu") == "xla"
  assert blocks.select_implementation(None, jnp.bfloat16, 12, None, backend="gpu") == "xla"
  assert blocks.select_implementation("xla", jnp.bfloat16, 64, None, backend="gpu") == "xla"
  # cuDNN cannot express j < i: even when asked for explicitly, those blocks run on XLA.
  assert blocks.select_implementation("cudnn", jnp.bfloat16, 64, "strict", backend="gpu") == "xla"


def test_automatic_cudnn_falls_back_to_xla_when_cudnn_refuses(monkeypatch):
  # Pretend cuDNN is supported on this CPU: the cuDNN call raises at trace time and the
  # automatic choice must quietly compute the same result with the XLA kernel.
  monkeypatch.setattr(blocks, "cudnn_supports", lambda *args, **kwargs: True)
  q, k, v = _qkv(8, 8, dtype=jnp.bfloat16)
  assert blocks.select_implementation(None, q.dtype, 8, "causal") == "cudnn"
  auto = blocks.block_forward(q, k, v, scale=0.5, mask="causal")
  xla = blocks.block_forward(q, k, v, scale=0.5, mask="causal", implementation="xla")
  for a, b in zip(auto, xla):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(RuntimeError):  # asked for explicitly, the refusal is not hidden
    blocks.block_forward(q, k, v, scale=0.5, mask="causal", implementation="cudnn")


def test_unknown_implementation():
  with pytest.raises(ValueError, match="implementation='triton'"):
    blocks.select_implementation("triton", jnp.float32, 8, None)
