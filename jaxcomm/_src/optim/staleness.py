"""Simulated asynchronous training: gradients applied ``tau`` steps late, DC-ASGD."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.optim import hsdp
from jaxcomm._src.validation import check_float, check_int_range

SCALINGS = ("none", "linear", "sqrt", "exponential")


class StalenessState(NamedTuple):
  """State of :func:`staleness`.

  Attributes:
    gradients: each leaf ``(tau, *shape)``: the last ``tau`` incoming gradients, oldest
      first (zeros before ``tau`` steps have passed). Same sharding as the gradients.
    params: each leaf ``(tau, *shape)``: the parameters those gradients were taken at
      (DC-ASGD's ``w_{t-tau}``); ``None`` without delay compensation.
    count: int32 step counter.
  """
  gradients: Any
  params: Any
  count: jax.Array


def staleness_scale(tau: int, scaling: str, base: float) -> float:
  """``eta(tau) / eta``: ``1/(1+tau)``, ``1/sqrt(1+tau)``, ``base**tau`` or 1."""
  return {"none": 1.0, "linear": 1.0 / (1 + tau), "sqrt": (1 + tau) ** -0.5,
          "exponential": base ** tau}[scaling]


def staleness(tau: int, *, scaling: str = "none", base: float = 0.9,
              compensation: float | None = None) -> optax.GradientTransformation:
  """Applies each gradient ``tau`` steps after it was computed, as an asynchronous worker would.

  ``update_t = s(tau) g_{t-tau}`` with ``s`` from ``scaling`` (chain an optimizer such as
  ``optax.sgd(eta)`` after it: ``w_{t+1} = w_t - eta s(tau) g(w_{t-tau})``); the first
  ``tau`` updates are zero. With ``compensation = lambda`` (DC-ASGD, diagonal form) the stale
  gradient is corrected to ``g + lambda g * g * (w_t - w_{t-tau})``. ``tau = 0`` passes the
  gradient through unchanged (synchronous training); ``lambda = 0`` is the plain stale update.

  Place it after :func:`jaxcomm.compressed_allreduce` in a chain to delay the averaged
  gradient (replicated buffers), or before it to delay each device's own gradient.
  No communication. Memory: ``tau`` gradients (and ``tau`` parameter copies with DC-ASGD).

  Args:
    tau: delay in steps, ``>= 0``.
    scaling: learning-rate scaling: ``'none'``, ``'linear'`` (``1/(1+tau)``), ``'sqrt'``
      (``1/sqrt(1+tau)``) or ``'exponential'`` (``base**tau``).
    base: the exponential scaling's base in ``(0, 1]``.
    compensation: DC-ASGD ``lambda >= 0``; ``None`` keeps no parameter history.

  Returns:
    An ``optax.GradientTransformation``; with ``compensation`` its ``update`` needs
    ``params``.

  References:
    Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML
    2017; Zhang, Gupta, Lian & Liu, "Staleness-Aware Async-SGD for Distributed Deep
    Learning", IJCAI 2016 (learning rate divided by the staleness).
  """
  tau = check_int_range("tau", tau, 0)
  if scaling not in SCALINGS:
    raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}.")
  base = check_float("base", base)
  if base > 1.0:
    raise ValueError(f"base must be in (0, 1], got {base}.")
  if compensation is not None:
    compensation = check_float("compensation", compensation, minimum=0.0, inclusive=True)
  scale = staleness_scale(tau, scaling, base)

  def history(tree):
    return jax.tree.map(lambda leaf: jnp.zeros((tau, *leaf.shape), leaf.dtype), tree)

  def init(params) -> StalenessState:
    return StalenessState(gradients=history(params),
                          params=None if compensation is None else history(params),
                          count=jnp.zeros((), jnp.int32))

  def push(buffer, newest):
    return jax.tree.map(lambda b, x: jnp.concatenate([b[1:], x[None].astype(b.dtype)]),
                        buffer, newest)

  def update(grads, state: StalenessState, params=None):
    if compensation is not None and params is None:
      raise ValueError("staleness(compensation=...) needs params in update().")
    if tau == 0:
      stale, old_params = grads, params
      buffers = state.gradients, state.params
    else:
      stale = jax.tree.map(lambda b: b[0], state.gradients)
      old_params = None if compensation is None else jax.tree.map(lambda b: b[0], state.params)
      buffers = (push(state.gradients, grads),
                 None if compensation is None else push(state.params, params))
    if compensation is not None:
      stale = jax.tree.map(lambda g, w, w_old: g + compensation * g * g * (w - w_old),
                           stale, params, old_params)
    updates = jax.tree.map(lambda g: g * scale, stale) if scale != 1.0 else stale
    return updates, StalenessState(*buffers, count=state.count + 1)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))
