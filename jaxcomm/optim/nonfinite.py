"""The non-finite policy: what a NaN or Inf in a gradient does to a step.

One home for the policy of the optimizers: detecting a non-finite value (on this device, or
agreed by all with one 4-byte ``pmax``), the three modes (``'skip'`` the whole step on every
device, ``'zero'`` the bad entries, ``'propagate'``), and keeping state as it was on a
skipped step. (Compressors detect with :func:`jaxcomm.compress.base.all_finite`: ``compress/``
sits below this package.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.collectives.axes import require_axes


NONFINITE_MODES = ("skip", "zero", "propagate")


def check_nonfinite_mode(value: str) -> str:
  """Validates a ``nonfinite=`` argument against :data:`NONFINITE_MODES`."""
  if value not in NONFINITE_MODES:
    raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}; got {value!r}.")
  return value


def has_nonfinite(leaves: Sequence[jax.Array]) -> jax.Array:
  """Bool scalar: some leaf holds a NaN or Inf (on this device; no communication)."""
  if not leaves:
    return jnp.zeros((), jnp.bool_)
  return jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


def any_nonfinite(leaves: Sequence[jax.Array], axes: Sequence[str]) -> jax.Array:
  """Replicated bool: some device holds a NaN or Inf. One 4-byte ``pmax`` over ``axes``."""
  return jax.lax.pmax(has_nonfinite(leaves).astype(jnp.int32), tuple(axes)) > 0


def zero_nonfinite(tree):
  """``tree`` with every NaN and Inf entry replaced by 0 (elementwise, no communication)."""
  return jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)), tree)


def keep_if(keep: jax.Array, old, new):
  """``old`` where the bool scalar ``keep`` holds, else ``new``, leaf by leaf (two pytrees of
  one structure): the state a skipped step leaves behind."""
  return jax.tree.map(lambda o, n: jnp.where(keep, o, n), old, new)


def zero_if(skip: jax.Array, updates):
  """Zero updates where the bool scalar ``skip`` holds: a skipped step moves nothing."""
  return jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), updates)


def with_nonfinite_policy(inner: optax.GradientTransformation, mode: str,
                          axes: Sequence[str]) -> optax.GradientTransformation:
  """``inner`` under a non-finite mode: ``'skip'`` wraps it in :func:`skip_nonfinite` (one
  4-byte ``pmax`` over ``axes``), ``'zero'`` zeroes non-finite gradient entries first (no
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
    return zero_if(skip, updates), SkipNonFiniteState(
        inner=keep_if(skip, state.inner, inner_state),
        skipped_steps=state.skipped_steps + skip.astype(jnp.int32))

  return optax.GradientTransformation(init, update)
