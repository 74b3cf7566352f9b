"""QSGD: stochastic quantization of |g_i| / ||g||_2 to s levels, signs and levels bit-packed."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import chunks
from jaxcomm._src.compress.base import Compressor, num_elements, stateless_init
from jaxcomm._src.validation import check_int_range
from jaxcomm._src.compress.hashing import bernoulli
from jaxcomm._src.compress.packing import materialized, pack_bits, packed_nbytes, unpack_bits


class QSGDPayload(NamedTuple):
  """The wire format of QSGD.

  Attributes:
    codes: uint8 of shape ``(ceil(d * b / 8),)`` with ``b = ceil(log2(s + 1)) + 1``: per
      element the level ``l`` in the low ``b - 1`` bits and the sign (1 = negative) on top.
    norm: float32 of shape ``(buckets,)``: ``||g||_2`` of each bucket.
  """
  codes: jax.Array
  norm: jax.Array


def qsgd_bits(levels: int) -> int:
  """Bits per element: ``ceil(log2(s + 1))`` for the level in ``[0, s]`` plus 1 for the sign."""
  return math.ceil(math.log2(levels + 1)) + 1


def qsgd(levels: int = 16, *, bucket: int | None = 512) -> Compressor:
  """QSGD with ``s = levels`` quantization levels, per bucket (default) or per tensor.

  ``Q(g)_i = ||g||_2 * sign(g_i) * xi_i / s`` where, with ``r = s |g_i| / ||g||_2`` and
  ``l = floor(r)``, ``xi_i = l + 1`` with probability ``r - l`` and ``l`` otherwise; ``r`` is
  computed as ``|g_i| * (s / ||g||_2)``, the scale rounded once per bucket. A zero norm sends
  zeros (no division by zero). The input is split into buckets of ``bucket`` elements, each
  quantized with its own norm (the paper's experiments use 512, the default), or with
  ``bucket=None`` one norm for the whole tensor, whose variance grows with ``sqrt(d)``.

  Properties: unbiased, ``E[Q(g)] = g``, with variance
  ``E||Q(g) - g||^2 <= min(n / s^2, sqrt(n) / s) * ||g||^2`` for ``n = d``, or ``n = bucket``
  with buckets; not linear (private norms). Error feedback is optional.

  Bytes: ``ceil(d * (ceil(log2(s + 1)) + 1) / 8) + 4 * buckets`` with ``buckets = 1`` or
  ``ceil(d / bucket)``; e.g. ``s = 1`` is 2 bits per element, ``s = 16`` 6 bits, ``s = 127``
  8 bits.

  Args:
    levels: ``s``, in ``[1, 127]`` (so a code fits in a byte).
    bucket: elements per norm, >= 1 (default 512); ``None`` for one norm per tensor. The
      default is measured (docs/quality.md, section 13): in front of SGD with momentum 0.9 at
      fp32's learning rate one norm per tensor diverges on the digits task, and in front of
      AdamW it loses 3.7 points; buckets of 512 are within 0.5 points of fp32 with both, for
      about 1.3% more bytes at 16 levels.

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`QSGDPayload` payloads.

  References:
    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding", NeurIPS 2017.
  """
  levels = check_int_range("levels", levels, 1, 127)
  if bucket is not None:
    bucket = check_int_range("bucket", bucket, 1)
  bits = qsgd_bits(levels)
  sign_bit = 1 << (bits - 1)

  def encode(x: jax.Array, state, key: jax.Array):
    flat = x.reshape(-1).astype(jnp.float32)
    norms = chunks.l2_norms(flat, bucket)
    # One scale per bucket, so each element's ratio is a multiplication: a division by a
    # broadcast norm per element is not fused into the codes by XLA's CPU backend, which
    # wrote the ratios to a 64 MiB temporary at 16M (and took a loop over steps of 2^18
    # elements to keep them in cache: encode at 16M in buckets of 512, 28 -> 20 ms of CPU).
    scale = chunks.per_element(levels / jnp.where(norms > 0, norms, 1.0), flat.shape[0], bucket)
    # Each code (a multiplication and a hash) computed once, not once per byte it overlaps
    # (1M elements, 6 bits: encode 2.3 -> 1.5 ms of CPU).
    codes = materialized(_codes(flat, scale, key))
    return QSGDPayload(pack_bits(codes, bits), norms), state

  def _codes(flat, scale, key):
    """The codes of ``flat`` given each element's ``scale``, ``s / ||g||`` of its bucket (1 for
    a zero norm, whose elements are zero)."""
    ratio = jnp.abs(flat) * scale
    floor = jnp.floor(ratio)
    # One round of hashing (hashing.bits_at): with two, the hash was most of the codes' time.
    round_up = bernoulli(key, ratio - floor, rounds=1)
    # The level in int32 (a NaN ratio converts to 0, as it did through a float clip): a float
    # clip propagates NaNs with extra compares and blends per element (16M: encode -2.7 ms).
    level = floor.astype(jnp.int32) + round_up
    # Rounding in the ratio can reach s + epsilon for a one-hot input; clip so the code fits.
    level = jnp.minimum(level, levels)
    return (level | jnp.where(flat < 0, sign_bit, 0)).astype(jnp.uint8)

  def decode(payload: QSGDPayload, shape) -> jax.Array:
    size = num_elements(shape)
    codes = unpack_bits(payload.codes, bits, size)
    level = (codes & (sign_bit - 1)).astype(jnp.float32)
    sign = jnp.where(codes >= sign_bit, -1.0, 1.0)
    # Several buckets' norms written to memory first: a gather decodes each host's payload
    # from received bytes, and with their conversion to float32 fused into this loop, XLA's
    # CPU backend did not vectorize it (two hosts, 32,768 elements in buckets of 512: 55 ->
    # 28 us). One norm is broadcast as it is (materialized, 16M: decode +4 ms of CPU).
    norm = payload.norm
    if norm.shape[0] > 1:
      norm = materialized(norm)
    norm = chunks.per_element(norm, size, bucket)
    return (norm * sign * level / levels).reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    size = num_elements(shape)
    return packed_nbytes(size, bits) + 4 * chunks.chunk_count(size, bucket)

  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=True,
                    name=f"qsgd({levels}, bucket={bucket})")
