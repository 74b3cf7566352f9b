"""The manual mesh axes inside ``jax.shard_map``: which they are, this device's position over
them, and marking values as varying over them (``jax.lax.pcast``; no data moves).

One home for the varying-axes logic of the optimizers and the gradient helpers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax


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
