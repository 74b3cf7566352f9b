"""Gradient leaves packed into flat buckets, so a step issues few large collectives.

Every collective pays a latency (``alpha`` in the cost model) and, on some backends, a fixed
launch cost; a model with hundreds of small leaves pays it hundreds of times per step.
Bucketing concatenates consecutive leaves of the same dtype (and the same compressor) into
flat buffers of at most ``bucket_bytes`` (a larger leaf gets a bucket of its own).

Buckets are filled from the last leaf backwards and returned in that order: backpropagation
produces the gradients of the last layers first, so (for a pytree whose leaves are in layer
order) the first bucket's collectives depend only on the gradients computed first, and XLA's
scheduler can start them while the rest of the backward pass runs (PyTorch DDP's reverse
bucket order; Li et al., "PyTorch Distributed", VLDB 2020).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Bucket(NamedTuple):
  """Which leaves one flat buffer holds.

  Attributes:
    leaves: indices of the leaves (in ``jax.tree.leaves`` order), in buffer order.
    shapes: their shapes.
    dtype: their common dtype, the buffer's dtype.
    group: the grouping key the leaves share (e.g. their compressor's index in a policy).
  """
  leaves: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtype: Any
  group: Hashable

  @property
  def size(self) -> int:
    """Elements in the buffer."""
    return int(sum(np.prod(shape, dtype=np.int64) for shape in self.shapes))


def check_bucket_bytes(bucket_bytes: int | None) -> int | None:
  if bucket_bytes is None:
    return None
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)):
    raise TypeError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}.")
  if bucket_bytes <= 0:
    raise ValueError(f"bucket_bytes must be > 0 (or None for one bucket per leaf), got "
                     f"{bucket_bytes}.")
  return int(bucket_bytes)


def plan_buckets(leaves: Sequence[Any], bucket_bytes: int | None,
                 groups: Sequence[Hashable] | None = None) -> tuple[Bucket, ...]:
  """Assigns leaves to buckets in the order their gradients become ready.

  Args:
    leaves: arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read), in layer
      order (``jax.tree.leaves`` of the parameters).
    bucket_bytes: maximum bytes of a bucket; ``None`` puts every leaf in its own bucket, in
      leaf order.
    groups: optional key per leaf; only leaves with equal keys (and dtypes) share a bucket.

  Returns:
    The buckets, every leaf in exactly one. With ``bucket_bytes``, buckets are filled from
    the last leaf backwards and returned in that order (the last leaves' bucket first); the
    leaves inside a bucket keep their relative order.
  """
  bucket_bytes = check_bucket_bytes(bucket_bytes)
  groups = [None] * len(leaves) if groups is None else list(groups)
  if bucket_bytes is None:
    return tuple(Bucket((index,), (tuple(leaf.shape),), jnp.dtype(leaf.dtype), group)
                 for index, (leaf, group) in enumerate(zip(leaves, groups)))
  buckets: list[Bucket] = []
  open_buckets: dict[tuple, list[int]] = {}
  open_bytes: dict[tuple, int] = {}

  def close(key):
    indices = open_buckets.pop(key)[::-1]
    open_bytes.pop(key)
    buckets.append(Bucket(tuple(indices), tuple(tuple(leaves[i].shape) for i in indices),
                          jnp.dtype(leaves[indices[0]].dtype), key[1]))

  for index in reversed(range(len(leaves))):
    leaf, group = leaves[index], groups[index]
    nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    key = (jnp.dtype(leaf.dtype).name, group)
    if key in open_buckets and open_bytes[key] + nbytes > bucket_bytes:
      close(key)
    open_buckets.setdefault(key, []).append(index)
    open_bytes[key] = open_bytes.get(key, 0) + nbytes
  for key in list(open_buckets):
    close(key)
  return tuple(sorted(buckets, key=lambda b: -b.leaves[-1]))


def pack(leaves: Sequence[jax.Array], bucket: Bucket) -> jax.Array:
  """The bucket's flat buffer: its leaves flattened and concatenated, shape ``(size,)``."""
  return jnp.concatenate([leaves[i].reshape(-1) for i in bucket.leaves])


def unpack(buffer: jax.Array, bucket: Bucket) -> list[jax.Array]:
  """Splits a buffer back into the bucket's leaves (inverse of :func:`pack`)."""
  sizes = [int(np.prod(shape, dtype=np.int64)) for shape in bucket.shapes]
  pieces = jnp.split(buffer, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [buffer]
  return [piece.reshape(shape) for piece, shape in zip(pieces, bucket.shapes)]
