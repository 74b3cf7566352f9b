"""Per-device gradients inside ``jax.shard_map``, before any reduction."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxcomm._src.mesh_axes import manual_axes, vary_tree


def _as_device_local(params):
  """Marks replicated parameters as varying so that ``jax.grad`` does not ``psum`` their
  cotangents: inside ``shard_map`` the transpose of the implicit invariant-to-varying cast is
  a full-precision all-reduce over every mesh axis."""
  return vary_tree(params, manual_axes("jaxcomm.optim.local_grad"))


def local_value_and_grad(fun: Callable, *, has_aux: bool = False) -> Callable:
  """Like ``jax.value_and_grad(fun)`` w.r.t. the first argument, without the implicit psum.

  Inside ``jax.shard_map``, ``jax.grad`` of a loss w.r.t. replicated parameters all-reduces the
  gradient at full precision over every mesh axis: the very communication jaxcomm replaces.
  This returns each device's own gradient instead, to hand to
  :func:`jaxcomm.compressed_allreduce`. The value is this device's loss.

  Args:
    fun: ``fun(params, *args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``).
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    ``f(params, *args) -> (value, grads)``.
  """
  value_and_grad = jax.value_and_grad(fun, has_aux=has_aux)

  def wrapped(params, *args, **kwargs):
    return value_and_grad(_as_device_local(params), *args, **kwargs)

  return wrapped


def local_grad(fun: Callable, *, has_aux: bool = False) -> Callable:
  """Like ``jax.grad(fun)`` w.r.t. the first argument, without the implicit psum.

  See :func:`local_value_and_grad`.

  Returns:
    ``f(params, *args) -> grads`` (``(grads, aux)`` with ``has_aux``).
  """
  grad = jax.grad(fun, has_aux=has_aux)

  def wrapped(params, *args, **kwargs):
    return grad(_as_device_local(params), *args, **kwargs)

  return wrapped
