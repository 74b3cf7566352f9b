"""Casting to a narrower float: bfloat16, float16, float8 (e4m3, e5m2)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import backends
from jaxcomm._src.compress.base import Compressor, axis_context, num_elements, stateless_init
from jaxcomm._src.validation import check_bool, check_dtype, check_int_range

CAST_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)


class ScaledCastPayload(NamedTuple):
  """The wire format of a cast with a per-tensor scale.

  Attributes:
    values: shape ``(d,)`` in the narrow dtype: ``x / scale``, saturated to its finite range.
    scale: float32 of shape ``(1,)``: ``max |x| / max_finite(dtype)`` (1 for an all-zero input).
  """
  values: jax.Array
  scale: jax.Array


def saturate(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """Clips finite values to the finite range of ``dtype``; NaN and Inf pass through.

  Without it float16 overflows to Inf and float8 e4m3 (which has no Inf) to NaN. Keeping
  non-finite inputs non-finite is what lets them be detected downstream.
  """
  limit = float(jnp.finfo(dtype).max)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -limit, limit), x)


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
  """Rounds float32 ``x`` to the values of a narrower float ``dtype``, kept in float32.

  Bit for bit ``x.astype(dtype).astype(float32)`` (round to nearest even, ``dtype``'s
  subnormals included), without the round trip: XLA's GPU compiler may remove a float32 ->
  ``dtype`` -> float32 round trip inside one program (``--xla_allow_excess_precision``, on by
  default), and error feedback, which keeps what was sent beside the payload, would then keep
  the *unrounded* value where the receivers decode the rounded one. The rounding here is
  explicit (``reduce_precision``), and converting its result to ``dtype`` is exact, so
  removing that conversion changes nothing.

  Args:
    x: float32 array, any shape; for ``float8_e4m3fn``, saturated to its finite range
      (:func:`saturate`).
    dtype: a float dtype of :data:`CAST_DTYPES`, or float32 (``x`` is returned unchanged).

  Returns:
    float32 array of ``x``'s shape.
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return x
  info = jnp.finfo(dtype)
  # e4m3fn has no Inf: its top binade holds finite values (up to 448) where an IEEE format with
  # 4 exponent bits has Inf; one more exponent bit rounds the same 3-bit mantissa there.
  exponent_bits = info.nexp + 1 if dtype == jnp.float8_e4m3fn else info.nexp
  rounded = jax.lax.reduce_precision(x, exponent_bits=exponent_bits, mantissa_bits=info.nmant)
  if info.nexp < 8:
    # reduce_precision flushes dtype's subnormals to zero; the conversion rounds them to the
    # nearest multiple of the smallest one (half to even, as jnp.round). Scaling by a power of
    # two is exact.
    step = float(info.smallest_subnormal)
    rounded = jnp.where(jnp.abs(x) < float(info.smallest_normal), jnp.round(x / step) * step,
                        rounded)
  return rounded


def narrow(x: jax.Array, dtype: Any) -> jax.Array:
  """``x.astype(dtype)`` for float32 ``x``; on accelerators, rounded first by :func:`round_to`.

  XLA's CPU backend keeps a float32 -> ``dtype`` -> float32 round trip (the error-feedback
  tests check it on every narrow dtype), and the explicit rounding would cost it up to 55% of
  a cast's time, so the CPU converts directly.
  """
  if jnp.dtype(dtype) == jnp.float32:
    return x
  return backends.by_platform(lambda v: v.astype(dtype),
                              lambda v: round_to(v, dtype).astype(dtype), x)


def cast(dtype: Any, *, axis_size: int | None = None, scaled: bool = False) -> Compressor:
  """Sends the input cast to a narrower float dtype.

  Without ``scaled``, element ``i`` is sent as ``saturate(x_i / n)`` in ``dtype`` and
  decoded as ``n * float32(value)``. Pre-dividing by the number ``n`` of devices that will
  ``psum`` the payloads is the overflow guard: a sum of ``n`` values each at most
  ``max_finite / n`` in magnitude cannot leave the range of ``dtype``. ``n`` is the engine's
  axis size (:func:`~jaxcomm.compress.axis_context`; 1 outside it) unless ``axis_size`` fixes
  it. Values already beyond the range are saturated to ``+-max_finite`` (the excess stays
  in the residual under :func:`~jaxcomm.error_feedback`); NaN and Inf are sent as they are.

  With ``scaled=True`` (recommended for float8, whose range is narrow: e4m3 reaches only 448
  and flushes gradients below ~2e-3 to zero) a per-tensor scale ``max |x| / max_finite`` maps
  the largest magnitude to the top of the range, as in FP8 training recipes.

  Properties: biased (round to nearest even); relative error per element at most
  ``2**-(mantissa_bits + 1)`` inside the normal range (bf16: 2^-8, fp16: 2^-11, e4m3: 2^-4,
  e5m2: 2^-3). Linear without ``scaled`` (a ``psum`` of the payloads in ``dtype`` is the cast of
  the sum up to the rounding of that sum); not linear with ``scaled`` (private scales).

  Bytes: ``d * itemsize(dtype)`` (2 for 16-bit, 1 for float8), plus 4 with ``scaled``.

  Args:
    dtype: ``jnp.bfloat16``, ``jnp.float16``, ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
    axis_size: number of devices whose payloads will be summed, >= 1; ``None`` (default): the
      axis the engine runs the compressor on.
    scaled: send a per-tensor float32 scale with the values.

  Returns:
    A :class:`~jaxcomm.Compressor` whose payload is the cast array (shape ``(d,)``), or a
    :class:`ScaledCastPayload` with ``scaled``.

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018; Micikevicius et al., "FP8
    Formats for Deep Learning", 2022.
  """
  dtype = check_dtype("dtype", dtype, CAST_DTYPES)
  if axis_size is not None:
    axis_size = check_int_range("axis_size", axis_size, 1)
  scaled = check_bool("scaled", scaled)
  if scaled and axis_size not in (None, 1):
    raise ValueError(f"axis_size must be 1 with scaled=True (private scales are not summed), "
                     f"got axis_size={axis_size}.")
  limit = float(jnp.finfo(dtype).max)

  def devices() -> int:
    return axis_context().size if axis_size is None else axis_size

  def encode(x: jax.Array, state, key: jax.Array):
    del key
    flat = x.reshape(-1).astype(jnp.float32)
    if not scaled:
      return narrow(saturate(flat / devices(), dtype), dtype), state
    amax = jnp.max(jnp.abs(flat), initial=0.0)
    scale = jnp.where(amax > 0, amax / limit, 1.0).reshape(1)
    return ScaledCastPayload(narrow(saturate(flat / scale, dtype), dtype), scale), state

  def decode(payload, shape) -> jax.Array:
    if scaled:
      return (payload.values.astype(jnp.float32) * payload.scale).reshape(shape)
    return (payload.astype(jnp.float32) * devices()).reshape(shape)

  def wire_bytes(shape, input_dtype) -> int:
    del input_dtype
    return num_elements(shape) * dtype.itemsize + (4 if scaled else 0)

  suffix = ", scaled" if scaled else (f", axis_size={axis_size}" if axis_size else "")
  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=not scaled, unbiased=False, name=f"cast({dtype.name}{suffix})")
