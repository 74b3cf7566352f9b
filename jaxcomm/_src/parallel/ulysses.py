"""Ulysses (head-parallel) attention, and the Ulysses x ring hybrid for two-level meshes.

Ulysses turns sequence sharding into head sharding with one ``all_to_all``: each device gives
up ``(P-1)/P`` of its local tokens for all heads and receives all tokens for ``H/P`` heads,
attends locally over the whole sequence, and a second ``all_to_all`` restores sequence
sharding. Per device and direction an all-to-all of a local ``(B, S/P, H, D)`` array moves
``B * (S/P) * H * D * itemsize * (P-1)/P`` bytes; the forward pays it for q, k, v and the
output (K/V with ``H_kv`` heads), the backward for their cotangents. Unlike the ring this is
independent of ``P`` per device but needs ``P`` to divide the heads.

The hybrid runs Ulysses over the fast axis (all-to-all stays on NVLink/ICI) and the ring over
the slow axis (only neighbour ppermutes cross the network), so a (hosts, local) mesh splits
heads x sequence.

References:
  Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
  Extreme Long Sequence Transformer Models", https://arxiv.org/abs/2309.14509
  Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", https://arxiv.org/abs/2310.01889
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.parallel import _checks
from jaxcomm._src.parallel.blocks import check_implementation, dense_attention
from jaxcomm._src.parallel.layouts import check_layout, chunks_per_shard, layout_permutation
from jaxcomm._src.parallel.ring_attention import ring_attention


def _check_heads(q, k, size: int, parameter: str, axis_name: str) -> None:
  heads, kv_heads = q.shape[2], k.shape[2]
  if heads % size:
    raise ValueError(
        f"q heads ({heads}, q.shape[2]) are not divisible by the size {size} of "
        f"{parameter}={axis_name!r}; Ulysses gives each device heads / {size} heads.")
  if kv_heads % size and size % kv_heads:
    raise ValueError(
        f"k/v heads ({kv_heads}, k.shape[2]) must divide or be divisible by the size {size} "
        f"of {parameter}={axis_name!r}.")


def _sequence_to_heads(q, k, v, axis_name: str, size: int):
  """``(B, n, H, D)`` sequence shards -> ``(B, n * P, H / P, D)`` head shards."""
  if k.shape[2] % size:
    # Fewer K/V heads than devices: each device needs the one K/V head of its query group,
    # so replicate every K/V head P / H_kv times before splitting (ratio H / H_kv is kept).
    k, v = (jnp.repeat(x, size // k.shape[2], axis=2) for x in (k, v))
  return tuple(jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
               for x in (q, k, v))


def _heads_to_sequence(out, axis_name: str):
  return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str,
                      causal: bool = False, layout: str = "contiguous",
                      scale: float | None = None, implementation: str | None = None
                      ) -> jax.Array:
  """Exact attention over a sequence sharded along ``axis_name``, by re-sharding the heads.

  Call inside ``jax.shard_map`` with the sequence of ``q``, ``k``, ``v`` sharded over
  ``axis_name`` in ``layout`` order.

  Args:
    q: local queries ``(B, n, H, D)``, ``n = S / P``; ``P`` must divide ``H``.
    k: local keys ``(B, n, H_kv, D)``; ``H_kv`` must divide or be a multiple of ``P``.
    v: local values ``(B, n, H_kv, D)``.
    axis_name: the mesh axis the sequence is sharded over (size ``P``).
    causal: apply a causal mask over global token positions.
    layout: ``'contiguous'``, ``'zigzag'`` or ``'striped'``, as for ``ring_attention``.
    scale: score multiplier; defaults to ``D ** -0.5``.
    implementation: ``None`` (cuDNN on GPU when possible, else XLA), ``'xla'`` or ``'cudnn'``.

  Returns:
    The local attention output ``(B, n, H, D)`` in ``q.dtype``.

  Raises:
    ValueError: heads not divisible by the axis size, bad shapes, unknown ``layout``,
      ``axis_name`` not bound, ``n`` not divisible by the layout's chunks per shard.
    TypeError: non-floating or mismatched dtypes.
  """
  _checks.check_qkv(q, k, v)
  check_layout(layout)
  check_implementation(implementation)
  size = _checks.bound_axis_size(axis_name)
  _check_heads(q, k, size, "axis_name", axis_name)
  chunks = chunks_per_shard(layout)
  if q.shape[1] % chunks:
    raise ValueError(
        f"per-device sequence length {q.shape[1]} (q.shape[1]) is not divisible by "
        f"{chunks}, the chunks per shard of layout={layout!r}.")
  q, k, v = _checks.match_varying(q, k, v, axis_names=(axis_name,))
  q, k, v = _sequence_to_heads(q, k, v, axis_name, size)
  # After the all-to-all the whole sequence is local, in layout order. Restoring the natural
  # order lets the kernel use its built-in causal mask (cuDNN skips masked tiles).
  perm = layout_permutation(layout, q.shape[1], size)
  natural = causal and layout != "contiguous"
  if natural:
    q, k, v = (jnp.take(x, np.argsort(perm), axis=1) for x in (q, k, v))
  out = dense_attention(q, k, v, scale=scale, causal=causal, implementation=implementation)
  if natural:
    out = jnp.take(out, perm, axis=1)
  return _heads_to_sequence(out, axis_name)


def hybrid_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, ring_axis: str,
                     ulysses_axis: str, causal: bool = False, layout: str = "contiguous",
                     scale: float | None = None, implementation: str | None = None
                     ) -> jax.Array:
  """Ulysses over ``ulysses_axis`` (fast) and ring attention over ``ring_axis`` (slow).

  The global sequence is laid out for the ring (``to_layout(x, layout, P_ring)``) and sharded
  over both axes, ring axis major: ``PartitionSpec(None, (ring_axis, ulysses_axis))``. The
  all-to-all over the fast axis then hands each device the ring shard of its slow index for
  ``H / P_ulysses`` heads, and the ring runs over the slow axis on those heads.

  Args:
    q: local queries ``(B, S / (P_ring * P_ulysses), H, D)``.
    k, v: local keys and values ``(B, S / (P_ring * P_ulysses), H_kv, D)``.
    ring_axis: slow mesh axis (``'host'``), size ``P_ring``.
    ulysses_axis: fast mesh axis (``'local'``), size ``P_ulysses``; must divide ``H``.
    causal, layout, scale, implementation: as for ``ring_attention``.

  Returns:
    The local attention output, shaped like ``q``.

  Raises:
    ValueError, TypeError: as for ``ring_attention`` and ``ulysses_attention``, naming the axis
      parameter at fault.
  """
  _checks.check_qkv(q, k, v)
  check_layout(layout)
  check_implementation(implementation)
  ulysses_size = _checks.bound_axis_size(ulysses_axis, "ulysses_axis")
  _checks.bound_axis_size(ring_axis, "ring_axis")
  if ring_axis == ulysses_axis:
    raise ValueError(f"ring_axis and ulysses_axis must differ; both are {ring_axis!r}.")
  _check_heads(q, k, ulysses_size, "ulysses_axis", ulysses_axis)
  q, k, v = _checks.match_varying(q, k, v, axis_names=(ring_axis, ulysses_axis))
  q, k, v = _sequence_to_heads(q, k, v, ulysses_axis, ulysses_size)
  out = ring_attention(q, k, v, axis_name=ring_axis, causal=causal, layout=layout, scale=scale,
                       implementation=implementation)
  return _heads_to_sequence(out, ulysses_axis)
