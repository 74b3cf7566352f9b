"""Dynamic loss scaling around a float16 allreduce, with one overflow decision for all devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.mesh_axes import require_axes
from jaxcomm._src.nonfinite import any_nonfinite, has_nonfinite, keep_if, zero_if
from jaxcomm._src.validation import check_float, check_int_range


class DynamicLossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scale`.

  Attributes:
    scale: float32 scalar: the factor the loss is multiplied by (read it in the train step).
    good_steps: int32: finite steps since the scale last changed.
    skipped: int32: steps skipped for non-finite gradients so far.
    allreduce: the allreduce transformation's state.
    optimizer: the optimizer's state.
  """
  scale: jax.Array
  good_steps: jax.Array
  skipped: jax.Array
  allreduce: Any
  optimizer: Any


def dynamic_loss_scale(allreduce: optax.GradientTransformation,
                       optimizer: optax.GradientTransformation, *, axes: Sequence[str],
                       initial_scale: float = 2.0**15, growth_interval: int = 2000,
                       factor: float = 2.0) -> optax.GradientTransformation:
  """Communicates loss-scaled gradients (e.g. in float16), unscales, then optimizes.

  The train step multiplies its loss by ``state.scale`` (so small gradients survive float16),
  and passes the scaled per-device gradients to ``update``. There:

  1. every device computes whether its own gradients hold a NaN or Inf, and the flags are
     combined with a ``pmax`` over all ``axes``: all devices take the same decision, so none
     applies a step that another skipped;
  2. ``allreduce`` (e.g. ``compressed_allreduce(levels=[level('local', dtype=jnp.float16),
     level('host', cast(jnp.float16))])``) averages the scaled gradients; an overflow in its
     sums is detected on the identical result, so it is agreed too;
  3. the mean is divided by the scale in float32 and handed to ``optimizer``.

  On overflow the update is zero, neither inner state changes (error-feedback residuals are
  not touched), the scale is divided by ``factor`` and ``skipped`` counts the step. After
  ``growth_interval`` finite steps in a row the scale is multiplied by ``factor``. bfloat16
  communication has float32's range and needs none of this.

  Bytes: those of ``allreduce`` plus one 4-byte all-reduce (the flag) over ``axes``.

  Args:
    allreduce: the communicating transformation (first in the chain).
    optimizer: the transformation applied to the unscaled mean.
    axes: every mesh axis of the enclosing ``shard_map``.
    initial_scale: first loss scale, > 0.
    growth_interval: finite steps before the scale grows, >= 1.
    factor: growth and back-off factor, > 1.

  Returns:
    An ``optax.GradientTransformation`` with :class:`DynamicLossScaleState`.

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  """
  initial_scale = check_float("initial_scale", initial_scale)
  growth_interval = check_int_range("growth_interval", growth_interval, 1)
  factor = check_float("factor", factor, minimum=1.0)
  axes = tuple(axes)
  if not axes or not all(isinstance(a, str) and a for a in axes):
    raise TypeError(f"axes must be a non-empty sequence of mesh axis names, got {axes!r}.")

  def init(params) -> DynamicLossScaleState:
    return DynamicLossScaleState(
        scale=jnp.asarray(initial_scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32), allreduce=allreduce.init(params),
        optimizer=optimizer.init(params))

  def update(scaled_grads, state: DynamicLossScaleState, params=None):
    require_axes(axes, "dynamic_loss_scale.update")
    any_device_bad = any_nonfinite(scaled_grads, axes)
    mean, allreduce_state = allreduce.update(scaled_grads, state.allreduce, params)
    # The mean is identical on every device, so its own check needs no agreement.
    skip = any_device_bad | has_nonfinite(mean)
    unscaled = jax.tree.map(
        lambda g: jnp.where(skip, 0.0, g.astype(jnp.float32) / state.scale).astype(g.dtype), mean)
    updates, optimizer_state = optimizer.update(unscaled, state.optimizer, params)
    grown = state.good_steps + 1 >= growth_interval
    new_state = DynamicLossScaleState(
        scale=jnp.where(skip, state.scale / factor,
                        jnp.where(grown, state.scale * factor, state.scale)),
        good_steps=jnp.where(skip | grown, 0, state.good_steps + 1),
        skipped=state.skipped + skip.astype(jnp.int32),
        allreduce=keep_if(skip, state.allreduce, allreduce_state),
        optimizer=keep_if(skip, state.optimizer, optimizer_state))
    return zero_if(skip, updates), new_state

  return optax.GradientTransformation(init, update)
