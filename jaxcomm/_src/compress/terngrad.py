"""TernGrad: unbiased stochastic ternarization with 2-bit codes."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor, axis_context, num_elements, stateless_init
from jaxcomm._src.validation import check_bool
from jaxcomm._src.compress.hashing import hash_uniform
from jaxcomm._src.compress.packing import pack_elementwise, packed_nbytes, unpack_bits


class TernGradPayload(NamedTuple):
  """The wire format of TernGrad.

  Attributes:
    codes: uint8 of shape ``(ceil(d / 4),)``: 2-bit codes, 0 for 0, 1 for +1, 2 for -1.
    scaler: float32 of shape ``(1,)``: ``s = max |g|`` (over the axis when shared).
  """
  codes: jax.Array
  scaler: jax.Array


def terngrad(*, shared_scale: bool = False) -> Compressor:
  """TernGrad: ``C(g)_i = s * t_i``, ``t_i = sign(g_i)`` with probability ``|g_i| / s``, else 0.

  The scaler is ``s = max_i |g_i|``. With ``shared_scale`` the devices whose payloads are
  combined agree on it (:func:`~jaxcomm.compress.axis_context`: the engine runs a 4-byte
  ``pmax`` of the local maxima over the axis before the payload is sent), as the paper's scaler
  sharing does. Then every device's payload carries the same ``s``, so the sum of the decoded
  payloads is ``s * sum_devices t``: a receiver may add the integer codes and multiply once,
  and a two-phase collective can re-quantize the sum on the same grid. Outside the engine the
  scaler is the device's own. A zero scaler sends zeros.

  Properties: unbiased, ``E[C(g)] = g``, with variance
  ``E||C(g) - g||^2 = sum_i |g_i| (s - |g_i|) <= (s ||g||_1 / ||g||_2^2 - 1) ||g||^2
  <= (sqrt(d) - 1) ||g||^2`` for the local scaler (a shared, larger scaler raises it);
  not linear (the packed codes cannot be summed on the wire).

  Bytes: ``ceil(d / 4) + 4`` (2 bits per element: 16x smaller than float32).

  Args:
    shared_scale: agree on one scaler over the devices combined (``False``: private).

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`TernGradPayload` payloads.

  References:
    Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
    Learning", NeurIPS 2017.
  """
  shared_scale = check_bool("shared_scale", shared_scale)

  def encode(x: jax.Array, state, key: jax.Array):
    flat = x.reshape(-1).astype(jnp.float32)
    scaler = jnp.max(jnp.abs(flat), initial=0.0)
    if shared_scale:
      scaler = axis_context().agree_max(scaler)

    def codes_at(index, flat):
      keep = hash_uniform(key, flat.shape, index=index) * scaler < jnp.abs(flat)
      return jnp.where(keep, jnp.where(flat < 0, 2, 1), 0)

    return TernGradPayload(pack_elementwise(codes_at, (flat,), 2), scaler.reshape(1)), state

  def decode(payload: TernGradPayload, shape) -> jax.Array:
    codes = unpack_bits(payload.codes, 2, num_elements(shape))
    ternary = jnp.where(codes == 1, 1.0, jnp.where(codes == 2, -1.0, 0.0))
    return (payload.scaler * ternary).reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    return packed_nbytes(num_elements(shape), 2) + 4

  shared = "shared_scale=True" if shared_scale else ""
  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=True, name=f"terngrad({shared})")
