"""Error feedback: what a compressor did not send is kept and added to the next input."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm.compress.base import Compressor, check_float_input


class ErrorFeedbackState(NamedTuple):
  """State of :func:`error_feedback`.

  Attributes:
    residual: float32, the input's shape: input mass not yet sent.
    inner: the wrapped compressor's own state.
  """
  residual: jax.Array
  inner: Any


def error_feedback(compressor: Compressor) -> Compressor:
  """Wraps ``compressor`` with error feedback (memory).

  Each call compresses ``a = x + e`` and keeps the part not sent, ``e' = a - decode(payload)``,
  computed against the decoded payload, i.e. the values that really crossed the wire (after any
  cast of the values to a narrower dtype). So ``decode(payload) + e' == x + e`` up to the
  rounding of one float32 subtraction, and over ``T`` steps
  ``sum_t decode(payload_t) == sum_t x_t - e_T``: nothing is lost, only delayed.

  A non-finite input (any NaN or Inf) leaves the residual and the inner state untouched: they
  are never overwritten with NaN or Inf. The payload then carries the non-finite values, and
  the caller decides whether to skip the step.

  The result is never linear, even around a linear compressor: residuals are private.
  Bytes: those of ``compressor``.

  Args:
    compressor: any :class:`~jaxcomm.Compressor`.

  Returns:
    A :class:`~jaxcomm.Compressor` whose state is :class:`ErrorFeedbackState`.

  References:
    Seide et al. 2014; Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
    Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
    Schemes", ICML 2019.
  """
  if not isinstance(compressor, Compressor):
    raise TypeError(f"compressor must be a jaxcomm.Compressor, got {type(compressor).__name__}.")

  def init(shape, dtype) -> ErrorFeedbackState:
    return ErrorFeedbackState(residual=jnp.zeros(shape, jnp.float32),
                              inner=compressor.init(shape, dtype))

  def encode(x: jax.Array, state: ErrorFeedbackState, key: jax.Array):
    check_float_input(x)
    corrected = x.astype(jnp.float32) + state.residual
    payload, inner = compressor.encode(corrected, state.inner, key)
    finite = jnp.all(jnp.isfinite(x))
    unsent = corrected - compressor.decode(payload, x.shape)
    keep_if_nonfinite = lambda new, old: jnp.where(finite, new, old)
    residual = keep_if_nonfinite(unsent, state.residual)
    inner = jax.tree.map(keep_if_nonfinite, inner, state.inner)
    return payload, ErrorFeedbackState(residual=residual, inner=inner)

  return Compressor(init=init, encode=encode, decode=compressor.decode,
                    wire_bytes=compressor.wire_bytes, linear=False,
                    unbiased=False, name=f"ef({compressor.name})")
