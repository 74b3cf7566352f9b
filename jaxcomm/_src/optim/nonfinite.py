"""The non-finite modes as optax transformations: skipping a whole chain's step, or zeroing
bad gradient entries before it. Detection and keeping state are :mod:`jaxcomm._src.nonfinite`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.mesh_axes import require_axes
from jaxcomm._src.nonfinite import (any_nonfinite, check_nonfinite_mode, keep_if, zero_if,
                                    zero_nonfinite)
from jaxcomm._src.optim import hsdp


def with_nonfinite_policy(inner: optax.GradientTransformation, mode: str,
                          axes: Sequence[str]) -> optax.GradientTransformation:
  """``inner`` under a non-finite mode: ``'skip'`` wraps it in :func:`skip_nonfinite` (one
  4-byte ``psum`` over ``axes``), ``'zero'`` zeroes non-finite gradient entries first (no
  communication), ``'propagate'`` returns it as it is."""
  mode = check_nonfinite_mode(mode)
  if mode == "skip":
    return skip_nonfinite(inner, axes)
  if mode == "zero":
    return optax.chain(optax.stateless(lambda grads, params: zero_nonfinite(grads)), inner)
  return inner


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
  whole chain makes a skipped step a true no-op: every device agrees (one 4-byte ``psum`` over
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

  inner = hsdp.user_optimizer(inner, "skip_nonfinite.inner")

  def init(params) -> SkipNonFiniteState:
    return SkipNonFiniteState(inner=inner.init(params), skipped_steps=jnp.zeros((), jnp.int32))

  def update(grads, state: SkipNonFiniteState, params=None):
    require_axes(axes, "skip_nonfinite.update")
    skip = any_nonfinite(jax.tree.leaves(grads), axes)
    updates, inner_state = inner.update(grads, state.inner, params)
    return zero_if(skip, updates), SkipNonFiniteState(
        inner=keep_if(skip, state.inner, inner_state),
        skipped_steps=state.skipped_steps + skip.astype(jnp.int32))

  return hsdp.shard_aware(optax.GradientTransformation(init, update))
