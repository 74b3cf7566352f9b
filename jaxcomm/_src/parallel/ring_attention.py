"""Ring attention: exact attention over a sequence sharded along one mesh axis.

Each of the ``P`` devices of ``axis_name`` keeps its query shard and passes its key/value shard
to the next device, ``P - 1`` times, so every query shard meets every key/value shard once.
Partial results are merged with an online softmax carried as (normalized output, log-sum-exp)
in fp32. At every step the ``ppermute`` of the *next* K/V block is issued before the current
block's matmuls and nothing in it depends on them, so XLA can run the transfer behind the
compute (double buffering: the current and the incoming block are both live).

Communication per device (``n = S / P`` local tokens, ``b`` = input itemsize):

* forward: ``P - 1`` steps, each ppermutes K and V: ``2 * B * n * H_kv * D * b`` bytes.
* backward: ``P - 1`` K/V steps as above, plus ``P`` hops of the fp32 dK/dV accumulators
  travelling with their block back to its owner: ``2 * B * n * H_kv * D * 4`` bytes each.

Memory per device is O(n): the backward saves only ``q, k, v``, the output and the fp32
log-sum-exp of the local shard and recomputes block scores (no full-sequence residuals).
Under a causal mask the layout's ``block_schedule`` decides per (query shard, key shard) what
is computed; fully masked blocks are skipped by ``lax.switch``, not computed and discarded.

References:
  Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", https://arxiv.org/abs/2310.01889
  Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal Transformers",
  https://arxiv.org/abs/2311.09431
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.parallel import _checks
from jaxcomm._src.parallel.blocks import (block_backward, block_forward, check_implementation,
                                          merge_partials)
from jaxcomm._src.parallel.layouts import BlockKind, block_schedule, check_layout, chunks_per_shard


class _RingConfig(NamedTuple):
  axis_name: str
  axis_size: int
  causal: bool
  layout: str
  scale: float
  implementation: str | None


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str,
                   causal: bool = False, layout: str = "contiguous", scale: float | None = None,
                   implementation: str | None = None) -> jax.Array:
  """Exact multi-head attention over a sequence sharded along ``axis_name``.

  Call inside ``jax.shard_map`` with the sequence axis of ``q``, ``k``, ``v`` sharded over
  ``axis_name`` in ``layout`` order (see ``jaxcomm.parallel.to_layout``). Other mesh axes
  (data parallelism, say) may shard the batch.

  Args:
    q: local queries ``(B, n, H, D)``, ``n = S / P``.
    k: local keys ``(B, n, H_kv, D)``; ``H % H_kv == 0`` (grouped-query attention).
    v: local values ``(B, n, H_kv, D)``.
    axis_name: the mesh axis the sequence is sharded over (size ``P``).
    causal: apply a causal mask over global token positions.
    layout: ``'contiguous'``, ``'zigzag'`` or ``'striped'``: how the global sequence was laid
      out over the devices. Only matters when ``causal``.
    scale: score multiplier; defaults to ``D ** -0.5``.
    implementation: block kernel, ``None`` (cuDNN on GPU when possible, else XLA), ``'xla'`` or
      ``'cudnn'``.

  Returns:
    The local attention output ``(B, n, H, D)`` in ``q.dtype`` (accumulated in fp32).

  Raises:
    ValueError: bad shapes, unknown ``layout`` or ``implementation``, ``axis_name`` not bound
      by the enclosing shard_map, ``n`` not divisible by the layout's chunks per shard.
    TypeError: non-floating or mismatched dtypes.

  Example:
    >>> attend = functools.partial(ring_attention, axis_name='seq', causal=True,
    ...                            layout='zigzag')  # doctest: +SKIP
    >>> out = jax.shard_map(attend, mesh=mesh, in_specs=P(None, 'seq'),
    ...                     out_specs=P(None, 'seq'))(q, k, v)  # doctest: +SKIP
  """
  _checks.check_qkv(q, k, v)
  check_layout(layout)
  check_implementation(implementation)
  size = _checks.bound_axis_size(axis_name)
  chunks = chunks_per_shard(layout)
  if q.shape[1] % chunks:
    raise ValueError(
        f"per-device sequence length {q.shape[1]} (q.shape[1]) is not divisible by "
        f"{chunks}, the chunks per shard of layout={layout!r}; the global length must be "
        f"a multiple of {chunks * size}.")
  config = _RingConfig(axis_name, size, bool(causal), layout,
                       float(q.shape[-1] ** -0.5 if scale is None else scale), implementation)
  q, k, v = _checks.match_varying(q, k, v, axis_names=(axis_name,))
  return _ring(q, k, v, config)


def _send_to_next(config: _RingConfig, *blocks: jax.Array) -> tuple[jax.Array, ...]:
  """Device ``i`` sends to ``i + 1``: after step ``j`` device ``r`` holds the block of ``r - j``."""
  perm = [(i, (i + 1) % config.axis_size) for i in range(config.axis_size)]
  return tuple(jax.lax.ppermute(x, config.axis_name, perm) for x in blocks)


def _branch_of_step(config: _RingConfig, step, kinds: list[BlockKind]) -> jax.Array:
  """Index into ``kinds`` of the block this device computes at ``step``."""
  table = block_schedule(config.layout, config.axis_size, config.causal)
  branch_table = np.vectorize(lambda kind: kinds.index(kind))(table).astype(np.int32)
  rank = jax.lax.axis_index(config.axis_name)
  origin = (rank - step) % config.axis_size
  return jnp.asarray(branch_table)[rank, origin]


def _kinds(config: _RingConfig) -> list[BlockKind]:
  # Only kinds that occur are traced, so a non-causal ring compiles a single branch.
  return sorted({BlockKind(kind) for kind in
                 block_schedule(config.layout, config.axis_size, config.causal).flat})


_MASK = {BlockKind.FULL: None, BlockKind.CAUSAL: "causal", BlockKind.STRICT: "strict"}


def _forward_branch(kind: BlockKind, config: _RingConfig):
  """``(q, k, v, out, lse) -> (out, lse)`` with this block merged in."""
  attend = functools.partial(block_forward, scale=config.scale,
                             implementation=config.implementation)

  def branch(q, k, v, out, lse):
    if kind == BlockKind.SKIP:
      return out, lse
    if kind == BlockKind.TRAILING_QUERIES:
      half = q.shape[1] // 2
      merged = merge_partials(out[:, half:], lse[:, half:], *attend(q[:, half:], k, v))
      return (jnp.concatenate([out[:, :half], merged[0]], axis=1),
              jnp.concatenate([lse[:, :half], merged[1]], axis=1))
    if kind == BlockKind.LEADING_KEYS:
      half = k.shape[1] // 2
      k, v = k[:, :half], v[:, :half]
    return merge_partials(out, lse, *attend(q, k, v, mask=_MASK.get(kind)))

  return branch


def _ring_forward(q, k, v, config: _RingConfig):
  kinds = _kinds(config)
  branches = [_forward_branch(kind, config) for kind in kinds]

  def compute(step, k_block, v_block, out, lse):
    index = _branch_of_step(config, step, kinds)
    return jax.lax.switch(index, branches, q, k_block, v_block, out, lse)

  def step_with_send(step, carry):
    out, lse, k_block, v_block = carry
    # Issued before, and independent of, this step's matmuls: the transfer can overlap them.
    k_next, v_next = _send_to_next(config, k_block, v_block)
    out, lse = compute(step, k_block, v_block, out, lse)
    return out, lse, k_next, v_next

  out = jnp.zeros_like(q, jnp.float32)
  lse = jnp.full_like(q[..., 0], -jnp.inf, jnp.float32)
  out, lse, k_last, v_last = jax.lax.fori_loop(
      0, config.axis_size - 1, step_with_send, (out, lse, k, v))
  return compute(config.axis_size - 1, k_last, v_last, out, lse)


def _backward_branch(kind: BlockKind, config: _RingConfig):
  """``(q, k, v, d_out, lse, delta, dq) -> (dq, dk_block, dv_block)``."""
  grads = functools.partial(block_backward, scale=config.scale)

  def branch(q, k, v, d_out, lse, delta, dq):
    dk = jnp.zeros_like(k, jnp.float32)
    dv = jnp.zeros_like(v, jnp.float32)
    if kind == BlockKind.SKIP:
      return dq, dk, dv
    if kind == BlockKind.TRAILING_QUERIES:
      half = q.shape[1] // 2
      dq_half, dk, dv = grads(q[:, half:], k, v, d_out[:, half:], lse[:, half:],
                              delta[:, half:])
      return dq.at[:, half:].add(dq_half), dk, dv
    if kind == BlockKind.LEADING_KEYS:
      half = k.shape[1] // 2
      dq_block, dk_half, dv_half = grads(q, k[:, :half], v[:, :half], d_out, lse, delta)
      return dq + dq_block, dk.at[:, :half].set(dk_half), dv.at[:, :half].set(dv_half)
    dq_block, dk, dv = grads(q, k, v, d_out, lse, delta, mask=_MASK.get(kind))
    return dq + dq_block, dk, dv

  return branch


def _ring_backward_pass(q, k, v, out, lse, d_out, config: _RingConfig):
  kinds = _kinds(config)
  branches = [_backward_branch(kind, config) for kind in kinds]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

  def contributions(step, k_block, v_block, dq):
    index = _branch_of_step(config, step, kinds)
    return jax.lax.switch(index, branches, q, k_block, v_block, d_out, lse, delta, dq)

  def step(step_index, carry, send_kv):
    dq, k_block, v_block, dk_prev, dv_prev = carry
    k_next, v_next = (_send_to_next(config, k_block, v_block) if send_kv
                      else (k_block, v_block))
    # The accumulators of the block this device now holds arrive from the previous device;
    # only the final add waits for them, not this step's matmuls.
    dk_in, dv_in = _send_to_next(config, dk_prev, dv_prev)
    dq, dk_block, dv_block = contributions(step_index, k_block, v_block, dq)
    return dq, k_next, v_next, dk_in + dk_block, dv_in + dv_block

  dq = jnp.zeros_like(q, jnp.float32)
  size = config.axis_size
  if size == 1:
    dq, dk, dv = contributions(0, k, v, dq)
  else:
    k_next, v_next = _send_to_next(config, k, v)
    dq, dk, dv = contributions(0, k, v, dq)
    carry = jax.lax.fori_loop(1, size - 1, functools.partial(step, send_kv=True),
                              (dq, k_next, v_next, dk, dv))
    dq, _, _, dk, dv = step(size - 1, carry, send_kv=False)
    # The last hop brings every accumulator back to the device that owns its block.
    dk, dv = _send_to_next(config, dk, dv)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, config: _RingConfig):
  out, _ = _ring_forward(q, k, v, config)
  return out.astype(q.dtype)


def _ring_fwd(q, k, v, config: _RingConfig):
  out, lse = _ring_forward(q, k, v, config)
  out = out.astype(q.dtype)
  return out, (q, k, v, out, lse)


def _ring_bwd(config: _RingConfig, residuals, d_out):
  return _ring_backward_pass(*residuals, d_out, config)


_ring.defvjp(_ring_fwd, _ring_bwd)
