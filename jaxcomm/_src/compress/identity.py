"""The identity compressor: full precision, the reference every other compressor is held to."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor, num_elements, stateless_init


def identity() -> Compressor:
  """Sends the input unchanged, as float32.

  Unbiased with zero variance; linear (payloads may be ``psum``-ed).
  Bytes: ``4 * d`` for ``d`` elements.

  Returns:
    A :class:`~jaxcomm.Compressor` whose payload is the float32 input.
  """

  def encode(x: jax.Array, state, key: jax.Array):
    del key
    return x.astype(jnp.float32), state

  def decode(payload: jax.Array, shape) -> jax.Array:
    return payload.reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    return 4 * num_elements(shape)

  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=True, unbiased=True, name="identity")
