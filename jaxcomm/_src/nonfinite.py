"""The non-finite policy: detecting a NaN or Inf and keeping state as it was.

One home for every layer (compressors, collectives, optimizers): detection on this device
(:func:`has_nonfinite`) or agreed by all devices with one 4-byte ``psum`` (:func:`agree`,
:func:`any_nonfinite`); the ``nonfinite=`` modes (``'skip'`` the whole step on every device,
``'zero'`` the bad entries, ``'propagate'``); keeping state as it was when its input was bad
(:func:`keep_if`, or entry by entry :func:`keep_finite`). The optax wrappers built on it live
in :mod:`jaxcomm.optim.nonfinite`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

NONFINITE_MODES = ("skip", "zero", "propagate")


def check_nonfinite_mode(value: str) -> str:
  """Validates a ``nonfinite=`` argument against :data:`NONFINITE_MODES`."""
  if value not in NONFINITE_MODES:
    raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_MODES)}; got {value!r}.")
  return value


def has_nonfinite(tree) -> jax.Array:
  """Bool scalar: some leaf of ``tree`` holds a NaN or Inf (on this device; no
  communication). ``False`` for an empty tree.

  Each floating-point leaf costs one sum of ``x - x``: 0 for a finite entry and NaN for a NaN
  or an Inf, so the sum is NaN exactly when some entry is not finite. XLA's CPU backend runs
  it as one fused reduction, where ``jnp.any(~jnp.isfinite(x))`` ran as three to four kernels
  (a materialized bool mask, then a tree of reduce-windows). Not ``sum(x * 0)``: for a
  computed ``x`` its XNNPACK fusion materialized the zero as an array of ``x``'s size (a 64
  MiB temporary at 16M float32 elements: ``ef(int8(nearest))``'s encode 60 -> 28 ms of CPU).
  Integer and bool leaves are always finite.
  """
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
  checks = [jnp.isnan(jnp.sum(x - x)) for x in leaves if _inexact(x)]
  return functools.reduce(jnp.logical_or, checks, jnp.zeros((), jnp.bool_))


def any_nonfinite(tree, axes: Sequence[str]) -> jax.Array:
  """Replicated bool: some device's ``tree`` holds a NaN or Inf (:func:`has_nonfinite` on
  each device, then :func:`agree`)."""
  return agree(has_nonfinite(tree), axes)


def agree(flag: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Replicated bool: the bool scalar ``flag`` holds on some device. One 4-byte ``psum``
  over ``axes`` (``2 (N-1)/N * 4`` bytes per device for ``N`` devices) of a float32 0 or 1.

  A sum, not a max, and over ``axes`` in the mesh's order: then XLA combines it with the
  train step's loss ``pmean`` (:func:`jaxcomm.optim.data_parallel_step`) into one all-reduce,
  one rendezvous of every device instead of two, which on simulated CPU devices made the
  char LM's 2x4 step 9% faster in wall time (docs/collectives.md, session 11).
  """
  names = jax.sharding.get_abstract_mesh().axis_names
  axes = tuple(sorted(axes, key=lambda axis: names.index(axis) if axis in names else len(names)))
  return jax.lax.psum(flag.astype(jnp.float32), axes) > 0


def zero_nonfinite(tree):
  """``tree`` with every NaN and Inf entry replaced by 0 (elementwise, no communication)."""
  return jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x)), tree)


def zero_if(skip: jax.Array, tree):
  """Zeroes every leaf of ``tree`` where the bool scalar ``skip`` holds: a skipped step
  moves nothing."""
  return jax.tree.map(lambda x: jnp.where(skip, jnp.zeros_like(x), x), tree)


def _inexact(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def keep_if(keep: jax.Array, old, new, *, floats_only: bool = False):
  """``old`` where the bool scalar ``keep`` holds, else ``new``, leaf by leaf (two pytrees of
  one structure): the state a step with bad input leaves behind.

  With ``floats_only`` integer leaves (PRNG keys, counters) take ``new`` anyway, so that
  state shared with other devices (a shared random-k key) stays in step with theirs.
  """
  def choose(o, n):
    return n if floats_only and not _inexact(n) else jnp.where(keep, o, n)
  return jax.tree.map(choose, old, new)


def keep_finite(new, old):
  """``new`` with every non-finite floating-point entry replaced by its value in ``old``
  (entry by entry; integer leaves are ``new``'s): state computed from other devices' data,
  such as a two-phase server residual that received a NaN, never turns non-finite."""
  return jax.tree.map(lambda n, o: jnp.where(jnp.isfinite(n), n, o) if _inexact(n) else n,
                      new, old)
