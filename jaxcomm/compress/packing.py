"""Exact bit packing of small unsigned codes into bytes.

``n`` codes of ``bits`` bits each occupy ``ceil(n * bits / 8)`` bytes: signs go 8 to a byte,
2-bit codes 4 to a byte, and widths that do not divide 8 (3, 5, 6, 7) run across byte
boundaries. Within a byte, earlier codes take the lower bits (little-endian bit order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm.compress.base import check_int_range


def packed_nbytes(count: int, bits: int) -> int:
  """Bytes that ``count`` codes of ``bits`` bits occupy once packed: ``ceil(count*bits/8)``."""
  return -(-count * bits // 8)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs a 1-D array of codes in ``[0, 2**bits)`` into a uint8 array.

  Args:
    codes: shape ``(n,)``, any unsigned or signed integer dtype holding values < ``2**bits``.
    bits: code width, 1 to 8.

  Returns:
    uint8 array of shape ``(ceil(n * bits / 8),)``.
  """
  bits = check_int_range("bits", bits, 1, 8)
  codes = codes.astype(jnp.uint8)
  count = codes.shape[0]
  if bits == 8:
    return codes
  if 8 % bits == 0:
    per_byte = 8 // bits
    padded = jnp.pad(codes, (0, (-count) % per_byte)).reshape(-1, per_byte)
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return jnp.bitwise_or.reduce(padded << shifts, axis=1).astype(jnp.uint8)
  bit_positions = jnp.arange(bits, dtype=jnp.uint8)
  stream = ((codes[:, None] >> bit_positions) & 1).reshape(-1)
  stream = jnp.pad(stream, (0, (-stream.shape[0]) % 8)).reshape(-1, 8)
  return jnp.bitwise_or.reduce(stream << jnp.arange(8, dtype=jnp.uint8), axis=1).astype(jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``count`` codes, as uint8 of shape ``(count,)``."""
  bits = check_int_range("bits", bits, 1, 8)
  if bits == 8:
    return packed[:count]
  mask = jnp.uint8((1 << bits) - 1)
  if 8 % bits == 0:
    per_byte = 8 // bits
    shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    return ((packed[:, None] >> shifts) & mask).reshape(-1)[:count]
  stream = ((packed[:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1).reshape(-1)
  stream = stream[:count * bits].reshape(count, bits)
  weights = (jnp.uint8(1) << jnp.arange(bits, dtype=jnp.uint8)).astype(jnp.uint8)
  return jnp.sum(stream * weights, axis=1, dtype=jnp.uint8)
