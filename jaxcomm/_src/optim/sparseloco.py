"""SparseLoCo: DiLoCo outer steps on sparse, 2-bit pseudo-gradients with decayed error feedback."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.compress import chunks
from jaxcomm._src.compress.packing import pack_bits, packed_nbytes, unpack_bits
from jaxcomm._src.compress.topk import MAX_UINT16_CHUNK, scatter_sum
from jaxcomm._src.mesh_axes import manual_axes, require_axes, vary
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.periodic import periodic_averaging
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS
from jaxcomm._src.validation import (check_float, check_float_tree, check_fraction, check_int_range,
                                     check_unit_interval)

FULL_PRECISION = 32
POSITION_CODES = ("fixed", "elias-fano")


class SparseLoCoSyncState(NamedTuple):
  """State of the SparseLoCo synchronization (one per fragment of :class:`PeriodicState`).

  Attributes:
    error: per leaf, float32 ``(ceil(d / G),)``: this device's shard of its host's
      error-feedback buffer ``e`` (the host's ``G`` devices hold different shards);
      device-local.
  """
  error: Any


class SparsePayload(NamedTuple):
  """What one device sends over the slow axis for one leaf shard of ``c`` chunks, ``n``
  blocks per chunk and ``m`` kept values per block (:class:`Layout`).

  Attributes:
    codes: uint8 ``(ceil(c n m bits / 8),)``: the kept values' grid codes, packed (float32
      ``(c, n m)`` values themselves when ``bits = 32``).
    scales: float32 ``(c,)``: the largest kept magnitude of each chunk (``(0,)`` at 32 bits).
    indices: uint8: positions of the kept values inside their ``v``-element block; with
      ``positions="fixed"`` ``(ceil(c n m b / 8),)``, ``b = index_bits(v)`` bits each,
      packed (the low bytes, then the high ``b - 8`` bits packed, when ``b > 8``); with
      ``"elias-fano"`` each block's sorted positions Elias-Fano coded
      (:func:`pack_sorted_positions`).
  """
  codes: jax.Array
  scales: jax.Array
  indices: jax.Array


class Layout(NamedTuple):
  """How a shard is cut: ``count`` chunks of ``width`` elements (one scale each), each cut
  into ``width / block`` blocks of ``block`` elements, of which the top ``kept`` are sent.

  Attributes:
    count: chunks, ``c``.
    width: elements per chunk, ``w``, a multiple of ``block``.
    block: elements per block, ``v`` (positions are relative to it).
    kept: values sent per block, ``m``.
  """
  count: int
  width: int
  block: int
  kept: int

  @property
  def blocks(self) -> int:
    """Blocks per chunk, ``n = w / v``."""
    return self.width // self.block

  @property
  def sent(self) -> int:
    """Values sent per shard, ``c n m``."""
    return self.count * self.blocks * self.kept


def chunk_layout(size: int, chunk: int, density: float, block: int | None = None) -> Layout:
  """The :class:`Layout` of a shard of ``size`` elements: ``w = min(chunk, size)``,
  ``v = w`` when ``block`` is None (one block per chunk), else ``v = min(block, w)`` with
  ``w`` rounded up to a multiple of ``v``; ``m = max(1, floor(density v))``."""
  width = min(chunk, max(size, 1))
  block = width if block is None else min(block, width)
  width = -(-width // block) * block
  return Layout(chunks.chunk_count(size, width), width, block,
                max(1, math.floor(density * block)))


def index_bits(width: int) -> int:
  """Bits of a position inside a ``width``-element chunk: ``ceil(log2(width))``, at least 1
  (12 for the default 4096)."""
  return max(1, (width - 1).bit_length())


def positions_nbytes(layout: Layout, positions: str) -> int:
  """Bytes of the positions of a payload: ``"fixed"``, ``ceil(c n m b / 8)`` with
  ``b = index_bits(v)``; ``"elias-fano"``, ``ceil(c n m L / 8) + ceil(c n U / 8)`` with
  ``L = floor(log2(v / m))`` low bits per position and ``U = ((v - 1) >> L) + m`` bits of
  unary high parts per block (about ``m (log2(v / m) + 2)`` bits per block)."""
  if positions == "fixed":
    return packed_nbytes(layout.sent, index_bits(layout.block))
  low, unary = elias_fano_bits(layout.block, layout.kept)
  return packed_nbytes(layout.sent, low) + packed_nbytes(layout.count * layout.blocks * unary, 1)


def payload_bytes(size: int, chunk: int, density: float, bits: int,
                  block: int | None = None, positions: str = "fixed") -> int:
  """Bytes of one :class:`SparsePayload` for a shard of ``size`` elements:
  ``ceil(c n m bits / 8) + 4 c`` (:class:`Layout`; at 32 bits ``4 c n m``) plus
  :func:`positions_nbytes`."""
  layout = chunk_layout(size, chunk, density, block)
  positions = positions_nbytes(layout, positions)
  if bits == FULL_PRECISION:
    return 4 * layout.sent + positions
  return packed_nbytes(layout.sent, bits) + 4 * layout.count + positions


def pack_positions(indices: jax.Array, width: int) -> jax.Array:
  """uint8 ``(ceil(n b / 8),)``: ``n`` positions below ``width`` at ``b = index_bits(width)``
  bits each (at most 16: the low bytes as they are, then the high bits packed)."""
  flat, b = indices.reshape(-1).astype(jnp.uint32), index_bits(width)
  if b <= 8:
    return pack_bits(flat, b)
  return jnp.concatenate([(flat & 0xFF).astype(jnp.uint8), pack_bits(flat >> 8, b - 8)])


def unpack_positions(packed: jax.Array, width: int, count: int) -> jax.Array:
  """Inverse of :func:`pack_positions`: int32 ``(count,)``."""
  b = index_bits(width)
  if b <= 8:
    return unpack_bits(packed, b, count).astype(jnp.int32)
  high = unpack_bits(packed[count:], b - 8, count).astype(jnp.int32)
  return packed[:count].astype(jnp.int32) | (high << 8)


def elias_fano_bits(block: int, kept: int) -> tuple[int, int]:
  """``(L, U)`` of the Elias-Fano code of ``kept`` sorted positions below ``block``: ``L =
  floor(log2(block / kept))`` low bits per position, ``U = ((block - 1) >> L) + kept`` bits
  of unary high parts."""
  low = (block // kept).bit_length() - 1
  return low, ((block - 1) >> low) + kept


def pack_sorted_positions(indices: jax.Array, block: int) -> jax.Array:
  """uint8: ``(g, m)`` positions below ``block``, ascending in each row, Elias-Fano coded:
  the ``g U`` bits of the rows' unary high parts (``p_i >> L`` as a set bit at
  ``(p_i >> L) + i``), packed 8 to a byte, then the ``g m`` low parts at ``L`` bits
  (:func:`elias_fano_bits`, :func:`pack_positions`): ``ceil(g U / 8) + ceil(g m L / 8)``
  bytes, for any positions."""
  groups, kept = indices.shape
  low_bits, unary = elias_fano_bits(block, kept)
  flat = indices.astype(jnp.uint32)
  slots = (flat >> low_bits) + jnp.arange(kept, dtype=jnp.uint32)
  bitmap = jnp.zeros((groups, unary), jnp.uint8).at[
      jnp.arange(groups)[:, None], slots].set(1)
  packed = [pack_bits(bitmap.reshape(-1), 1)]
  if low_bits:
    packed.append(pack_positions(flat & (2**low_bits - 1), 2**low_bits))
  return jnp.concatenate(packed)


def unpack_sorted_positions(packed: jax.Array, block: int, groups: int, kept: int):
  """Inverse of :func:`pack_sorted_positions`: int32 ``(groups kept,)``."""
  low_bits, unary = elias_fano_bits(block, kept)
  split = packed_nbytes(groups * unary, 1)
  bitmap = unpack_bits(packed[:split], 1, groups * unary).reshape(groups, unary)
  # the i-th set bit of a row is at (p_i >> L) + i: a stable sort brings the set bits first
  slots = jnp.argsort(1 - bitmap.astype(jnp.int32), axis=1, stable=True)[:, :kept]
  positions = (slots - jnp.arange(kept, dtype=jnp.int32)) << low_bits
  if low_bits:
    positions = positions | unpack_positions(packed[split:], 2**low_bits,
                                             groups * kept).reshape(groups, kept)
  return positions.reshape(-1)


def encode(error: jax.Array, chunk: int, density: float, bits: int, block: int | None = None,
           positions: str = "fixed"):
  """``(payload, sent)``: the block-wise top-k of ``error`` quantized with one scale per
  chunk, and its decoding."""
  layout = chunk_layout(error.size, chunk, density, block)
  rows = chunks.to_chunks(error, layout.width).reshape(layout.count, layout.blocks,
                                                       layout.block)
  indices = jax.lax.top_k(jnp.abs(rows), layout.kept)[1]
  if positions == "fixed":
    packed = pack_positions(indices, layout.block)
  else:  # Elias-Fano codes each block's positions in increasing order
    indices = jnp.sort(indices, axis=2)
    packed = pack_sorted_positions(indices.reshape(-1, layout.kept), layout.block)
  values = jnp.take_along_axis(rows, indices, axis=2).reshape(layout.count, -1)
  if bits == FULL_PRECISION:
    payload = SparsePayload(values, jnp.zeros((0,), jnp.float32), packed)
  else:
    # 2**bits levels evenly spaced on [-s, s] (no zero level: kept values are the large
    # ones), rounded to nearest; the error feedback carries the rounding error.
    scales = jnp.max(jnp.abs(values), axis=1)
    step = 2.0 * scales[:, None] / (2**bits - 1)
    codes = jnp.round((values + scales[:, None]) / jnp.where(step > 0, step, 1.0))
    codes = jnp.clip(codes, 0, 2**bits - 1)
    payload = SparsePayload(pack_bits(codes.reshape(-1), bits), scales, packed)
    values = _dequantized(codes, scales, bits)
  return payload, _scattered(indices.reshape(layout.count, -1), values, layout, error.size)


def _dequantized(codes: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
  """float32 values of grid ``codes`` ``(..., c, k)`` with their chunks' ``scales`` ``(..., c)``."""
  scales = scales[..., None]
  return codes.astype(jnp.float32) * (2.0 * scales / (2**bits - 1)) - scales


def _scattered(indices: jax.Array, values: jax.Array, layout: Layout, size: int) -> jax.Array:
  """The dense ``(size,)`` sum of ``values`` at their block ``indices`` ``(..., c, n m)``."""
  starts = jnp.arange(layout.count * layout.blocks, dtype=jnp.int32) * layout.block
  where = jnp.repeat(starts, layout.kept).reshape(layout.count, -1) + indices
  return scatter_sum(where, values, layout.count * layout.width)[:size]


def decode(payload: SparsePayload, size: int, chunk: int, density: float, bits: int,
           block: int | None = None, positions: str = "fixed"):
  """The dense ``(size,)`` float32 vector of a payload; payloads with a leading axis of
  ``n`` devices are decoded and summed."""
  layout = chunk_layout(size, chunk, density, block)
  count, sent = layout.count, layout.sent

  def unpacked(packed, unpack):  # per payload, whatever the leading device axes
    rows = jax.vmap(unpack)(packed.reshape(-1, packed.shape[-1]))
    return rows.reshape(*packed.shape[:-1], count, sent // count)

  if positions == "fixed":
    unpack = lambda p: unpack_positions(p, layout.block, sent)  # noqa: E731
  else:
    unpack = lambda p: unpack_sorted_positions(  # noqa: E731
        p, layout.block, count * layout.blocks, layout.kept)
  indices = unpacked(payload.indices, unpack)
  if bits == FULL_PRECISION:
    values = payload.codes
  else:
    codes = unpacked(payload.codes, lambda c: unpack_bits(c, bits, sent))
    values = _dequantized(codes, payload.scales, bits)
  return _scattered(indices, values, layout, size)


def _on_shards(fast_axis: str, caller: str) -> bool:
  """Whether the leaves are this device's shards of the host's model (``shard_over``)."""
  return hsdp.sharded_leaves_over(fast_axis, caller) is not None


def fast_mean(fast_axis: str) -> optax.GradientTransformation:
  """The gradient averaged over ``fast_axis`` at full precision (``2 (G-1)/G D`` bytes per
  device): the host's devices then take the same inner steps, as one worker. Under
  ``data_parallel(..., shard_over=fast_axis)`` the gradient already is this device's shard of
  the host mean (:func:`jaxcomm.optim.hsdp.sharded_leaves`): nothing to do."""

  def mean(grads):
    return grads if _on_shards(fast_axis, "sparseloco") else jax.lax.pmean(grads, fast_axis)

  def init(params):
    check_float_tree(params, "params")
    return optax.EmptyState()

  return hsdp.shard_aware(optax.GradientTransformation(
      init, lambda grads, state, params=None: (mean(grads), state)))


def sparse_sync(density: float, bits: int, beta: float, chunk: int, fast_axis: str,
                slow_axis: str, block: int | None = None,
                positions: str = "fixed") -> optax.GradientTransformation:
  """The SparseLoCo average of pseudo-gradients: a ``periodic_averaging`` ``sync``.

  Per leaf of ``d`` elements: the host mean of the pseudo-gradients is reduce-scattered over
  ``fast_axis`` (each device owns ``s = ceil(d / G)`` elements of it); ``e = beta e + Delta``
  on the shard; the top ``m = max(1, floor(density v))`` of each ``v``-element block of ``e``
  (``v = block``, or the whole ``w``-element chunk, ``w = min(chunk, s)``, when ``block`` is
  None: :func:`chunk_layout`) are quantized to ``bits`` with one scale per chunk and
  all-gathered over ``slow_axis`` (positions coded as ``positions`` says); ``e`` loses what
  was sent (decoded); the decoded mean over hosts is all-gathered back over ``fast_axis``.
  """
  axes = (slow_axis, fast_axis)

  def init(deltas) -> SparseLoCoSyncState:
    require_axes(axes, "sparseloco.init")
    group, every = jax.lax.axis_size(fast_axis), manual_axes("sparseloco.init")
    group = 1 if _on_shards(fast_axis, "sparseloco.init") else group
    return SparseLoCoSyncState(error=jax.tree.map(
        lambda p: vary(jnp.zeros((-(-p.size // group),), jnp.float32), every), deltas))

  def leaf_mean(delta, error):
    group, hosts = jax.lax.axis_size(fast_axis), jax.lax.axis_size(slow_axis)
    size, on_shards = error.shape[0], _on_shards(fast_axis, "sparseloco.update")
    flat = delta.reshape(-1).astype(jnp.float32)
    if not on_shards:  # the host's devices hold the same delta: each takes its shard
      flat = jnp.pad(flat, (0, group * size - delta.size))
      flat = jax.lax.psum_scatter(flat, fast_axis, scatter_dimension=0, tiled=True) / group
    error = beta * error + flat
    payload, sent = encode(error, chunk, density, bits, block, positions)
    gathered = jax.lax.all_gather(payload, slow_axis, to="invarying")
    mean = decode(gathered, size, chunk, density, bits, block, positions) / hosts
    whole = mean if on_shards else jax.lax.all_gather(mean, fast_axis, tiled=True,
                                                      to="invarying")
    return whole[:delta.size].reshape(delta.shape).astype(delta.dtype), error - sent

  def update(deltas, state: SparseLoCoSyncState, params=None):
    del params
    leaves, treedef = jax.tree.flatten(deltas)
    results = [leaf_mean(d, e) for d, e in zip(leaves, treedef.flatten_up_to(state.error))]
    return (treedef.unflatten([mean for mean, _ in results]),
            SparseLoCoSyncState(error=treedef.unflatten([e for _, e in results])))

  return hsdp.shard_aware(optax.GradientTransformation(init, update))


def sparseloco(inner: optax.GradientTransformation, period: int, *,
               density: float = 1 / 32, bits: int = 2, beta: float = 0.95,
               alpha: float = 1.0, chunk: int = 4096, block: int | None = None,
               positions: str = "fixed", fast_axis: str = LOCAL_AXIS,
               slow_axis: str = HOST_AXIS) -> optax.GradientTransformation:
  """SparseLoCo: ``period`` inner steps per host, then a sparse, quantized outer step.

  Every step the host's devices average their gradients over ``fast_axis`` at full precision
  and apply ``inner`` (e.g. AdamW) to their device-local parameters ``theta_r``: a host is
  one worker. After every ``period`` steps, per host ``r``: the pseudo-gradient
  ``Delta_r = theta_sync - theta_r``, ``e_r = beta e_r + Delta_r``, and the host sends
  ``Q(TopK_chunk(e_r))``: the ``k = max(1, floor(density w))`` largest-magnitude entries of
  every ``w``-element chunk (``w = min(chunk, shard)``), their values on a ``2**bits``-level
  grid spanning ``[-s, s]`` with ``s`` the chunk's largest kept magnitude (round to nearest,
  codes packed), positions packed at ``b = ceil(log2 w)`` bits (12 for ``w = 4096``);
  ``e_r -= sent`` (decoded). With ``block = v`` the selection is structured: each chunk is
  cut into ``w / v`` blocks of ``v`` elements and the top ``m = max(1, floor(density v))``
  of each block are sent, their positions at ``b = ceil(log2 v)`` bits, still with one
  scale per chunk (e.g. ``block=16, density=1/16``: the largest of every 16 elements at
  2 + 4 bits, 6 bits per 16 elements, against 2 + 12 bits per 40 elements for the top 1/40
  of 4,096-element chunks). ``positions="elias-fano"`` codes each block's sorted positions
  in ``L = floor(log2(v / m))`` low bits each plus ``U = ((v - 1) >> L) + m`` unary bits per
  block (Elias 1974, Fano 1971): the same values are sent, in about ``log2(v / m) + 2``
  bits per position instead of ``ceil(log2 v)`` (7.3 instead of 12 at ``m / v = 102 /
  4096``). Then
  ``theta_sync -= alpha mean_r(sent)`` and every device restarts from ``theta_sync``. The
  decayed error buffer replaces DiLoCo's outer momentum (the outer optimizer is plain SGD).
  ``bits = 32`` sends float32 values (no quantization); with ``density = 1`` and
  ``bits = 32`` everything is sent and this is :func:`jaxcomm.diloco` with
  ``outer=optax.sgd(alpha)`` on the host-averaged inner steps.

  The work of a host is split among its ``G`` devices: each owns ``s = ceil(d / G)``
  elements of every ``d``-element leaf (its shard of the host's buffer ``e``).

  Bytes per device per outer step, ``H`` hosts, per leaf, ``c = ceil(s / w)`` chunks of
  ``k`` kept values and ``b``-bit positions (without ``block``: ``v = w``, ``n = 1``; with
  it ``k = n m``, ``n = w / v`` blocks per chunk, ``b = ceil(log2 v)``, and ``w`` rounded up
  to a multiple of ``v`` when the shard is smaller than ``chunk``):

  * ``slow_axis``: an all-gather of the payloads, ``(H - 1) (ceil(c k bits / 8) + 4 c +
    ceil(c k b / 8))`` (at 32 bits ``(H - 1) (4 c k + ceil(c k b / 8))``); with
    ``positions="elias-fano"`` the ``ceil(c k b / 8)`` is ``ceil(c k L / 8) + ceil(c n U /
    8)`` (:func:`positions_nbytes`);
  * ``fast_axis``: a reduce-scatter of the pseudo-gradient and an all-gather of the mean,
    ``2 (G - 1) 4 s``; plus on every inner step the gradient mean ``2 (G - 1)/G 4 d``.

  Per step, the outer bytes are divided by ``period``.

  Args:
    inner: the per-host optimizer, e.g. ``optax.adamw(1e-3)``.
    period: ``H >= 1`` inner steps between outer steps.
    density: kept fraction of each chunk, in ``(0, 1]`` (1-3% in the paper; 1/32 measured
      best of 1/128, 1/64, 1/32 here, docs/algorithms.md).
    bits: bits per kept value, in ``[1, 8]``, or 32 for float32 values.
    beta: error-feedback decay, in ``[0, 1)``.
    alpha: outer learning rate, ``> 0``.
    chunk: chunk width, in ``[1, 65536]`` (positions of at most 16 bits): one scale each.
    block: block width ``v`` for structured sparsity, dividing ``chunk``, or None (the
      default: one block per chunk, the paper's chunk-wise top-k).
    positions: how positions are coded, ``"fixed"`` (``ceil(log2 v)`` bits each) or
      ``"elias-fano"`` (fewer bytes below density about 1/4, the same values sent).
    fast_axis: the intra-host mesh axis (full precision).
    slow_axis: the inter-host mesh axis (sparse, quantized).

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters
    (:func:`jaxcomm.optim.to_device_local`, :func:`jaxcomm.optim.local_training_step`);
    its state is a :class:`~jaxcomm.optim.periodic.PeriodicState` whose ``sync`` holds a
    :class:`SparseLoCoSyncState`.

  References:
    Sarfi, Thérien, Lidin & Belilovsky, "Communication Efficient LLM Pre-training with
    SparseLoCo", arXiv 2508.15706, 2025.
  """
  density = check_fraction("density", density)
  bits = check_int_range("bits", bits, 1, FULL_PRECISION)
  if FULL_PRECISION > bits > 8:
    raise ValueError(f"bits must be in [1, 8] or 32, got {bits}.")
  beta = check_unit_interval("beta", beta)
  alpha = check_float("alpha", alpha)
  chunk = check_int_range("chunk", chunk, 1, MAX_UINT16_CHUNK)
  if block is not None:
    block = check_int_range("block", block, 1, chunk)
    if chunk % block:
      raise ValueError(f"block must divide chunk ({chunk}), got {block}.")
  if positions not in POSITION_CODES:
    raise ValueError(f"positions must be one of {POSITION_CODES}, got {positions!r}.")
  if fast_axis == slow_axis:
    raise ValueError(f"fast_axis and slow_axis must differ, both are {fast_axis!r}.")
  return periodic_averaging(optax.chain(fast_mean(fast_axis), inner), optax.sgd(alpha), period,
                            sync=sparse_sync(density, bits, beta, chunk, fast_axis, slow_axis,
                                             block, positions))
