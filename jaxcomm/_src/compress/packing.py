"""Exact bit packing of small unsigned codes into bytes.

``n`` codes of ``bits`` bits each occupy ``ceil(n * bits / 8)`` bytes: signs go 8 to a byte,
2-bit codes 4 to a byte, and widths that do not divide 8 (3, 5, 6, 7) run across byte
boundaries. Within a byte, earlier codes take the lower bits (little-endian bit order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm._src.validation import check_int_range


def packed_nbytes(count: int, bits: int) -> int:
  """Bytes that ``count`` codes of ``bits`` bits occupy once packed: ``ceil(count*bits/8)``."""
  return -(-count * bits // 8)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs a 1-D array of codes in ``[0, 2**bits)`` into a uint8 array.

  Widths that divide 8 put ``8 / bits`` codes in each byte (an OR over a short axis). For the
  others, eight codes fill exactly ``bits`` bytes, so the codes are taken in groups of 8 (the
  last group zero-padded) and each of the group's bytes is an OR of the few codes that overlap
  it, shifted by static amounts: elementwise work that XLA fuses into one loop (ten times
  faster than expanding every code into single bits).

  Args:
    codes: shape ``(n,)``, any unsigned or signed integer dtype holding values < ``2**bits``.
    bits: code width, 1 to 8.

  Returns:
    uint8 array of shape ``(ceil(n * bits / 8),)``.
  """
  bits = check_int_range("bits", bits, 1, 8)
  count = codes.shape[0]
  if bits == 8:
    return codes.astype(jnp.uint8)
  if 8 % bits == 0:
    per_byte = 8 // bits
    padded = jnp.pad(codes.astype(jnp.uint8), (0, (-count) % per_byte)).reshape(-1, per_byte)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.bitwise_or.reduce(padded << shifts, axis=1).astype(jnp.uint8)
  groups = jnp.pad(codes.astype(jnp.uint16), (0, (-count) % 8)).reshape(-1, 8)
  columns = []
  for byte in range(bits):
    column = jnp.zeros(groups.shape[:1], jnp.uint16)
    for index in _overlapping_codes(byte, bits):
      shift = bits * index - 8 * byte
      code = groups[:, index]
      column = column | (code << shift if shift >= 0 else code >> -shift)
    columns.append(column & 0xFF)
  packed = jnp.stack(columns, axis=1).astype(jnp.uint8).reshape(-1)
  return packed[:packed_nbytes(count, bits)]


def _overlapping_codes(byte: int, bits: int) -> range:
  """Indices (0 to 7) of the codes of a group whose bits fall in byte ``byte`` of the group."""
  return range(8 * byte // bits, min(8, -(-8 * (byte + 1) // bits)))


def unpack_bits(packed: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``count`` codes, as uint8 of shape ``(count,)``."""
  bits = check_int_range("bits", bits, 1, 8)
  if bits == 8:
    return packed[:count]
  if 8 % bits == 0:
    per_byte = 8 // bits
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return ((packed[:, None] >> shifts) & jnp.uint8((1 << bits) - 1)).reshape(-1)[:count]
  groups = jnp.pad(packed.astype(jnp.uint16), (0, (-packed.shape[0]) % bits)).reshape(-1, bits)
  codes = []
  for index in range(8):
    byte, offset = divmod(bits * index, 8)
    word = groups[:, byte]
    if offset + bits > 8:
      word = word | (groups[:, byte + 1] << 8)
    codes.append((word >> offset) & ((1 << bits) - 1))
  return jnp.stack(codes, axis=1).astype(jnp.uint8).reshape(-1)[:count]
