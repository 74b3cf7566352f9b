"""TernGrad: stochastic ternarization with 2-bit codes of the entries clipped at c standard
deviations, one scaler per tensor or per bucket."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import chunks
from jaxcomm._src.compress.base import Compressor, axis_context, num_elements, stateless_init
from jaxcomm._src.validation import check_bool, check_float, check_int_range
from jaxcomm._src.compress.hashing import hash_uniform
from jaxcomm._src.compress.packing import pack_elementwise, packed_nbytes, unpack_bits


class TernGradPayload(NamedTuple):
  """The wire format of TernGrad.

  Attributes:
    codes: uint8 of shape ``(ceil(d / 4),)``: 2-bit codes, 0 for 0, 1 for +1, 2 for -1.
    scaler: float32 of shape ``(buckets,)``: ``s = max |h|`` of each bucket, ``h`` the
      clipped entries (over the axis when shared); ``buckets = 1`` without buckets.
  """
  codes: jax.Array
  scaler: jax.Array


def terngrad(*, bucket: int | None = None, clip: float | None = 2.5,
             shared_scale: bool = False) -> Compressor:
  """TernGrad: ``C(g)_i = s * t_i``, ``t_i = sign(h_i)`` with probability ``|h_i| / s``, else 0.

  ``h = g`` clipped to ``[-c sigma, c sigma]``, ``c = clip`` and ``sigma = sqrt(mean_i g_i^2)``
  the standard deviation of the tensor's entries about zero, as in all of the paper's
  experiments (``c = 2.5``, the default; ``clip=None``: ``h = g``). The scaler is
  ``s = max |h_i|`` over the tensor or, with ``bucket``, over each bucket of that many
  consecutive elements (the last one partial), as QSGD's buckets. Clipping, not buckets, is
  what bounds the variance whatever the gradient's tails: with ``s <= c sigma`` it is at most
  ``c ||g||^2``, against ``(sqrt(n) - 1) ||g||^2`` unclipped. Unclipped, with one scaler per
  tensor or per bucket of 64 to 512, :func:`~jaxcomm.compressed_allreduce` with its defaults
  diverged or lost 2.8 to 42 points on the digits task; clipped, within 0.3 of fp32
  (docs/quality.md, section 13).

  With ``shared_scale`` the devices whose payloads are combined agree on the scalers
  (:func:`~jaxcomm.compress.axis_context`: the engine runs a ``pmax`` of the local maxima,
  ``4 * buckets`` bytes, over the axis before the payload is sent), as the paper's scaler
  sharing does. Then every device's payload carries the same scalers, so the sum of the
  decoded payloads is ``s * sum_devices t`` bucket by bucket: a receiver may add the integer
  codes and multiply once, and a two-phase collective can re-quantize the sum on the same
  grid. Outside the engine the scalers are the device's own. A zero scaler sends zeros.

  Properties: ``E[C(g)] = h`` with variance ``E||C(g) - h||^2 = sum_i |h_i| (s_b(i) - |h_i|)``,
  ``s_b(i)`` the scaler of ``i``'s bucket: at most ``c ||g||^2`` clipped, at most
  ``(sqrt(n) - 1) ||g||^2`` unclipped for ``n = d`` or ``n = bucket`` (local scalers; a shared,
  larger scaler raises it). Unbiased only with ``clip=None``; clipped it is biased (``h != g``
  where ``|g_i| > c sigma``), so :func:`~jaxcomm.compressed_allreduce` gives it error feedback
  by default. Not linear (the packed codes cannot be summed on the wire).

  Bytes: ``ceil(d / 4) + 4 * buckets`` with ``buckets = 1`` (the default) or
  ``ceil(d / bucket)``: 2 bits per element, 16x smaller than float32 per tensor, 15.8x in
  buckets of 512.

  Args:
    bucket: elements per scaler, >= 1; ``None`` for one scaler per tensor.
    clip: ``c > 0``, clip at ``c`` standard deviations before ternarizing; ``None``: no
      clipping (unbiased).
    shared_scale: agree on the scalers over the devices combined (``False``: private).

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`TernGradPayload` payloads.

  References:
    Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
    Learning", NeurIPS 2017.
  """
  if bucket is not None:
    bucket = check_int_range("bucket", bucket, 1)
  if clip is not None:
    clip = check_float("clip", clip)
  shared_scale = check_bool("shared_scale", shared_scale)

  def encode(x: jax.Array, state, key: jax.Array):
    flat = x.reshape(-1).astype(jnp.float32)
    # sigma about zero (root mean square), not about the mean: the same for gradients, whose
    # mean is near zero, but a constant or one-element tensor is not clipped to zero.
    bound = None if clip is None else clip * jnp.sqrt(jnp.mean(jnp.square(flat)))
    scaler = chunks.max_abs(flat, bucket)
    if bound is not None:
      # The clipped tensor is never written out: max |h| = min(max |g|, bound), and |h_i| is
      # taken inside the codes. Clipping first cost 5.3 ms of CPU against 2.9 unclipped
      # (encode, 4M elements, a busy CPU); this way 1.6 against 1.4 (a quieter one).
      scaler = jnp.minimum(scaler, bound)
    if shared_scale:
      # One pmax of the vector: every bucket's scaler agreed at once.
      scaler = axis_context().agree_max(scaler)

    def codes_at(index, flat, scale):
      magnitude = jnp.abs(flat) if bound is None else jnp.minimum(jnp.abs(flat), bound)
      keep = hash_uniform(key, flat.shape, index=index) * scale < magnitude
      return jnp.where(keep, jnp.where(flat < 0, 2, 1), 0)

    scale = chunks.per_element(scaler, flat.shape[0], bucket)
    return TernGradPayload(pack_elementwise(codes_at, (flat, scale), 2), scaler), state

  def decode(payload: TernGradPayload, shape) -> jax.Array:
    size = num_elements(shape)
    codes = unpack_bits(payload.codes, 2, size)
    ternary = jnp.where(codes == 1, 1.0, jnp.where(codes == 2, -1.0, 0.0))
    return (chunks.per_element(payload.scaler, size, bucket) * ternary).reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    size = num_elements(shape)
    return packed_nbytes(size, 2) + 4 * chunks.chunk_count(size, bucket)

  options = [f"bucket={bucket}" if bucket is not None else "",
             f"clip={clip:g}" if clip is not None else "",
             "shared_scale=True" if shared_scale else ""]
  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=clip is None,
                    name=f"terngrad({', '.join(o for o in options if o)})")
