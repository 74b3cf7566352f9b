"""The manual mesh axes inside ``jax.shard_map``: which they are, checks that a caller runs
over the axes it names, this device's position over them, and varying-axes typing (marking
values as varying with ``jax.lax.pcast``, no data moves; finding leaves already reduced).

One home for the varying-axes logic of the collectives, the optimizers and the gradient
helpers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

CALL_HINT = (
    "Call it inside jax.shard_map over a mesh with these axes, e.g. "
    "jax.shard_map(step, mesh=jaxcomm.make_mesh(hosts=2, local=4), in_specs=..., out_specs=...).")


def manual_axes(caller: str) -> tuple[str, ...]:
  """The mesh axes of the enclosing ``shard_map``.

  Raises:
    ValueError: naming ``caller``, outside ``shard_map`` (no manual axis).
  """
  axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
  if not axes:
    raise ValueError(f"{caller} must be called inside jax.shard_map (no mesh axes are manual "
                     "here).")
  return axes


def require_axes(axes: Sequence[str], caller: str) -> None:
  """Raises ``ValueError`` naming every axis in ``axes`` that is not a manual axis here."""
  manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
  missing = [axis for axis in axes if axis not in manual]
  if missing:
    where = (f"the enclosing shard_map has axes {manual}" if manual
             else "it was called outside jax.shard_map")
    raise ValueError(f"{caller}: mesh axis {missing[0]!r} is not available ({where}). "
                     + CALL_HINT)


def device_index(axes: Sequence[str]) -> jax.Array:
  """This device's linear position over ``axes`` (row-major, first axis slowest)."""
  return jax.lax.axis_index(tuple(axes))


def device_count(axes: Sequence[str]) -> int:
  """The number of devices over ``axes`` (the product of their sizes)."""
  count = 1
  for axis in axes:
    count *= jax.lax.axis_size(axis)
  return count


def vary(x, axes: Sequence[str]):
  """Marks ``x`` varying over those of ``axes`` it is invariant over (no data moves)."""
  missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_tree(tree, axes: Sequence[str]):
  """:func:`vary` on every leaf of ``tree``."""
  return jax.tree.map(lambda leaf: vary(leaf, axes), tree)


def vma_checked(axes: Sequence[str]) -> bool:
  """Whether the enclosing shard_map tracks varying axes (``check_vma=True``)."""
  probe = jax.lax.pcast(jnp.zeros((), jnp.float32), tuple(axes), to="varying")
  return bool(jax.typeof(probe).mat.varying)


def first_invariant(tree, axes: Sequence[str]) -> tuple[str, str] | None:
  """``(leaf path, axis)`` of the first leaf of ``tree`` that is invariant over one of
  ``axes`` (replicated there), or ``None``; always ``None`` without varying-axes typing."""
  if not vma_checked(axes):
    return None
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    invariant = [axis for axis in axes if axis not in jax.typeof(leaf).mat.varying]
    if invariant:
      return jax.tree_util.keystr(path), invariant[0]
  return None


def require_varying(tree, axes: Sequence[str], caller: str) -> None:
  """Raises if a leaf of ``tree`` is invariant over one of ``axes`` (already reduced).

  Inside ``shard_map`` with ``check_vma=True``, ``jax.grad`` with respect to a replicated
  (``P()``) argument inserts a full-precision ``psum`` of the gradient over every mesh axis.
  Such gradients are already summed: compressing them again saves nothing and would scale
  them by the device count.
  """
  found = first_invariant(tree, axes)
  if found:
    path, axis = found
    raise ValueError(
        f"{caller}: gradient leaf {path or '<root>'} is not varying "
        f"over mesh axis {axis!r}: it was already reduced over it, which is what "
        "jax.grad does to gradients of replicated parameters inside shard_map. Take "
        "per-device gradients with jaxcomm.optim.local_grad(loss_fn)(params, batch) (or "
        f"differentiate jax.lax.pcast(params, {tuple(axes)!r}, to='varying')).")
