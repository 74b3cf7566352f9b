"""The local block kernel of blockwise attention, its backward, and the log-sum-exp merge.

A block is the attention of a query shard ``(B, Sq, H, D)`` against one key/value shard
``(B, Sk, H_kv, D)`` (``H`` a multiple of ``H_kv``: grouped-query attention). The forward returns
the block's normalized output and its log-sum-exp ``lse = log sum_k exp(s_qk)``, both in fp32,
so partial results over different key blocks merge exactly with ``merge_partials``. The
backward recomputes the block's scores from the *final* ``lse`` (FlashAttention-2, section
3.1.1), so no score matrix is ever stored between passes.

Masks are relative to local indices: ``'causal'`` keeps key ``j <= i`` for query ``i``,
``'strict'`` keeps ``j < i`` (the striped layout's blocks from a later device). A fully masked
query row has ``lse = -inf`` and output 0, never NaN.

On GPU the forward uses ``jax.nn.dot_product_attention(..., implementation='cudnn')`` (cuDNN
flash attention, which returns the log-sum-exp residual) for the masks cuDNN expresses and
dtypes it supports; everywhere else, and whenever cuDNN refuses the call, pure ``jax.numpy``.

References:
  Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
  Partitioning", https://arxiv.org/abs/2307.08691
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

Mask = Literal["causal", "strict"] | None
IMPLEMENTATIONS = ("xla", "cudnn", None)

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128


def check_implementation(implementation: str | None) -> None:
  """Raises ``ValueError`` unless ``implementation`` is ``'xla'``, ``'cudnn'`` or ``None``."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation={implementation!r} is unknown; expected one of {IMPLEMENTATIONS}.")


def cudnn_supports(dtype, head_dim: int, mask: Mask, backend: str | None = None) -> bool:
  """Whether the cuDNN flash-attention kernel can run this block.

  cuDNN flash attention needs a CUDA GPU, fp16/bf16 inputs, a head dim that is a multiple of 8
  up to 128, and a mask it knows: none or causal including the diagonal (so ``'strict'``
  blocks stay on XLA).
  """
  backend = jax.default_backend() if backend is None else backend
  return (backend in ("gpu", "cuda") and jnp.dtype(dtype) in map(jnp.dtype, _CUDNN_DTYPES)
          and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM and mask != "strict")


def select_implementation(implementation: str | None, dtype, head_dim: int, mask: Mask,
                          backend: str | None = None) -> str:
  """Resolves ``None`` (automatic) to ``'cudnn'`` where supported, else ``'xla'``.

  A ``'strict'`` mask always resolves to ``'xla'``: cuDNN's causal mask includes the diagonal,
  so even an explicit ``'cudnn'`` cannot run the striped layout's strictly-causal blocks.
  """
  check_implementation(implementation)
  if mask == "strict":
    return "xla"
  if implementation is not None:
    return implementation
  return "cudnn" if cudnn_supports(dtype, head_dim, mask, backend) else "xla"


def _group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
  batch, seq, heads, dim = q.shape
  return q.reshape(batch, seq, num_kv_heads, heads // num_kv_heads, dim)


def _scores(q: jax.Array, k: jax.Array, scale: float, mask: Mask) -> jax.Array:
  """Scaled fp32 scores ``(B, H_kv, G, Sq, Sk)``, masked entries ``-inf``."""
  s = jnp.einsum("bqhgd,bkhd->bhgqk", _group_queries(q, k.shape[2]), k,
                 preferred_element_type=jnp.float32) * scale
  if mask is None:
    return s
  rows, cols = s.shape[-2:]
  keep = jnp.tril(jnp.ones((rows, cols), bool), k=0 if mask == "causal" else -1)
  return jnp.where(keep, s, -jnp.inf)


def _heads_last(x: jax.Array) -> jax.Array:
  """``(B, H_kv, G, Sq)`` -> ``(B, Sq, H)``."""
  batch, kv_heads, groups, seq = x.shape
  return x.transpose(0, 3, 1, 2).reshape(batch, seq, kv_heads * groups)


def _heads_grouped(x: jax.Array, num_kv_heads: int) -> jax.Array:
  """``(B, Sq, H)`` -> ``(B, H_kv, G, Sq, 1)``, to broadcast against scores."""
  batch, seq, heads = x.shape
  return x.reshape(batch, seq, num_kv_heads, heads // num_kv_heads).transpose(0, 2, 3, 1)[..., None]


def _forward_xla(q, k, v, scale, mask):
  s = _scores(q, k, scale, mask)
  row_max = s.max(axis=-1, keepdims=True)
  # A fully masked row has max -inf; shifting by 0 instead keeps exp() at 0 rather than NaN.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.exp(s - row_max)
  row_sum = p.sum(axis=-1, keepdims=True)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  denom = jnp.where(row_sum > 0, row_sum, 1.0)[..., 0].transpose(0, 3, 1, 2)[..., None]
  out = (out / denom).reshape(q.shape[:3] + (v.shape[-1],))
  lse = jnp.where(row_sum > 0, row_max + jnp.log(row_sum), -jnp.inf)[..., 0]
  return out, _heads_last(lse)


def _forward_cudnn(q, k, v, scale, mask):
  out, lse = jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=mask == "causal", implementation="cudnn",
      return_residual=True)
  return out.astype(jnp.float32), lse.astype(jnp.float32)


def block_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, mask: Mask = None,
                  implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Attention of one query block against one key/value block.

  Args:
    q: queries ``(B, Sq, H, D)``.
    k: keys ``(B, Sk, H_kv, D)``, ``H % H_kv == 0``.
    v: values ``(B, Sk, H_kv, D)``.
    scale: multiplier of the scores, usually ``D ** -0.5``.
    mask: ``None``, ``'causal'`` (key ``j <= i``) or ``'strict'`` (key ``j < i``), local indices.
    implementation: ``'xla'`` (pure ``jax.numpy``), ``'cudnn'`` (required; errors propagate;
      ``'strict'`` blocks still use XLA) or ``None``: cuDNN where ``cudnn_supports`` says so
      and the call is accepted, else XLA.

  Returns:
    ``(out, lse)``: normalized output ``(B, Sq, H, D)`` and log-sum-exp ``(B, Sq, H)``, fp32.
  """
  chosen = select_implementation(implementation, q.dtype, q.shape[-1], mask)
  if chosen == "xla":
    return _forward_xla(q, k, v, scale, mask)
  if implementation == "cudnn":
    return _forward_cudnn(q, k, v, scale, mask)
  try:
    return _forward_cudnn(q, k, v, scale, mask)
  except (RuntimeError, ValueError, NotImplementedError):
    # cuDNN rejects some shapes/versions at trace time; the XLA kernel computes the same thing.
    return _forward_xla(q, k, v, scale, mask)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
                    causal: bool = False, implementation: str | None = None) -> jax.Array:
  """Unsharded attention, ``jax.nn.dot_product_attention`` with the same kernel choice.

  ``implementation=None`` takes cuDNN where ``cudnn_supports`` says so and falls back to XLA
  when cuDNN refuses the call; differentiable through JAX's own VJP of either kernel.

  Args:
    q: ``(B, S, H, D)``; k, v: ``(B, S, H_kv, D)``.
    scale: score multiplier; defaults to ``D ** -0.5``.
    causal: causal mask over the (natural-order) sequence.
    implementation: ``None``, ``'xla'`` or ``'cudnn'``.

  Returns:
    ``(B, S, H, D)`` in ``q.dtype``.
  """
  attend = functools.partial(jax.nn.dot_product_attention, q, k, v, scale=scale,
                             is_causal=causal)
  chosen = select_implementation(implementation, q.dtype, q.shape[-1],
                                 "causal" if causal else None)
  if chosen == "xla" or implementation == "cudnn":
    return attend(implementation=chosen)
  try:
    return attend(implementation="cudnn")
  except (RuntimeError, ValueError, NotImplementedError):
    return attend(implementation="xla")


def block_backward(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array, lse: jax.Array,
                   delta: jax.Array, *, scale: float, mask: Mask = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradients of one block's contribution, given the final ``lse`` and ``delta``.

  Args:
    q, k, v: as in ``block_forward``.
    d_out: cotangent of the final attention output ``(B, Sq, H, D)``.
    lse: final log-sum-exp over *all* key blocks ``(B, Sq, H)``, fp32.
    delta: ``sum(d_out * out, -1)`` of the final output ``(B, Sq, H)``, fp32.
    scale, mask: as in ``block_forward``.

  Returns:
    ``(dq, dk, dv)`` in fp32 with the shapes of ``q``, ``k``, ``v``: this block's share.
  """
  kv_heads = k.shape[2]
  s = _scores(q, k, scale, mask)
  lse = _heads_grouped(lse, kv_heads)
  # Rows with lse = -inf are fully masked: all their s are -inf too, so p = exp(-inf) = 0.
  p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0))
  d_out_grouped = _group_queries(d_out, kv_heads)
  dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(d_out.dtype), d_out_grouped,
                  preferred_element_type=jnp.float32)
  dp = jnp.einsum("bqhgd,bkhd->bhgqk", d_out_grouped, v, preferred_element_type=jnp.float32)
  ds = (p * (dp - _heads_grouped(delta, kv_heads)) * scale).astype(q.dtype)
  dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, _group_queries(q, kv_heads),
                  preferred_element_type=jnp.float32)
  return dq.reshape(q.shape), dk, dv


def merge_partials(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """Merges two *normalized* partial attentions over disjoint key sets.

  ``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``.
  A side with ``lse = -inf`` (no keys) gets weight 0; both sides empty give ``(0, -inf)``.

  Args:
    out_a, out_b: ``(B, Sq, H, D)`` fp32.
    lse_a, lse_b: ``(B, Sq, H)`` fp32.

  Returns:
    ``(out, lse)`` of the union of both key sets.
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  shift = jnp.where(jnp.isfinite(lse), lse, 0.0)
  weight_a = jnp.exp(lse_a - shift)[..., None]
  weight_b = jnp.exp(lse_b - shift)[..., None]
  return weight_a * out_a + weight_b * out_b, lse
