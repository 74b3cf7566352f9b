"""Count sketch: a linear sketch of the gradient, with heavy-hitter recovery."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor, num_elements
from jaxcomm._src.validation import check_fraction, check_int_range
from jaxcomm._src.compress.hashing import hash_bits
from jaxcomm._src.keys import check_seed, raw_key
from jaxcomm._src.compress.select import largest_k


class CountSketchState(NamedTuple):
  """State of a count sketch.

  Attributes:
    key: uint32 of shape ``(2,)``: the raw PRNG key of the next call's hashes, made from
      ``seed`` and the tensor size by ``init`` and split by every ``encode``: the same on every
      device, new at every step. (Kept as data rather than recomputed from the seed so that
      XLA does not constant-fold the hashing of millions of elements at compile time.)
  """
  key: jax.Array


class CountSketchPayload(NamedTuple):
  """The wire format of a count sketch.

  Attributes:
    table: float32 of shape ``(depth, width)``: ``S[j, h_j(i)] += s_j(i) x_i``.
    key: uint32 of shape ``(2,)``: the key the hashes were drawn from, identical on every
      device, so a ``psum`` keeps it (see ``REPLICATED``) and sums the tables.
  """
  table: jax.Array
  key: jax.Array
  REPLICATED = ("key",)


CHUNK = 1 << 16


def sketch_hashes(key: jax.Array, offset: int | jax.Array, count: int,
                  width: int) -> tuple[jax.Array, jax.Array]:
  """Buckets (int32) and signs (float32 +-1), both ``(count,)``, of hash indices
  ``offset, ..., offset + count - 1``; row ``j``'s hash of element ``i`` has index
  ``j * d + i``.

  One random 32-bit word per index, hashed from the shared key
  (:mod:`~jaxcomm.compress.hashing`): the low bit is the sign, the top 24 bits ``m`` give the
  bucket ``floor(m * width / 2^24)`` (buckets get ``floor`` or ``ceil`` of ``2^24 / width``
  of the values of ``m``: a relative bias below ``width / 2^24``), by a float multiplication
  rather than an integer modulo, which XLA's CPU backend does not vectorize. Every device
  computes the same ones, which is what makes sketches summable.
  """
  words = hash_bits(key, (count,), offset)
  scaled = (words >> 8).astype(jnp.float32) * jnp.float32(width / 2.0**24)
  buckets = jnp.minimum(scaled.astype(jnp.int32), width - 1)
  signs = jnp.where((words & 1) == 1, 1.0, -1.0)
  return buckets, signs


def _chunked(size: int) -> tuple[int, int]:
  """``(chunks, elements per chunk)`` of the loops over the input."""
  chunk = min(CHUNK, max(size, 1))
  return -(-size // chunk), chunk


def median_of_rows(rows) -> jax.Array:
  """Median over axis 0 of a ``(depth, n)`` array (or a list of ``depth`` arrays of shape
  ``(n,)``), by a sorting network of min/max.

  ``depth`` is small, so ``depth^2 / 2`` elementwise compare-exchanges are far cheaper than a
  sort along a length-``depth`` axis (XLA's CPU sort is slow for that layout).
  """
  ordered = list(rows)
  for sweep in range(len(ordered)):
    for index in range(len(ordered) - 1 - sweep):
      low = jnp.minimum(ordered[index], ordered[index + 1])
      high = jnp.maximum(ordered[index], ordered[index + 1])
      ordered[index], ordered[index + 1] = low, high
  middle = len(ordered) // 2
  if len(ordered) % 2:
    return ordered[middle]
  return 0.5 * (ordered[middle - 1] + ordered[middle])


def count_sketch(width: int, depth: int = 5, *, heavy: float | None = None,
                 seed: int | jax.Array = 0) -> Compressor:
  """Count sketch with ``depth`` rows of ``width`` buckets; hashes from a shared seed, drawn
  anew at every call.

  Encode: ``S[j, h_j(i)] += s_j(i) x_i`` for every row ``j``. Decode: the estimate
  ``x^_i = median_j s_j(i) S[j, h_j(i)]``; with ``heavy``, only the ``max(1, floor(heavy * d))``
  largest estimates are kept (heavy-hitter recovery, as in Sketched-SGD and FetchSGD) and the
  others are 0.

  Properties: linear: ``sketch(x1 + x2) = sketch(x1) + sketch(x2)`` for one call's hashes,
  so the devices' sketches are ``psum``-ed and decoded once (decode itself is linear only for
  ``depth = 1`` without ``heavy``). The hashes come from the state's key, split at every call:
  the same on every device, new at every step, so one step's error is not repeated at the
  next (with fixed hashes every decoded step of one row lies in the same ``width``-dimensional
  subspace). One row without ``heavy`` is unbiased over the hash draw, with error variance up
  to ``||x||_2^2 / width`` per element: more than ``||x||^2`` in all unless ``width >= d``,
  so it is not contractive and is flagged ``unbiased=False`` (error feedback in front of it
  would grow without bound); the median and the selection are biased. With
  ``width >= 3 / eps^2`` the median errs by more than ``eps ||x||_2`` with probability at most
  ``exp(-depth / 18)`` per element.

  Bytes: ``4 * depth * width + 8``, independent of ``d``.

  Args:
    width: buckets per row, >= 1.
    depth: rows, >= 1 (odd depths make the median a single row's estimate).
    heavy: fraction of elements recovered as heavy hitters, in (0, 1]; ``None`` decodes all
      estimates.
    seed: int seed or PRNG key (typed ``jax.random.key`` of the default implementation,
      or legacy ``PRNGKey``) of the hashes; the same on every device.

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`CountSketchPayload` payloads and
    :class:`CountSketchState` state.

  References:
    Charikar, Chen & Farach-Colton, "Finding Frequent Items in Data Streams", ICALP 2002;
    Ivkin et al., "Communication-efficient Distributed SGD with Sketching", NeurIPS 2019;
    Rothchild et al., "FetchSGD: Communication-Efficient Federated Learning with
    Sketching", ICML 2020.
  """
  width = check_int_range("width", width, 1)
  depth = check_int_range("depth", depth, 1)
  if heavy is not None:
    heavy = check_fraction("heavy", heavy)
  seed = check_seed("seed", seed, raw=True)

  def init(shape, dtype) -> CountSketchState:
    del dtype
    # Folding in the size gives tensors of different sizes different hashes.
    return CountSketchState(jax.random.fold_in(raw_key(seed), num_elements(shape)))

  # Encode and decode loop over chunks of CHUNK elements (`jax.lax.scan`): all `depth` rows
  # of hashes for the whole input at once are `depth` d-sized temporaries, which XLA's CPU
  # runtime allocates (and page-faults) afresh on every call; per chunk they stay in cache.
  def encode(x: jax.Array, state: CountSketchState, key: jax.Array):
    del key
    next_key, hash_key = jax.random.split(state.key)
    flat = x.reshape(-1).astype(jnp.float32)
    size = flat.shape[0]
    count, chunk = _chunked(size)
    values = jnp.pad(flat, (0, count * chunk - size)).reshape(count, chunk)

    def add_chunk(table, item):
      start, chunk_values = item
      rows = []
      for row in range(depth):
        buckets, signs = sketch_hashes(hash_key, row * size + start, chunk, width)
        rows.append(table[row].at[buckets].add(signs * chunk_values))
      return jnp.stack(rows), None

    starts = jnp.arange(count, dtype=jnp.int32) * chunk
    # zeros_like keeps the input's varying mesh axes (inside shard_map), as the carry must.
    table, _ = jax.lax.scan(add_chunk, jnp.zeros_like(flat, shape=(depth, width)),
                            (starts, values))
    return CountSketchPayload(table, hash_key), CountSketchState(next_key)

  def decode(payload: CountSketchPayload, shape) -> jax.Array:
    size = num_elements(shape)
    count, chunk = _chunked(size)

    def estimate_chunk(start):
      rows = []
      for row in range(depth):
        buckets, signs = sketch_hashes(payload.key, row * size + start, chunk, width)
        rows.append(signs * payload.table[row][buckets])
      return median_of_rows(rows)

    starts = jnp.arange(count, dtype=jnp.int32) * chunk
    estimates = jax.lax.map(estimate_chunk, starts).reshape(-1)[:size]
    if heavy is not None:
      kept = min(size, max(1, math.floor(heavy * size)))
      indices = largest_k(estimates, kept, by_magnitude=True)
      estimates = jnp.zeros(size, jnp.float32).at[indices].set(estimates[indices])
    return estimates.reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del shape, dtype
    return 4 * depth * width + 8

  suffix = "" if heavy is None else f", heavy={heavy:g}"
  return Compressor(init=init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=True, unbiased=False, name=f"count_sketch({width}x{depth}{suffix})")
