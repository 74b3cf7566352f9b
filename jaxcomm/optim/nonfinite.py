"""Skipping a whole optimizer step, on every device at once, when any gradient is not finite."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.collectives.axes import require_axes


def has_nonfinite(leaves: Sequence[jax.Array]) -> jax.Array:
  """Bool scalar: some leaf holds a NaN or Inf (on this device; no communication)."""
  if not leaves:
    return jnp.zeros((), jnp.bool_)
  return jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


def any_nonfinite(leaves: Sequence[jax.Array], axes: Sequence[str]) -> jax.Array:
  """Replicated bool: some device holds a NaN or Inf. One 4-byte ``pmax`` over ``axes``."""
  return jax.lax.pmax(has_nonfinite(leaves).astype(jnp.int32), tuple(axes)) > 0


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner: the wrapped transformation's state, unchanged by skipped steps.
    skipped_steps: int32, steps skipped so far (the same on every device).
  """
  inner: Any
  skipped_steps: jax.Array


def skip_nonfinite(inner: optax.GradientTransformation,
                   axes: Sequence[str]) -> optax.GradientTransformation:
  """Runs ``inner`` (a whole chain) and discards the step everywhere if any gradient was bad.

  ``compressed_allreduce(nonfinite='skip')`` protects only its own state: the optimizer after
  it still sees a zero gradient, and Adam's momentum moves the parameters anyway. Wrapping the
  whole chain makes a skipped step a true no-op: every device agrees (one 4-byte ``pmax`` over
  ``axes``) whether any of them received a NaN or Inf, and if so all return zero updates and
  the chain's state exactly as it was. Inside, use ``compressed_allreduce(...,
  nonfinite='propagate')`` so the agreement is not paid twice.

  Args:
    inner: the transformation to protect, e.g. ``optax.chain(compressed_allreduce(...),
      optax.adamw(...))``.
    axes: every mesh axis of the enclosing ``shard_map``.

  Returns:
    An ``optax.GradientTransformation`` with :class:`SkipNonFiniteState`.
  """
  axes = tuple(axes)
  if not axes or not all(isinstance(axis, str) and axis for axis in axes):
    raise TypeError(f"axes must be a non-empty sequence of mesh axis names, got {axes!r}.")

  def init(params) -> SkipNonFiniteState:
    return SkipNonFiniteState(inner=inner.init(params), skipped_steps=jnp.zeros((), jnp.int32))

  def update(grads, state: SkipNonFiniteState, params=None):
    require_axes(axes, "skip_nonfinite.update")
    skip = any_nonfinite(jax.tree.leaves(grads), axes)
    updates, inner_state = inner.update(grads, state.inner, params)
    keep_if_skipped = lambda new, old: jnp.where(skip, old, new)
    return (jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), updates),
            SkipNonFiniteState(inner=jax.tree.map(keep_if_skipped, inner_state, state.inner),
                               skipped_steps=state.skipped_steps + skip.astype(jnp.int32)))

  return optax.GradientTransformation(init, update)
