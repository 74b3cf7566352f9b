"""Sequence layouts: which global tokens each device of a sequence-parallel axis holds.

With a causal mask, token ``t`` attends to tokens ``<= t``. Cutting the sequence into ``P``
contiguous shards gives the device holding the last shard ``P`` times the attention work of the
device holding the first. Two layouts balance it:

* ``'zigzag'``: the sequence is cut into ``2P`` chunks and device ``r`` holds chunks ``r`` and
  ``2P-1-r`` (an early and a late one).
* ``'striped'``: token ``t`` lives on device ``t mod P`` (Brandon et al. 2023).

A layout is applied once to the batch (``to_layout``) before it is sharded along the sequence;
outputs come back in the natural order with ``from_layout``. Attention itself only needs the
static per-(query shard, key shard) ``block_schedule``: which mask each block needs, and which
blocks are fully masked and skipped. ``shard_positions`` gives the global position of every
local token (for position embeddings).

References:
  Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal Transformers",
  https://arxiv.org/abs/2311.09431
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")


class BlockKind(enum.IntEnum):
  """What a (query shard, key shard) pair of a ring computes under a layout.

  ``LEADING_KEYS`` and ``TRAILING_QUERIES`` are the zigzag half blocks: the other half of the
  pair is fully masked and is not computed at all.
  """
  SKIP = 0              # every query precedes every key: fully masked, nothing to compute
  FULL = 1              # every query follows every key: no mask
  CAUSAL = 2            # query i sees local keys j <= i (a diagonal block)
  STRICT = 3            # query i sees local keys j < i (striped, keys from a later device)
  LEADING_KEYS = 4      # all queries against the first half of the keys, no mask
  TRAILING_QUERIES = 5  # the second half of the queries against all keys, no mask


def check_layout(layout: str) -> None:
  """Raises ``ValueError`` unless ``layout`` is one of ``LAYOUTS``."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}.")


def chunks_per_shard(layout: str) -> int:
  """How many equal chunks a device's shard splits into (its sequence must divide by this)."""
  check_layout(layout)
  return 2 if layout == "zigzag" else 1


def _check_divisible(seq_len: int, layout: str, num_shards: int) -> None:
  chunks = chunks_per_shard(layout) * num_shards
  if seq_len % chunks:
    raise ValueError(
        f"sequence length {seq_len} is not divisible by {chunks}, the chunk count of "
        f"layout={layout!r} over num_shards={num_shards}.")


def layout_permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
  """Global token positions in layout order: ``x_layout = x[:, perm]``.

  Device ``r`` holds ``perm[r * seq_len // num_shards:(r + 1) * seq_len // num_shards]``.

  Args:
    layout: one of ``LAYOUTS``.
    seq_len: total sequence length ``S``.
    num_shards: number of devices ``P`` on the sequence axis.

  Returns:
    An int array of shape ``(S,)``, a permutation of ``range(S)``.
  """
  check_layout(layout)
  _check_divisible(seq_len, layout, num_shards)
  positions = np.arange(seq_len)
  if layout == "contiguous":
    return positions
  if layout == "striped":
    return positions.reshape(-1, num_shards).T.reshape(-1)
  chunks = positions.reshape(2 * num_shards, -1)
  order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
  return chunks[order].reshape(-1)


def to_layout(x: jax.Array, layout: str, num_shards: int, *, axis: int = 1) -> jax.Array:
  """Reorders the sequence axis of a global array from natural order into ``layout``.

  Args:
    x: array whose ``axis`` is the full sequence, e.g. ``(B, S, H, D)`` or tokens ``(B, S)``.
    layout: one of ``LAYOUTS``.
    num_shards: number of devices ``P`` the sequence will be sharded over.
    axis: the sequence axis.

  Returns:
    ``x`` with its sequence permuted; shard it contiguously (``P(None, 'seq')``) afterwards.
  """
  perm = layout_permutation(layout, x.shape[axis], num_shards)
  return jnp.take(x, perm, axis=axis)


def from_layout(x: jax.Array, layout: str, num_shards: int, *, axis: int = 1) -> jax.Array:
  """Inverse of ``to_layout``: back to the natural token order."""
  perm = layout_permutation(layout, x.shape[axis], num_shards)
  return jnp.take(x, np.argsort(perm), axis=axis)


def shard_positions(layout: str, local_len: int, num_shards: int,
                    shard_index: jax.Array | int) -> jax.Array:
  """Global positions of the ``local_len`` tokens held by device ``shard_index``.

  ``shard_index`` may be traced (``jax.lax.axis_index``), so this works inside ``shard_map``.

  Returns:
    An int32 array of shape ``(local_len,)``, increasing.
  """
  check_layout(layout)
  local = jnp.arange(local_len, dtype=jnp.int32)
  if layout == "contiguous":
    return shard_index * local_len + local
  if layout == "striped":
    return local * num_shards + shard_index
  chunk = local_len // 2
  late = 2 * num_shards - 1 - shard_index
  return jnp.where(local < chunk, shard_index * chunk + local, late * chunk + local - chunk)


def _causal_kind(layout: str, num_shards: int, query_shard: int, key_shard: int) -> BlockKind:
  if layout == "striped":
    # Query i*P + r sees key j*P + s iff j < i, or j == i and s <= r.
    return BlockKind.CAUSAL if key_shard <= query_shard else BlockKind.STRICT
  if query_shard == key_shard:
    # Positions increase with the local index in every layout, so the diagonal block's
    # global causal mask is the local one.
    return BlockKind.CAUSAL
  if layout == "contiguous":
    return BlockKind.FULL if key_shard < query_shard else BlockKind.SKIP
  # Zigzag, r != s: chunk 2P-1-s lies after both query chunks when s < r, and chunk s lies
  # after the early query chunk r but before the late one when s > r.
  return BlockKind.LEADING_KEYS if key_shard < query_shard else BlockKind.TRAILING_QUERIES


def block_schedule(layout: str, num_shards: int, causal: bool) -> np.ndarray:
  """The static work plan of a ring: ``BlockKind`` of every (query shard, key shard) pair.

  Ring attention indexes this table with ``(axis_index, origin of the K/V block it holds)``
  and ``lax.switch``-es on the entry, so the table is exactly what is computed.

  Returns:
    An int32 array of shape ``(P, P)``; entry ``[r, s]`` is the ``BlockKind`` of queries on
    device ``r`` against keys from device ``s``.
  """
  check_layout(layout)
  table = np.full((num_shards, num_shards), BlockKind.FULL, dtype=np.int32)
  if causal:
    for r in range(num_shards):
      for s in range(num_shards):
        table[r, s] = _causal_kind(layout, num_shards, r, s)
  return table


_TILES = {BlockKind.SKIP: 0, BlockKind.FULL: 4, BlockKind.CAUSAL: 4, BlockKind.STRICT: 4,
          BlockKind.LEADING_KEYS: 2, BlockKind.TRAILING_QUERIES: 2}


def tile_counts(layout: str, num_shards: int, causal: bool) -> np.ndarray:
  """(query-tile, key-tile) pairs each device computes, a tile being ``S / (2P)`` tokens.

  A whole shard-by-shard block is 2x2 = 4 tiles (masked blocks are computed whole), a zigzag
  half block is 2, a skipped block 0. Counts come from ``block_schedule``, the plan the ring
  executes. Under a causal mask: contiguous gives device ``r`` ``4(r+1)`` tiles (imbalance
  ``P``); zigzag gives every device ``2P+2``; striped every device ``4P``.

  Returns:
    An int array of shape ``(P,)``.
  """
  table = block_schedule(layout, num_shards, causal)
  return np.vectorize(lambda kind: _TILES[BlockKind(kind)])(table).sum(axis=1)
