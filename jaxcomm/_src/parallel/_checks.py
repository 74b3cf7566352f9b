"""Argument checks shared by the attention entry points: fail early, name the parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm._src.mesh_axes import vary


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  """Checks ``(batch, seq, heads, head_dim)`` self-attention inputs with GQA-compatible heads.

  Raises:
    ValueError: a wrong rank, ``k``/``v`` shapes that differ, batch/sequence/head-dim that do
      not match ``q``, or query heads that are not a multiple of key/value heads.
    TypeError: inputs that are not floating point or do not share one dtype.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.ndim(x) != 4:
      raise ValueError(
          f"{name} must have shape (batch, seq, heads, head_dim); got {name}.shape="
          f"{jnp.shape(x)}.")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got k.shape={k.shape}, "
                     f"v.shape={v.shape}.")
  for axis, what in ((0, "batch"), (1, "sequence"), (3, "head_dim")):
    if q.shape[axis] != k.shape[axis]:
      raise ValueError(f"q and k must agree on {what} (axis {axis}); got q.shape={q.shape}, "
                       f"k.shape={k.shape}.")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"q heads must be a multiple of k/v heads (grouped-query attention); "
                     f"got q.shape[2]={q.shape[2]}, k.shape[2]={k.shape[2]}.")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype; got q.dtype={q.dtype}, "
                    f"k.dtype={k.dtype}, v.dtype={v.dtype}.")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q, k and v must be floating point; got dtype {q.dtype}.")


def bound_axis_size(axis_name: str, parameter: str = "axis_name") -> int:
  """Size of a mesh axis bound by the enclosing ``jax.shard_map``.

  Raises:
    ValueError: naming ``parameter`` when the axis is not bound (missing from the mesh, or the
      call is not inside ``shard_map`` at all).
  """
  if not isinstance(axis_name, str):
    raise TypeError(f"{parameter} must be a mesh axis name (str); got {axis_name!r}.")
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    bound = jax.sharding.get_abstract_mesh().axis_names
    raise ValueError(
        f"{parameter}={axis_name!r} is not an axis of the enclosing jax.shard_map mesh "
        f"(axes here: {bound}); call this inside shard_map over a mesh with that axis."
    ) from None


def match_varying(*arrays: jax.Array, axis_names: tuple[str, ...]) -> tuple[jax.Array, ...]:
  """Casts arrays to vary over the union of their varying axes and ``axis_names``.

  Loops and ``lax.switch`` branches inside shard_map need every carried value to vary over the
  same axes; an input that is replicated over, say, the data axis would otherwise not match.
  """
  target = set(axis_names)
  for x in arrays:
    target |= jax.typeof(x).mat.varying
  return tuple(vary(x, sorted(target)) for x in arrays)
