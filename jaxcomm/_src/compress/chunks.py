"""Per-chunk scales: a flat array split into fixed-width chunks, the last one partial."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import backends


def chunk_count(size: int, chunk: int | None) -> int:
  """Number of chunks: 1 for a whole tensor (``chunk=None``), else ``ceil(size / chunk)``."""
  if chunk is None or size == 0:
    return 1
  return -(-size // chunk)


def chunk_width(size: int, chunk: int | None) -> int:
  return max(size, 1) if chunk is None else chunk


def to_chunks(flat: jax.Array, chunk: int | None) -> jax.Array:
  """Zero-pads ``flat`` (shape ``(d,)``) and reshapes it to ``(chunks, width)``."""
  size = flat.shape[0]
  count, width = chunk_count(size, chunk), chunk_width(size, chunk)
  return jnp.pad(flat, (0, count * width - size)).reshape(count, width)


def max_abs(flat: jax.Array, chunk: int | None) -> jax.Array:
  """``max |x|`` of each chunk of ``flat`` (shape ``(d,)``), float32 of shape ``(chunks,)``.

  Per chunk it is ``|max(max x, -min x)|``: XLA's CPU backend reduces the rows of an array
  at memory speed, but for ``max |x|`` row by row it first writes ``|x|`` to a temporary (at
  16M float32 elements in chunks of 4096: 36 ms of CPU time, against 4 ms). The outer ``abs``
  makes a chunk of signed zeros +0.0, as ``max |x|`` is; a NaN still propagates. One chunk
  is one reduction of ``|x|``, which XLA fuses (two reductions would read ``x`` twice).
  """
  if chunk_count(flat.shape[0], chunk) == 1:
    return jnp.max(jnp.abs(flat), initial=0.0).reshape(1)
  rows = to_chunks(flat, chunk)
  return jnp.abs(jnp.maximum(jnp.max(rows, axis=1), -jnp.min(rows, axis=1)))


# Elements per step of :func:`l2_norms`' CPU loop (whole chunks of about 2^18 elements, in cache).
NORM_STEP = 1 << 18


def l2_norms(flat: jax.Array, chunk: int | None) -> jax.Array:
  """``||x||_2`` of each chunk of ``flat`` (shape ``(d,)``), float32 of shape ``(chunks,)``.

  On the CPU, several chunks are reduced in a loop over steps of about 2^18 elements
  (``jax.lax.map``): as one row reduction of the whole ``(chunks, width)`` array, the sum of
  squares ran on XLA's CPU backend at about 0.4 GB/s (16M float32 elements in chunks of 512:
  40 ms of CPU, against 5 ms in steps). Elsewhere the loop's ``d / 2^18`` sequential steps
  are each a kernel launch (1,024 at 256M elements), so other backends take the row reduction
  (:func:`row_l2_norms`, chosen by :func:`~jaxcomm._src.compress.backends.by_platform`).
  The two are bit-identical on the CPU (tested).
  """
  rows = to_chunks(flat, chunk)
  if rows.shape[0] == 1:
    return jnp.linalg.norm(rows, axis=1)
  return backends.by_platform(_stepped_l2_norms, row_l2_norms, rows)


def row_l2_norms(rows: jax.Array) -> jax.Array:
  """``||row||_2`` of each row of ``rows`` (shape ``(chunks, width)``) in one reduction: the
  accelerators' :func:`l2_norms`."""
  return jnp.linalg.norm(rows, axis=1)


def _stepped_l2_norms(rows: jax.Array) -> jax.Array:
  """:func:`row_l2_norms` in a loop over steps of ``NORM_STEP`` elements: the CPU's."""
  rows_per_step = max(1, NORM_STEP // rows.shape[1])
  return jax.lax.map(jnp.linalg.norm, rows, batch_size=rows_per_step)


def chunk_sizes(size: int, chunk: int | None) -> jax.Array:
  """Real (unpadded) element count of each chunk, as float32 of shape ``(chunks,)``."""
  count, width = chunk_count(size, chunk), chunk_width(size, chunk)
  sizes = jnp.full((count,), width, jnp.float32)
  return sizes.at[-1].set(size - width * (count - 1))


def per_element(per_chunk: jax.Array, size: int, chunk: int | None) -> jax.Array:
  """Broadcasts one value per chunk back to shape ``(size,)``."""
  width = chunk_width(size, chunk)
  # A broadcast, not jnp.repeat: repeat builds its gather indices with a cumsum that XLA
  # constant-folds at compile time, which takes seconds for million-element tensors.
  count = per_chunk.shape[0]
  return jnp.broadcast_to(per_chunk[:, None], (count, width)).reshape(-1)[:size]
