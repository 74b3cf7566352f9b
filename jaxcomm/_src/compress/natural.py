"""Natural compression: unbiased stochastic rounding to a power of two."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor, num_elements, stateless_init
from jaxcomm._src.compress.hashing import bernoulli
from jaxcomm._src.compress.packing import pack_bits, packed_nbytes, unpack_bits

_MANTISSA_BITS = 23
_MAX_FINITE_EXPONENT = 254  # float32 biased exponent 255 means Inf/NaN.


class NaturalPayload(NamedTuple):
  """The wire format of natural compression: 9 bits per element.

  Attributes:
    signs: uint8 of shape ``(ceil(d / 8),)``; bit ``i`` is 1 where ``x_i`` is negative.
    exponents: uint8 of shape ``(d,)``: the float32 biased exponent of the rounded value
      (0 for zero, 1 for 2^-126, 255 for Inf/NaN inputs).
  """
  signs: jax.Array
  exponents: jax.Array


def natural() -> Compressor:
  """Natural compression: each ``|x_i|`` rounded stochastically to a neighbouring power of two.

  For ``2^a <= |x_i| < 2^(a+1)`` it sends ``2^(a+1)`` with probability ``|x_i| / 2^a - 1`` and
  ``2^a`` otherwise, keeping the sign. In float32 terms: the mantissa is dropped and the
  exponent rounded up with probability ``mantissa / 2^23``. Subnormals round between 0 and
  2^-126 the same way; values above 2^127 are not rounded up (that would overflow to Inf).
  NaN and Inf inputs decode to Inf.

  Properties: unbiased (below 2^127), ``E[C(x)] = x``, with variance
  ``E||C(x) - x||^2 <= (1/8) ||x||^2``; not linear.

  Bytes: ``d + ceil(d / 8)`` (an 8-bit exponent and a packed sign bit per element, 3.56x
  smaller than float32).

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`NaturalPayload` payloads.

  References:
    Horvath, Ho, Horvath, Sahu, Canini & Richtarik, "Natural Compression for Distributed
    Deep Learning", MSML 2022 (arXiv 1905.10988, 2019).
  """

  def encode(x: jax.Array, state, key: jax.Array):
    flat = x.reshape(-1).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.abs(flat), jnp.uint32)
    exponent = (bits >> _MANTISSA_BITS).astype(jnp.int32)
    mantissa = (bits & ((1 << _MANTISSA_BITS) - 1)).astype(jnp.float32) / 2.0**_MANTISSA_BITS
    round_up = bernoulli(key, mantissa)
    finite = exponent <= _MAX_FINITE_EXPONENT
    rounded = jnp.where(finite, jnp.minimum(exponent + round_up, _MAX_FINITE_EXPONENT), 255)
    return NaturalPayload(pack_bits(flat < 0, 1), rounded.astype(jnp.uint8)), state

  def decode(payload: NaturalPayload, shape) -> jax.Array:
    size = num_elements(shape)
    magnitude = jax.lax.bitcast_convert_type(
        payload.exponents.astype(jnp.uint32) << _MANTISSA_BITS, jnp.float32)
    negative = unpack_bits(payload.signs, 1, size).astype(bool)
    return jnp.where(negative, -magnitude, magnitude).reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    size = num_elements(shape)
    return size + packed_nbytes(size, 1)

  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=True, name="natural")
