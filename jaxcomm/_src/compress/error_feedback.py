"""Error feedback: what a compressor did not send is kept and added to the next input."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import backends
from jaxcomm._src.compress.base import Compressor, subtract_decoded
from jaxcomm._src.nonfinite import has_nonfinite, keep_finite, keep_if
from jaxcomm._src.validation import check_float, check_float_input


def _check_compressor(compressor) -> None:
  if not isinstance(compressor, Compressor):
    raise TypeError(f"compressor must be a jaxcomm.Compressor, got {type(compressor).__name__}.")


def _wrapping(compressor: Compressor, init, encode, prefix: str) -> Compressor:
  """A compressor with its own ``init``/``encode`` that sends what ``compressor`` sends: its
  decode (and decode-and-sum, subtract-decoded), bytes, linearity and matrix method; never
  unbiased (the state carries past inputs)."""
  return Compressor(init=init, encode=encode, decode=compressor.decode,
                    wire_bytes=compressor.wire_bytes, linear=compressor.linear,
                    unbiased=False, name=f"{prefix}({compressor.name})",
                    matrix_method=compressor.matrix_method, decode_sum=compressor.decode_sum,
                    subtract_decoded=compressor.subtract_decoded)


class ErrorFeedbackState(NamedTuple):
  """State of :func:`error_feedback`.

  Attributes:
    residual: float32, the input's shape: input mass not yet sent.
    inner: the wrapped compressor's own state.
  """
  residual: jax.Array
  inner: Any


def _cap_scale(norm: jax.Array, limit: jax.Array) -> jax.Array:
  """The factor in ``[0, 1]`` (or NaN) that scales a residual of norm ``norm`` down to norm
  ``limit`` where it is longer (0 for a zero ``limit``)."""
  return jnp.minimum(1.0, limit / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))


def _keep_if(bad: jax.Array, old: ErrorFeedbackState, new: ErrorFeedbackState):
  """:func:`~jaxcomm._src.nonfinite.keep_if` of the floating-point leaves, on the CPU as a
  conditional: its usual branch hands ``new`` on as it is, where the select read both
  residuals and wrote a third (16M float32 elements: ``ef(topk(0.01))``'s encode 1-1.5 ms
  of CPU less, of ~25). On an accelerator a conditional waits for its predicate on the host,
  and the select, one fused pass, stays."""
  def on_cpu(bad, old, new):
    return jax.lax.cond(bad, lambda: keep_if(True, old, new, floats_only=True), lambda: new)
  return backends.by_platform(on_cpu, functools.partial(keep_if, floats_only=True),
                              bad, old, new)


def _unsent_nonfinite(unsent: jax.Array) -> jax.Array:
  """Bool scalar: the float32 residual ``unsent`` holds a NaN or an Inf, as
  :func:`~jaxcomm._src.nonfinite.has_nonfinite` says, on the CPU from a plain sum.

  A NaN or Inf entry makes every sum of the entries NaN or Inf (an IEEE addition never turns
  one finite again), so a finite sum clears them all; a sum that is not finite (such an entry,
  or finite entries whose sum overflows) looks entry by entry. XLA's CPU backend runs each
  check as a one-threaded XNNPACK reduction, and ``sum(x - x)`` computes twice what ``sum(x)``
  does (16M float32 elements: about 5 against 2.5-3 ms). On accelerators a conditional waits
  for its predicate on the host, and the fused reduction of ``x - x`` stays."""
  def on_cpu(unsent):
    total = jnp.sum(unsent)
    # (`isnan(total)` is False in the finite branch, and varies over mesh axes as `unsent`.)
    return jax.lax.cond(jnp.isfinite(total), lambda: jnp.isnan(total),
                        lambda: has_nonfinite(unsent))
  return backends.by_platform(on_cpu, has_nonfinite, unsent)


def error_feedback(compressor: Compressor, *, bound: float | None = None) -> Compressor:
  """Wraps ``compressor`` with error feedback (memory).

  Each call compresses ``a = x + e`` and keeps the part not sent, ``e' = a - decode(payload)``,
  computed against the decoded payload, i.e. the values that really crossed the wire (after any
  cast of the values to a narrower dtype). So ``decode(payload) + e' == x + e`` up to the
  rounding of one float32 subtraction, and over ``T`` steps
  ``sum_t decode(payload_t) == sum_t x_t - e_T``: nothing is lost, only delayed.

  With ``bound``, the kept residual is scaled down, where it is longer, to norm
  ``bound * ||x||``: the norm of this call's input, not of the accumulated ``a`` (all norms
  over the whole input). What is scaled away is dropped, so the identity above becomes
  ``decode(payload) + e' == x + e - (1 - s)(a - decode(payload))`` with
  ``s = min(1, bound ||x|| / ||a - decode(payload)||)``. A sparsifier's residual can grow to
  hundreds of times the current gradient once the model fits the data (the gradient shrinks,
  the residual keeps the mass of older, larger gradients); released in a burst, that stale
  mass is integrated by a momentum after the mean into a kick that undoes the fit
  (docs/quality.md, section 9). The bound keeps the residual within ``bound`` gradients.

  A non-finite input (any NaN or Inf) leaves the residual and the floating-point leaves of
  the inner state untouched: they are never overwritten with
  NaN or Inf. Integer leaves of the inner state (PRNG keys, counters) advance anyway, because
  compressors with shared randomness (shared random-k) must stay in step with the other
  devices. The payload then carries whatever the compressor made of the input, and the
  caller decides (ideally with a max over all devices) whether to skip the step.

  Linear when ``compressor`` is: each device encodes its own ``x + e``, and a ``psum`` of the
  payloads is the payload of ``sum_devices (x + e)``; private residuals do not change that.
  Never unbiased (the residual carries past inputs). Bytes: those of ``compressor``.

  Args:
    compressor: any :class:`~jaxcomm.Compressor`.
    bound: ``None`` (classic error feedback, nothing dropped) or a float > 0: the residual's
      norm is at most ``bound`` times the input's.

  Returns:
    A :class:`~jaxcomm.Compressor` whose state is :class:`ErrorFeedbackState`.

  References:
    Seide et al. 2014; Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
    Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
    Schemes", ICML 2019.
  """
  _check_compressor(compressor)
  if bound is not None:
    bound = check_float("bound", bound)

  def init(shape, dtype) -> ErrorFeedbackState:
    return ErrorFeedbackState(residual=jnp.zeros(shape, jnp.float32),
                              inner=compressor.init(shape, dtype))

  def encode(x: jax.Array, state: ErrorFeedbackState, key: jax.Array):
    check_float_input(x)
    x32 = x.astype(jnp.float32)
    corrected = x32 + state.residual
    payload, inner = compressor.encode(corrected, state.inner, key)
    unsent = subtract_decoded(compressor, corrected, payload)
    # The residual alone is checked: a NaN or Inf in `corrected` leaves one in `unsent` at the
    # same entry (x - y is not finite for a non-finite x). It also catches a compressor that
    # overflowed on finite input. Top-k tells from its k values (unsent_nonfinite), without
    # a pass over the residual.
    kept = compressor.unsent_nonfinite
    if bound is None:
      bad = _unsent_nonfinite(unsent) if kept is None else kept(payload)
    else:
      # The capped residual `unsent * scale` (scale <= 1) is not finite exactly where
      # `unsent` is not or the scale is NaN, so it is checked through those two before the
      # product is made (as the new residual). A NaN or Inf in `unsent` makes its norm NaN or
      # Inf, so a finite norm clears it without a pass of its own; a norm that is not finite
      # (also when finite squares overflow) looks entry by entry.
      norm = jnp.linalg.norm(unsent)
      scale = _cap_scale(norm, bound * jnp.linalg.norm(x32))
      # (`isnan(norm)` is False in the finite branch, and varies over mesh axes as `unsent`.)
      bad = (jax.lax.cond(jnp.isfinite(norm), lambda: jnp.isnan(norm),
                          lambda: has_nonfinite(unsent)) if kept is None else kept(payload))
      bad = bad | jnp.isnan(scale)
      unsent = unsent * scale
    new = ErrorFeedbackState(residual=unsent, inner=inner)
    return payload, _keep_if(bad, state, new)

  return _wrapping(compressor, init, encode, "ef" if bound is None else f"ef[bound={bound:g}]")


class EstimateFeedbackState(NamedTuple):
  """State of :func:`estimate_feedback` on one device.

  Attributes:
    estimate: float32, the input's shape: this device's estimate ``g_hat_i`` of its input,
      the sum of every delta it has sent (decoded).
    inner: the wrapped compressor's own state.
  """
  estimate: jax.Array
  inner: Any


def estimate_feedback(compressor: Compressor) -> Compressor:
  """Wraps ``compressor`` with EF21: send the compressed change of a kept estimate.

  Each device keeps an estimate ``g_hat`` of its own input and sends ``C(x - g_hat)``; after
  the call ``g_hat' = g_hat + decode(payload)``. The payload decodes to the *change* of the
  estimate, so a receiver that adds the decoded payloads of every device to its own copy of
  the mean estimate holds exactly the mean of the devices' estimates
  (:func:`jaxcomm.compressed_allreduce` does this, on every device). For a contractive
  compressor (``||C(v) - v||^2 <= (1 - delta) ||v||^2``) the estimate's error contracts every
  step, ``||g_hat' - x||^2 <= (1 - delta) ||g_hat - x||^2``: unlike :func:`error_feedback`,
  no unsent mass accumulates to be released later in a burst, which an optimizer's momentum
  after the mean would amplify.

  A non-finite input leaves the estimate and the floating-point leaves of the inner state
  untouched, as :func:`error_feedback` does; an estimate entry that overflows from finite
  inputs keeps its old value.

  Linear when ``compressor`` is (the payloads of the devices' deltas sum to the payload of
  the summed delta). Never unbiased. Bytes: those of ``compressor``.

  Args:
    compressor: any :class:`~jaxcomm.Compressor`.

  Returns:
    A :class:`~jaxcomm.Compressor` whose state is :class:`EstimateFeedbackState` and whose
    ``decode`` returns the change of the estimate.

  References:
    Richtárik, Sokolov & Fatkhullin, "EF21: A New, Simpler, Theoretically Better, and
    Practically Faster Error Feedback", NeurIPS 2021.
  """
  _check_compressor(compressor)

  def init(shape, dtype) -> EstimateFeedbackState:
    return EstimateFeedbackState(estimate=jnp.zeros(shape, jnp.float32),
                                 inner=compressor.init(shape, dtype))

  def encode(x: jax.Array, state: EstimateFeedbackState, key: jax.Array):
    check_float_input(x)
    change = x.astype(jnp.float32) - state.estimate
    payload, inner = compressor.encode(change, state.inner, key)
    # An entry that overflows from finite operands keeps its old value, entry by entry: the
    # estimate is made, kept and written in one pass. The input, not the change, is checked
    # for NaN and Inf: the same reduction as a collective's check of the shard it hands over,
    # which XLA then computes once.
    estimate = keep_finite(state.estimate + compressor.decode(payload, x.shape), state.estimate)
    return payload, keep_if(has_nonfinite(x), state,
                            EstimateFeedbackState(estimate=estimate, inner=inner),
                            floats_only=True)

  return _wrapping(compressor, init, encode, "ef21")
