"""Exact bit packing of small unsigned codes into bytes.

``n`` codes of ``bits`` bits each occupy ``ceil(n * bits / 8)`` bytes: signs go 8 to a byte,
2-bit codes 4 to a byte, and widths that do not divide 8 (3, 5, 6, 7) run across byte
boundaries. Within a byte, earlier codes take the lower bits (little-endian bit order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.validation import check_int_range


def packed_nbytes(count: int, bits: int) -> int:
  """Bytes that ``count`` codes of ``bits`` bits occupy once packed: ``ceil(count*bits/8)``."""
  return -(-count * bits // 8)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs a 1-D array of codes in ``[0, 2**bits)`` into a uint8 array.

  Widths that divide 8 put ``8 / bits`` codes in each byte. For the others, eight codes fill
  exactly ``bits`` bytes, so the codes are taken in groups of 8 (the last group zero-padded)
  and each of the group's bytes is an OR of the few codes that overlap it, shifted by static
  amounts: elementwise work that XLA fuses into one loop (ten times faster than expanding
  every code into single bits). See :func:`pack_elementwise` for codes still to be computed.

  Args:
    codes: shape ``(n,)``, any unsigned or signed integer dtype holding values < ``2**bits``.
    bits: code width, 1 to 8.

  Returns:
    uint8 array of shape ``(ceil(n * bits / 8),)``.
  """
  return pack_elementwise(lambda index, codes: codes, (codes,), bits)


def pack_elementwise(codes_at: Callable[..., jax.Array], operands: Sequence[jax.Array],
                     bits: int) -> jax.Array:
  """``pack_bits(codes_at(index, *operands), bits)``, computing the codes byte lane by lane.

  The codes of an encoder are an elementwise expression of its input (a division, a hash);
  fused into a packing loop that reads each byte's codes from neighbouring elements, that
  expression is not vectorized by XLA's CPU backend, and computed once for strided slices to
  read, it is materialized (a 64 MiB temporary at 16M float32 elements). Here ``codes_at`` is
  applied to strided slices of the operands instead, one slice per position of a code in its
  byte (per position in a group of 8 for widths that do not divide 8), and the slices' codes
  are shifted into place: one vectorized loop over the bytes. At 16M elements, encode +
  decode in CPU time: 4-bit stochastic quantization 101 -> 24 ms, TernGrad 48 -> 19 ms.

  Args:
    codes_at: elementwise function of ``index`` (uint32: the elements' numbers, for hashing)
      and the operands' values at those elements, returning codes in ``[0, 2**bits)``.
    operands: 1-D arrays of one shape ``(n,)``.
    bits: code width, 1 to 8.

  Returns:
    uint8 array of shape ``(ceil(n * bits / 8),)``, the bytes :func:`pack_bits` makes of the
    codes.
  """
  bits = check_int_range("bits", bits, 1, 8)
  count = operands[0].shape[0]
  lanes = 1 if bits == 8 else 8 // bits if 8 % bits == 0 else 8
  padded = -(-count // lanes) * lanes
  index = jax.lax.iota(jnp.uint32, padded)
  operands = [jnp.pad(operand, (0, padded - count)) for operand in operands]
  code_type = jnp.uint8 if 8 % bits == 0 else jnp.uint16

  def lane_codes(lane: int) -> jax.Array:
    lane_index = index[lane::lanes]
    codes = codes_at(lane_index, *(operand[lane::lanes] for operand in operands))
    codes = codes.astype(code_type)
    # Padding elements pack as zero codes whatever codes_at makes of them.
    return codes if padded == count else jnp.where(lane_index < count, codes, 0)

  if 8 % bits == 0:
    packed = lane_codes(0)
    for lane in range(1, lanes):
      packed = packed | (lane_codes(lane) << (bits * lane))
    return packed
  codes = [lane_codes(lane) for lane in range(8)]
  columns = []
  for byte in range(bits):
    column = jnp.zeros(padded // 8, jnp.uint16)
    for position in _overlapping_codes(byte, bits):
      shift = bits * position - 8 * byte
      code = codes[position]
      column = column | (code << shift if shift >= 0 else code >> -shift)
    columns.append(column & 0xFF)
  packed = jnp.stack(columns, axis=1).astype(jnp.uint8).reshape(-1)
  return packed[:packed_nbytes(count, bits)]


def _overlapping_codes(byte: int, bits: int) -> range:
  """Indices (0 to 7) of the codes of a group whose bits fall in byte ``byte`` of the group."""
  return range(8 * byte // bits, min(8, -(-8 * (byte + 1) // bits)))


# Fewest codes that :func:`unpack_bits` reads through words: below, the words' two extra
# loops cost more than they save (6-bit QSGD decode, 32,768 codes: 97 -> 110 us of CPU; the
# char LM's mesh_scan step, shards of 64-32,768 elements: +7% -> +13% over identity).
WORDS_MIN_COUNT = 1 << 17


def unpack_bits(packed: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``count`` codes, as uint8 of shape ``(count,)``.

  For widths that do not divide 8, each group of ``bits`` bytes (8 codes) is read as two
  little-endian uint32 words, of its bytes 0-3 and 3-6, written to memory once; each code is
  then one shift of the word that holds it, by amounts computed from the code's position
  (an ``iota``). XLA's CPU backend vectorizes that; stacking the 8 codes of a group, each cut
  from its bytes, it emitted scalar code (16M codes of 5 bits: 10.7 -> 3.2 ms of CPU). Fewer
  than ``WORDS_MIN_COUNT`` codes, or a ``count`` that is not a multiple of 8, keep the
  stacking (:func:`_unpack_by_stacking`).
  """
  bits = check_int_range("bits", bits, 1, 8)
  if bits == 8:
    return packed[:count]
  if 8 % bits == 0:
    per_byte = 8 // bits
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return ((packed[:, None] >> shifts) & jnp.uint8((1 << bits) - 1)).reshape(-1)[:count]
  if count % 8 or count < WORDS_MIN_COUNT:
    return _unpack_by_stacking(packed, bits, count)
  groups = jnp.pad(packed, (0, (-packed.shape[0]) % bits)).reshape(-1, bits).astype(jnp.uint32)
  low = materialized(_group_word(groups, 0))
  # With 3 bits a group is 3 bytes, all in the low word.
  high = materialized(_group_word(groups, 3)) if bits > 4 else low
  starts = jax.lax.iota(jnp.uint32, 8) * jnp.uint32(bits)  # each code's first bit in its group
  in_low = starts + bits <= 32
  words = jnp.where(in_low, low[:, None], high[:, None])
  codes = words >> jnp.where(in_low, starts, starts - 24)
  return (codes & jnp.uint32((1 << bits) - 1)).astype(jnp.uint8).reshape(-1)[:count]


def _unpack_by_stacking(packed: jax.Array, bits: int, count: int) -> jax.Array:
  """:func:`unpack_bits` of widths 3, 5, 6, 7 for short inputs and counts that are not a
  multiple of 8: the 8 codes of each group cut from its bytes and stacked. Unvectorized, but
  the words' path slows further for such a count: the final slice of its ``(groups, 8)``
  codes becomes an index computation per code (16M + 3 codes of 5 bits: 31 against 21 ms)."""
  groups = jnp.pad(packed.astype(jnp.uint16), (0, (-packed.shape[0]) % bits)).reshape(-1, bits)
  codes = []
  for index in range(8):
    byte, offset = divmod(bits * index, 8)
    word = groups[:, byte]
    if offset + bits > 8:
      word = word | (groups[:, byte + 1] << 8)
    codes.append((word >> offset) & ((1 << bits) - 1))
  return jnp.stack(codes, axis=1).astype(jnp.uint8).reshape(-1)[:count]


def _group_word(groups: jax.Array, first: int) -> jax.Array:
  """uint32 of shape ``(groups,)``: bytes ``first`` to ``first + 3`` (those there are) of each
  row of ``groups`` (uint32 of shape ``(groups, bits)``), the first byte lowest."""
  word = groups[:, first]
  for byte in range(first + 1, min(first + 4, groups.shape[1])):
    word = word | (groups[:, byte] << (8 * (byte - first)))
  return word


def materialized(values: jax.Array) -> jax.Array:
  """``values`` (1-D), computed into memory once for their consumers. XLA's CPU backend fuses
  an elementwise producer into each consumer, recomputing it for every element that reads
  it (a code for every byte it overlaps, a group's word for each of its 8 codes), and the
  fused loop is not vectorized; it does not fuse a reduction into its consumer, so the values
  are reduced over a pair with a neutral second row, bit for bit: integers OR-ed with zeros;
  floats paired with ``-inf`` by a reducer that keeps the other operand (NaNs and signed
  zeros kept; as ``max``, XLA handed the reduction and its consumers to one YNNPACK fusion,
  QSGD's decode at 16M 20 -> 128 ms of CPU)."""
  if not jnp.issubdtype(values.dtype, jnp.floating):
    pair = jnp.stack([values, jnp.zeros_like(values)], axis=1)
    return jax.lax.reduce(pair, jnp.zeros((), values.dtype), jax.lax.bitwise_or, (1,))
  neutral = np.asarray(-np.inf, values.dtype)
  pair = jnp.stack([values, jnp.full_like(values, neutral)], axis=1)
  return jax.lax.reduce(pair, neutral, lambda a, b: jax.lax.select(a == neutral, b, a), (1,))
