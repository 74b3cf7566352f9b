"""Selective gradient compression: full precision, top-k or sign per leaf, from its statistics.

Shapes must stay static under ``jit``, so the choice is not made inside the compiled step.
The statistics are updated inside it (cheap, elementwise); every ``period`` steps the host
reads them and picks a compressor per leaf, and the training loop uses the step compiled for
that choice (at most three variants per leaf ever exist, so ``jit``'s cache holds them all).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.validation import check_float, check_fraction, check_int_range, renamed
from jaxcomm._src.compress.sign import sign
from jaxcomm._src.compress.topk import topk
from jaxcomm._src.nonfinite import has_nonfinite, keep_if


class GradientStatistics(NamedTuple):
  """Running statistics of each gradient leaf.

  Attributes:
    mean: pytree like the gradients, float32: exponential moving average of ``g``.
    power: pytree with one float32 ``(1,)`` per leaf: moving average of ``||g||^2``.
    count: int32 ``(1,)``: number of (finite) gradients averaged.
  """
  mean: Any
  power: Any
  count: jax.Array


class SelectiveCompression(NamedTuple):
  """Selective gradient compression. Build it with :func:`selective`.

  Attributes:
    init: ``init(params) -> GradientStatistics``.
    update: ``update(grads, stats) -> stats``, jit-able; call it every step with the averaged
      gradient (identical on every device, so every device later makes the same choice).
      A gradient with a NaN or Inf leaves the statistics unchanged.
    noise_ratios: ``noise_ratios(stats) -> list`` of float32 scalars per leaf, see
      :func:`selective`.
    choose: ``choose(stats) -> list[Compressor | None]`` per leaf, in ``jax.tree.leaves``
      order; host-side (reads the statistics), call it every ``period`` steps.
    period: steps between decisions.
  """
  init: Any
  update: Any
  noise_ratios: Any
  choose: Any
  period: int


def selective(tau_low: float, tau_high: float, *, period: int = 100, beta: float = 0.9,
              topk_density: float | None = None, sign_chunk: int | None = None,
              topk_fraction: float | None = None) -> SelectiveCompression:
  """Per-leaf choice among full precision, top-k and scaled sign from gradient noise.

  For each leaf, with ``m`` the moving average of ``g`` and ``v`` that of ``||g||^2`` (both
  bias-corrected), the noise ratio ``rho = 1 - ||m||^2 / v`` in ``[0, 1]`` is the share of the
  gradient's energy that changes from step to step (its variance over ``E||g||^2``). A leaf
  whose gradient is mostly signal (``rho < tau_low``) is sent at full precision; a leaf whose
  gradient is mostly noise (``rho >= tau_high``) loses little to the coarsest compressor,
  scaled sign; the others use top-k. Before ``period`` gradients are averaged every leaf is at
  full precision. The compressors it returns are biased: use them with error feedback.

  Args:
    tau_low: noise ratio below which a leaf stays at full precision, in ``[0, 1]``.
    tau_high: noise ratio from which a leaf uses sign, in ``[tau_low, 1]``.
    period: steps between decisions, >= 1.
    beta: decay of the moving averages, in ``[0, 1)``.
    topk_density: fraction kept by the top-k choice, in (0, 1]; default 0.01.
    sign_chunk: elements per scale of the sign choice (``None``: one per tensor).
    topk_fraction: the former name of ``topk_density`` (deprecated).

  Returns:
    A :class:`SelectiveCompression`.

  Example:
    >>> sel = selective(0.2, 0.8, period=100)  # doctest: +SKIP
    >>> stats = sel.init(params)  # doctest: +SKIP
    >>> for step in range(steps):  # doctest: +SKIP
    ...   if step % sel.period == 0:
    ...     choices = tuple(sel.choose(stats))  # compile (or reuse) the step for these
    ...   grads = ...; stats = sel.update(grads, stats)

  References:
    Agarwal et al., "Accordion: Adaptive Gradient Communication via Critical Learning Regime
    Identification", MLSys 2021 (switching compression levels from gradient statistics);
    the noise-ratio thresholds are this library's rule.
  """
  tau_low = check_float("tau_low", tau_low, inclusive=True)
  tau_high = check_float("tau_high", tau_high, minimum=tau_low, inclusive=True)
  if tau_high > 1.0:
    raise ValueError(f"tau_high must be <= 1, got {tau_high}.")
  period = check_int_range("period", period, 1)
  beta = check_float("beta", beta, inclusive=True)
  if beta >= 1.0:
    raise ValueError(f"beta must be < 1, got {beta}.")
  topk_density = renamed("topk_density", topk_density, "topk_fraction", topk_fraction)
  sparse = topk(check_fraction("topk_density", 0.01 if topk_density is None else topk_density))
  coarse = sign(sign_chunk)

  def init(params) -> GradientStatistics:
    return GradientStatistics(
        mean=jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), params),
        power=jax.tree.map(lambda leaf: jnp.zeros((1,), jnp.float32), params),
        count=jnp.zeros((1,), jnp.int32))

  def update(grads, stats: GradientStatistics) -> GradientStatistics:
    mean = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g.astype(jnp.float32),
                        stats.mean, grads)
    power = jax.tree.map(
        lambda v, g: beta * v + (1 - beta) * jnp.sum(jnp.square(g.astype(jnp.float32))),
        stats.power, grads)
    new = GradientStatistics(mean, power, stats.count + 1)
    return keep_if(has_nonfinite(grads), stats, new)

  def noise_ratios(stats: GradientStatistics) -> list[jax.Array]:
    # The bias corrections of m and v cancel in ||m||^2 / v up to one factor (1 - beta^t).
    correction = 1.0 - beta ** stats.count[0].astype(jnp.float32)
    ratios = []
    for mean, power in zip(jax.tree.leaves(stats.mean), jax.tree.leaves(stats.power)):
      signal = jnp.sum(jnp.square(mean)) / jnp.maximum(correction, 1e-12)
      ratio = 1.0 - signal / jnp.where(power[0] > 0, power[0], 1.0)
      ratios.append(jnp.where(power[0] > 0, jnp.clip(ratio, 0.0, 1.0), 0.0))
    return ratios

  def choose(stats: GradientStatistics) -> list[Compressor | None]:
    if int(jax.device_get(stats.count)[0]) < period:
      return [None] * len(jax.tree.leaves(stats.power))
    choices = []
    for ratio in np.asarray(jax.device_get(noise_ratios(stats))):
      choices.append(None if ratio < tau_low else (coarse if ratio >= tau_high else sparse))
    return choices

  return SelectiveCompression(init=init, update=update, noise_ratios=noise_ratios,
                              choose=choose, period=period)
