"""Adaptive compression: the compression level of the slow axis chosen step by step.

:func:`adaptive_allreduce` holds a ladder of compressors, from the least to the most
compressed, each compiled once as a branch of one ``lax.switch``; a controller picks the
branch every step. All branches share one error-feedback residual (same shard, same shape), so
what one level leaves unsent, the next one sends. Three controllers:

* :func:`ratio_schedule`: more compression as training progresses (step boundaries);
* :func:`bandwidth_controller`: the least compression whose link time, estimated from the
  measured step and compute times, fits in a budget of the compute time;
* :func:`loss_controller`: closed loop on the training (or held-out) loss: more compression
  while it keeps improving, less as soon as it stalls.

Every signal a controller reads is first averaged over all devices (one ``psum`` of a few
float32 scalars, ``2(N-1)/N * 4 s`` bytes per device for ``s`` signals on ``N`` devices) and
every decision is a function of replicated state and those averages, so all devices always
run the same branch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.compressed_allreduce import compressed_allreduce
from jaxcomm._src.mesh_axes import manual_axes
from jaxcomm._src.validation import check_float, check_int_range, check_unit_interval


class Controller(NamedTuple):
  """Chooses the compression level from replicated state and averaged signals.

  Attributes:
    init: ``init(levels) -> state``, replicated.
    update: ``update(state, level, count, signals, levels) -> (new_level, state)``;
      ``signals`` maps the names in ``signals`` to float32 scalars averaged over devices;
      ``level`` is the level of the previous step, ``count`` the number of steps taken,
      ``levels`` the number of levels.
    signals: names of the extra ``update`` arguments the controller reads, e.g. ``('value',)``.
    levels: the number of levels it needs, or ``None`` for any.
  """
  init: Callable[[int], Any]
  update: Callable[..., tuple[jax.Array, Any]]
  signals: tuple[str, ...]
  levels: int | None = None


class AdaptiveState(NamedTuple):
  """State of :func:`adaptive_allreduce`.

  Attributes:
    allreduce: the shared :class:`~jaxcomm.optim.CompressedAllReduceState` (its residuals are used
      by every level).
    controller: the controller's state, replicated.
    level: int32, the level the last step used (replicated).
    level_steps: int32 ``(levels,)``: steps taken at each level, for the byte accounting.
  """
  allreduce: Any
  controller: Any
  level: jax.Array
  level_steps: jax.Array


def ratio_schedule(boundaries: Sequence[int]) -> Controller:
  """Level ``l`` from step ``boundaries[l-1]`` on: compression rises as training progresses.

  Args:
    boundaries: strictly increasing step counts ``>= 1``; ``len(boundaries) + 1`` levels.
  """
  boundaries = tuple(boundaries)
  for index, boundary in enumerate(boundaries):
    check_int_range(f"boundaries[{index}]", boundary, 1 if index == 0 else boundaries[index - 1] + 1)

  def update(state, level, count, signals, levels):
    del level, signals, levels
    return jnp.sum(count >= jnp.asarray(boundaries, jnp.int32)).astype(jnp.int32), state

  return Controller(init=lambda levels: (), update=update, signals=(),
                    levels=len(boundaries) + 1)


class BandwidthState(NamedTuple):
  """State of :func:`bandwidth_controller`: ``rate``, the EMA of the measured link rate in
  payload bytes per second (0 until the first measurement)."""
  rate: jax.Array


def bandwidth_controller(level_bytes: Sequence[float], *, budget: float = 1.0,
                         smoothing: float = 0.9) -> Controller:
  """Least compression whose link time fits in ``budget`` times the compute time.

  Signals (extra ``update`` arguments, seconds): ``step_time``, the measured time of the last
  step, and ``compute_time``, the time of the same step without communication (measured once,
  e.g. on one host). The link time of the last step, ``step_time - compute_time``, and its
  level's bytes give the link rate (an EMA over steps); the next level is the first ``l`` with
  ``level_bytes[l] / rate <= budget * compute_time``, else the most compressed. Until a rate is
  measured it runs level 0.

  Args:
    level_bytes: inter-host bytes per device per step of each level, decreasing (e.g. from
      :func:`jaxcomm.accounting.measure` of each branch, or the compressors' ``wire_bytes``).
    budget: link time allowed per unit of compute time, > 0 (1: communication may take as
      long as the computation).
    smoothing: EMA factor of the rate in ``[0, 1)``.
  """
  level_bytes = tuple(check_float(f"level_bytes[{i}]", b) for i, b in enumerate(level_bytes))
  if any(later > earlier for earlier, later in zip(level_bytes, level_bytes[1:])):
    raise ValueError(f"level_bytes must be non-increasing (least compressed first), got "
                     f"{list(level_bytes)}.")
  budget = check_float("budget", budget)
  smoothing = check_unit_interval("smoothing", smoothing)
  sizes = jnp.asarray(level_bytes, jnp.float32)

  def update(state: BandwidthState, level, count, signals, levels):
    del levels
    link_time = signals["step_time"] - signals["compute_time"]
    measured = sizes[level] / jnp.maximum(link_time, 1e-9)
    valid = (count > 0) & (link_time > 0)
    rate = jnp.where(~valid, state.rate, jnp.where(state.rate > 0, smoothing * state.rate
                                                   + (1 - smoothing) * measured, measured))
    fits = sizes / jnp.maximum(rate, 1e-9) <= budget * signals["compute_time"]
    chosen = jnp.where(jnp.any(fits), jnp.argmax(fits), len(level_bytes) - 1)
    return jnp.where(rate > 0, chosen, 0).astype(jnp.int32), BandwidthState(rate)

  return Controller(init=lambda levels: BandwidthState(jnp.zeros((), jnp.float32)),
                    update=update, signals=("step_time", "compute_time"),
                    levels=len(level_bytes))


class LossControllerState(NamedTuple):
  """State of :func:`loss_controller`.

  Attributes:
    average: EMA of the loss (NaN before the first value).
    best: the best average since the last level change.
    streak: int32, consecutive checks that improved (> 0) or stalled (< 0).
  """
  average: jax.Array
  best: jax.Array
  streak: jax.Array


def loss_controller(*, patience: int = 50, tolerance: float = 0.0,
                    smoothing: float = 0.9) -> Controller:
  """Closed loop on a loss signal: compress more while it improves, less when it stalls.

  Signal: ``value``, the loss of the step (training loss, or a held-out loss the loop passes
  when it has one), averaged over devices; its EMA is compared with the best since the last
  level change. ``patience`` consecutive improvements (below ``best * (1 - tolerance)``)
  move one level up (more compression); ``patience`` consecutive non-improvements move one
  level down (less compression), and the reference restarts. It starts at level 0.

  Args:
    patience: steps of evidence before a move, >= 1.
    tolerance: relative improvement that counts, in ``[0, 1)``.
    smoothing: EMA factor of the loss in ``[0, 1)``.

  References:
    Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Adaptive Gradient Communication via
    Critical Learning Regime Identification" (Accordion), MLSys 2021, which switches between
    two ratios on the rate of change of the gradient norm; this controller closes the loop on
    the loss instead.
  """
  patience = check_int_range("patience", patience, 1)
  tolerance = check_unit_interval("tolerance", tolerance)
  smoothing = check_unit_interval("smoothing", smoothing)

  def init(levels):
    del levels
    nan = jnp.full((), jnp.nan, jnp.float32)
    return LossControllerState(nan, nan, jnp.zeros((), jnp.int32))

  def update(state: LossControllerState, level, count, signals, levels):
    del count
    value = signals["value"]
    average = jnp.where(jnp.isnan(state.average), value,
                        smoothing * state.average + (1 - smoothing) * value)
    first = jnp.isnan(state.best)
    best = jnp.where(first, average, state.best)
    improved = average < best * (1 - tolerance)
    streak = jnp.where(first, 0, jnp.where(improved, jnp.maximum(state.streak, 0) + 1,
                                           jnp.minimum(state.streak, 0) - 1))
    move = jnp.where(streak >= patience, 1, jnp.where(streak <= -patience, -1, 0))
    new_level = jnp.clip(level + move, 0, levels - 1).astype(jnp.int32)
    changed = move != 0
    return new_level, LossControllerState(
        average=average, best=jnp.where(changed, average, jnp.minimum(best, average)),
        streak=jnp.where(changed, 0, streak))

  return Controller(init=init, update=update, signals=("value",))


def adaptive_allreduce(compressors: Sequence[Compressor], controller: Controller, *,
                       strategy: str = "gather",
                       **allreduce_options) -> optax.GradientTransformationExtraArgs:
  """:func:`~jaxcomm.compressed_allreduce` whose slow-axis compressor changes during training.

  Level ``l`` runs ``compressed_allreduce(compressors[l], strategy=strategy,
  **allreduce_options)``; with stateless compressors and one strategy every level has a state
  of the same structure, so they share the error-feedback residuals and the key. The controller runs first on each step and
  picks the level of that step. ``update(grads, state, params=None, **signals)`` takes the
  controller's signals as keyword arguments (``value=loss`` as for
  ``optax.contrib.reduce_on_plateau``, ``step_time=``, ``compute_time=``); each is averaged
  over every mesh axis before use.

  Bytes per device and step: those of the level run (each is a branch of one ``lax.switch``;
  ``state.level_steps`` counts the steps at each level, the weights for
  ``accounting``'s ``branch_weights``), plus ``2(N-1)/N * 4 s`` for ``s`` signals on ``N``
  devices.

  Args:
    compressors: at least two stateless compressors, least compressed first.
    controller: :func:`ratio_schedule`, :func:`bandwidth_controller`, :func:`loss_controller`
      or any :class:`Controller`.
    strategy: the slow-axis strategy of every level: ``'gather'`` (default, any
      compressor), ``'two_phase'``, or ``'linear'`` (linear compressors only).
    **allreduce_options: keyword arguments of :func:`~jaxcomm.compressed_allreduce` except
      ``compressor``, ``levels`` and ``strategy`` (``seed``, ``nonfinite``, ...).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
  """
  compressors = tuple(compressors)
  if len(compressors) < 2 or not all(isinstance(c, Compressor) for c in compressors):
    raise TypeError("compressors must be a sequence of at least two jaxcomm.Compressor, got "
                    f"{compressors!r}.")
  stateful = [c.name for c in compressors if c.stateful]
  if stateful:
    raise ValueError(f"compressors must be stateless to share one residual; {stateful} keep "
                     "state.")
  if not isinstance(controller, Controller):
    raise TypeError(f"controller must be a jaxcomm.optim.adaptive.Controller, got "
                    f"{type(controller).__name__}.")
  if controller.levels is not None and controller.levels != len(compressors):
    raise ValueError(f"the controller needs {controller.levels} levels, got "
                     f"{len(compressors)} compressors.")
  if strategy not in ("gather", "two_phase", "linear"):
    raise ValueError(f"strategy must be 'gather', 'two_phase' or 'linear' (one for every "
                     f"level), got {strategy!r}.")
  forbidden = {"compressor", "levels", "feedback"} & set(allreduce_options)
  if forbidden:
    raise ValueError(f"allreduce_options must not set {sorted(forbidden)}: the compressors "
                     "are the levels.")
  # Classic residuals for every level: EF21 estimates (chosen per compressor by default) and
  # residuals have different states, and the levels must share one.
  reducers = [compressed_allreduce(c, strategy=strategy, feedback="residual", **allreduce_options)
              for c in compressors]

  def init(params) -> AdaptiveState:
    return AdaptiveState(allreduce=reducers[0].init(params),
                         controller=controller.init(len(compressors)),
                         level=jnp.zeros((), jnp.int32),
                         level_steps=jnp.zeros((len(compressors),), jnp.int32))

  def update(grads, state: AdaptiveState, params=None, **extra):
    missing = [name for name in controller.signals if name not in extra]
    if missing:
      raise ValueError(f"the controller reads {list(controller.signals)}: pass "
                       f"{', '.join(f'{name}=...' for name in missing)} to update.")
    axes = manual_axes("adaptive_allreduce.update")
    signals = {name: jax.lax.pmean(jnp.asarray(extra[name], jnp.float32), axes)
               for name in controller.signals}
    count = jnp.sum(state.level_steps)
    level, controller_state = controller.update(state.controller, state.level, count, signals,
                                                len(compressors))
    branches = [lambda operands, reducer=reducer: reducer.update(*operands)
                for reducer in reducers]
    mean, allreduce_state = jax.lax.switch(level, branches, (grads, state.allreduce))
    return mean, AdaptiveState(allreduce=allreduce_state, controller=controller_state,
                               level=level, level_steps=state.level_steps.at[level].add(1))

  return hsdp.shard_aware(optax.GradientTransformationExtraArgs(init, update))
