"""Count sketch: a linear sketch of the gradient, with heavy-hitter recovery."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import backends, select
from jaxcomm._src.compress.base import Compressor, num_elements
from jaxcomm._src.validation import check_fraction, check_int_range
from jaxcomm._src.compress.hashing import bits_at
from jaxcomm._src.keys import check_seed, raw_key


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


# Elements per step of the encode and decode loops (the block count rounds it up to whole
# blocks of `width`): per step the `depth` rows' signed and rotated blocks stay in cache.
STEP = 1 << 18
# Sketches of 3 to 8 rows over blocks of at least UNROLL_WIDTH elements rotate each block by
# a slice of its own per row, unrolled in the loop's body over steps of UNROLL blocks (16M
# elements in blocks of 16,384, 5 rows: encode 105 -> 29 ms of CPU; 4M in blocks of 512, 5
# rows: encode + decode 34 -> 14 ms), and so do other sketches whose input is a single step of
# UNROLL_SLICES slices (blocks times rows; 50,304 elements in blocks of 1,006, one row: 475 ->
# 240 us). The others rotate a step's blocks by one vmapped slice per row (a gather), which is
# faster over several steps for one or two rows (4M in blocks of 4,096, 2 rows: 11 against 14
# ms) and for narrow blocks. With fewer than about 16 slices per step, XLA's CPU backend fused
# the hashing into the rows' loop unvectorized (decode 5x slower).
UNROLL, UNROLL_DEPTHS, UNROLL_WIDTH, UNROLL_SLICES = 8, range(3, 9), 512, range(16, 65)


class SketchHashes(NamedTuple):
  """One call's hashes of a count sketch of ``depth`` rows over blocks of ``width`` elements.

  Attributes:
    signs: uint32 of shape ``(words, blocks, width)``: bit ``j % 32`` of word ``j // 32``
      at element ``(b, p)`` is row ``j``'s sign of element ``b width + p`` (set: ``+1``).
    shifts: int32 of shape ``(depth, blocks)``, in ``[0, width)``: row ``j`` adds block ``b``
      rotated by ``shifts[j, b]``, so element ``b width + p`` goes to bucket
      ``(p + shifts[j, b]) mod width``.
  """
  signs: jax.Array
  shifts: jax.Array


def sketch_hashes(key: jax.Array, first_block: int | jax.Array, blocks: int, total_blocks: int,
                  width: int, depth: int) -> SketchHashes:
  """:class:`SketchHashes` of ``blocks`` blocks from ``first_block`` (may be traced) of a
  sketch over ``total_blocks`` blocks; every device computes the same ones from the shared
  ``key`` (:mod:`~jaxcomm.compress.hashing`), which is what makes sketches summable.

  The signs of element ``i`` are the bits of the hashes of ``i + q total_blocks width``,
  ``q < ceil(depth / 32)``; the shifts, of the indices that follow those. A shift is the
  hash's top 24 bits ``m`` scaled, ``floor(m width / 2^24)``: each bucket gets ``floor`` or
  ``ceil`` of ``2^24 / width`` of the values of ``m`` (a relative bias below ``width / 2^24``).
  """
  return SketchHashes(_signs(key, first_block, blocks, total_blocks, width, depth),
                      _shifts(key, first_block, blocks, total_blocks, width, depth))


def _signs(key: jax.Array, first_block: int | jax.Array, blocks: int, total_blocks: int,
           width: int, depth: int) -> jax.Array:
  """The ``signs`` of :func:`sketch_hashes`: uint32 ``(ceil(depth / 32), blocks, width)``."""
  size = total_blocks * width
  element = (jnp.arange(blocks * width, dtype=jnp.uint32).reshape(blocks, width)
             + jnp.asarray(first_block).astype(jnp.uint32) * jnp.uint32(width))
  return jnp.stack([bits_at(key, element + jnp.uint32(q * size)) for q in range(-(-depth // 32))])


def _shifts(key: jax.Array, first_block: int | jax.Array, blocks: int, total_blocks: int,
            width: int, depth: int) -> jax.Array:
  """The ``shifts`` of :func:`sketch_hashes`: int32 ``(depth, blocks)``."""
  block = (jnp.arange(blocks, dtype=jnp.uint32)[None, :] + jnp.asarray(first_block).astype(
      jnp.uint32) + jnp.arange(depth, dtype=jnp.uint32)[:, None] * jnp.uint32(total_blocks))
  drawn = bits_at(key, block + jnp.uint32(-(-depth // 32) * total_blocks * width))
  scaled = (drawn >> 8).astype(jnp.float32) * jnp.float32(width / 2.0**24)
  return jnp.minimum(scaled.astype(jnp.int32), width - 1)


def _step_shifts(key: jax.Array, steps: int, per_step: int, total_blocks: int, width: int,
                 depth: int) -> jax.Array:
  """The shifts of all ``steps * per_step`` blocks, int32 ``(steps, depth, per_step)``, for
  the loops: computed once before them, as per-block scalars inside a fused loop over the
  elements XLA's CPU backend hashed them again for every element (16M, 2 rows in steps of 4
  blocks: decode 214 -> 92 ms of CPU)."""
  shifts = _shifts(key, 0, steps * per_step, total_blocks, width, depth)
  return shifts.reshape(depth, steps, per_step).transpose(1, 0, 2)


def _signed(words: jax.Array, row: int, values: jax.Array) -> jax.Array:
  """``values`` times row ``row``'s signs, given by the sign words ``words`` (the
  ``signs[row // 32]`` of :class:`SketchHashes`, of ``values``' shape)."""
  return jnp.where((words >> (row % 32)) & 1 == 1, values, -values)


def _doubled(blocks: jax.Array) -> jax.Array:
  """Each block (last axis, ``width``) followed by itself: a rotation by ``s`` of a block is
  the window of ``width`` elements of its doubled copy from ``s``, a contiguous slice."""
  return jnp.concatenate([blocks, blocks], axis=-1)


def _window(doubled: jax.Array, start: jax.Array, width: int) -> jax.Array:
  """``width`` elements of ``doubled`` (last axis) from ``start`` (traced, in ``[0, width]``)."""
  return jax.lax.dynamic_slice_in_dim(doubled, start, width, axis=-1)


def _rotate(blocks: jax.Array, shifts: jax.Array) -> jax.Array:
  """Each row of ``blocks`` (``(n, width)``, or one ``(width,)`` row for all) rotated left by
  its shift (``(n,)``, in ``[0, width)``): ``out[b, p] = blocks[b, (p + shifts[b]) mod width]``,
  a window of the doubled row for each (a gather)."""
  width = blocks.shape[-1]
  doubled = _doubled(blocks)
  if blocks.ndim == 1:
    return jax.vmap(lambda shift: _window(doubled, shift, width))(shifts)
  return jax.vmap(lambda row, shift: _window(row, shift, width))(doubled, shifts)


def _step_table(values: jax.Array, hashes: SketchHashes, unrolled: bool) -> jax.Array:
  """One step's table, float32 ``(depth, width)``, of its blocks ``values`` (``(blocks,
  width)``): row ``j`` adds block ``b``'s signed elements rotated right by ``shifts[j, b]``
  (bucket ``(p + shift) mod width`` of element ``p``), i.e. the window of the doubled block
  from ``width - shift``."""
  blocks, width = values.shape
  starts = (width - hashes.shifts) % width
  if not unrolled:
    return jnp.stack([jnp.sum(_rotate(_signed(hashes.signs[row // 32], row, values), start), 0)
                      for row, start in enumerate(starts)])
  if len(starts) == 1:
    # One row: the values are signed first and only they are doubled, so each window is one
    # slice. Windows of both the doubled values and the doubled sign words (below) made
    # XLA's CPU backend run the sum as one slow fusion: on charlm's shard (50 blocks, 2x4
    # mesh) the encode went from about 2.8 to 0.6 ms of kernel time per step, same bits.
    signed = _doubled(_signed(hashes.signs[0], 0, values))
    return sum(_window(signed[block], starts[0, block], width) for block in range(blocks))[None]
  # The values and sign words are doubled once per step, for all rows.
  doubled, signs = _doubled(values), _doubled(hashes.signs)
  return jnp.stack([sum(_signed(_window(signs[row // 32, block], start[block], width), row,
                                _window(doubled[block], start[block], width))
                        for block in range(blocks)) for row, start in enumerate(starts)])


def _step_estimates(table: jax.Array, hashes: SketchHashes, unrolled: bool) -> jax.Array:
  """One step's estimates, float32 ``(blocks, width)``, from the table (``(depth, width)``):
  element ``p`` of block ``b`` reads bucket ``(p + shifts[j, b]) mod width`` of row ``j``,
  signed; the median over the rows."""
  depth, width = table.shape
  blocks = hashes.shifts.shape[1]
  if not unrolled:
    return median_of_rows([_signed(hashes.signs[row // 32], row, _rotate(table[row], shifts))
                           for row, shifts in enumerate(hashes.shifts)])
  doubled = _doubled(table)
  return jnp.stack([median_of_rows([
      _signed(hashes.signs[row // 32, block], row,
              _window(doubled[row], hashes.shifts[row, block], width))
      for row in range(depth)]) for block in range(blocks)])


def _blocks(size: int, width: int, depth: int) -> tuple[int, int, int, bool]:
  """``(blocks, steps, blocks per step, unrolled)``: the ``ceil(size / width)`` blocks (at
  least one), the loops over them, and whether a step rotates its blocks by unrolled slices."""
  total = -(-max(size, 1) // width)
  if width >= UNROLL_WIDTH and depth in UNROLL_DEPTHS:
    return total, -(-total // UNROLL), min(total, UNROLL), True
  per_step = min(total, max(1, STEP // width))
  unrolled = width >= UNROLL_WIDTH and per_step == total and total * depth in UNROLL_SLICES
  return total, -(-total // per_step), per_step, unrolled


def _table_in_steps(flat: jax.Array, key: jax.Array, width: int, depth: int) -> jax.Array:
  """The table of ``flat`` (float32 ``(d,)``), float32 ``(depth, width)``, for the CPU: a loop
  (``jax.lax.scan``) over steps of whole blocks. All ``depth`` rows of signed blocks for the
  whole input at once are ``depth`` d-sized temporaries, which XLA's CPU runtime allocates (and
  page-faults) afresh on every call; per step they stay in cache."""
  size = flat.shape[0]
  total, steps, per_step, unrolled = _blocks(size, width, depth)
  values = jnp.pad(flat, (0, steps * per_step * width - size)).reshape(steps, per_step, width)

  def add_step(table, item):
    step, step_values, shifts = item
    signs = _signs(key, step * per_step, per_step, total, width, depth)
    return table + _step_table(step_values, SketchHashes(signs, shifts), unrolled), None

  # zeros_like keeps the input's varying mesh axes (inside shard_map), as the carry must.
  table, _ = jax.lax.scan(add_step, jnp.zeros_like(flat, shape=(depth, width)),
                          (jnp.arange(steps, dtype=jnp.int32), values,
                           _step_shifts(key, steps, per_step, total, width, depth)))
  return table


def _estimates_in_steps(table: jax.Array, key: jax.Array, size: int) -> jax.Array:
  """The estimates of ``size`` elements from ``table`` (``(depth, width)``), float32
  ``(size,)``, for the CPU: a loop (``jax.lax.map``) over steps of whole blocks."""
  depth, width = table.shape
  total, steps, per_step, unrolled = _blocks(size, width, depth)

  def estimate_step(item):
    step, shifts = item
    signs = _signs(key, step * per_step, per_step, total, width, depth)
    return _step_estimates(table, SketchHashes(signs, shifts), unrolled)

  estimates = jax.lax.map(estimate_step, (
      jnp.arange(steps, dtype=jnp.int32), _step_shifts(key, steps, per_step, total, width, depth)))
  return estimates.reshape(-1)[:size]


def _table_at_once(flat: jax.Array, key: jax.Array, width: int, depth: int) -> jax.Array:
  """The table of ``flat`` (float32 ``(d,)``), float32 ``(depth, width)``, for accelerators:
  all blocks at once, one reduction and no loop (on a GPU a loop over steps of blocks was
  launch-bound: 256M elements, 2,048 steps of a few small kernels each). The whole blocks are
  a view of the input and the last, partial one a separate small term: no padded copy."""
  size = flat.shape[0]
  total, full = -(-max(size, 1) // width), size // width
  shifts = _shifts(key, 0, total, total, width, depth)
  table = _rotated_sums(flat[:full * width].reshape(full, width), key, 0, shifts[:, :full],
                        total)
  if full < total:
    tail = jnp.pad(flat[full * width:], (0, total * width - size)).reshape(1, width)
    table = table + _rotated_sums(tail, key, full, shifts[:, full:], total)
  return table


def _rotated_sums(blocks: jax.Array, key: jax.Array, first_block: int, shifts: jax.Array,
                  total_blocks: int) -> jax.Array:
  """The table, float32 ``(depth, width)``, of ``blocks`` (``(n, width)``: blocks
  ``first_block`` on of a sketch over ``total_blocks``), given their ``shifts``
  (``(depth, n)``): bucket ``q`` of row ``j`` sums over the blocks ``b`` their element
  ``p = (q - shifts[j, b]) mod width``, gathered and signed by its hash (recomputed where it
  is read, not stored): a single reduction over the blocks, whose input (the gather and the
  hashing) XLA can fuse into it, as a GPU backend does with elementwise producers."""
  (count, width), depth = blocks.shape, shifts.shape[0]
  row, block, bucket = (jax.lax.broadcasted_iota(jnp.int32, (depth, count, width), axis)
                        for axis in range(3))
  source = (bucket - shifts[:, :, None]) % width
  # In uint32 as in _signs: element numbers of 2^31 and more wrap as they do there.
  element = ((block + first_block).astype(jnp.uint32) * jnp.uint32(width)
             + source.astype(jnp.uint32))
  words = bits_at(key, element + (row // 32).astype(jnp.uint32) * jnp.uint32(total_blocks * width))
  values = jnp.take_along_axis(blocks[None], source, axis=2, mode="promise_in_bounds")
  return jnp.sum(jnp.where((words >> (row % 32).astype(jnp.uint32)) & 1 == 1, values, -values),
                 axis=1)


def _estimates_at_once(table: jax.Array, key: jax.Array, size: int) -> jax.Array:
  """The estimates of ``size`` elements from ``table`` (``(depth, width)``), float32
  ``(size,)``, for accelerators: one elementwise pass over all blocks at once that hashes each
  element's sign words, gathers its ``depth`` buckets from the (small) table and takes their
  median; no loop."""
  depth, width = table.shape
  total = -(-max(size, 1) // width)
  shifts = _shifts(key, 0, total, total, width, depth)
  position = jax.lax.broadcasted_iota(jnp.int32, (total, width), 1)
  element = (jax.lax.broadcasted_iota(jnp.uint32, (total, width), 0) * jnp.uint32(width)
             + position.astype(jnp.uint32))
  return _median_estimates(table, key, element, position,
                           [shifts[row][:, None] for row in range(depth)], total
                           ).reshape(-1)[:size]


def _estimates_at(table: jax.Array, key: jax.Array, positions: jax.Array,
                  total_blocks: int) -> jax.Array:
  """The estimates of the elements at ``positions`` (int32, any shape, in ``[0, total_blocks
  width)``) from ``table``: the same hashes, buckets, signs and median as the loops over
  steps, element by element (gathers from the small table), so the same values bit for bit."""
  depth, width = table.shape
  shifts = _shifts(key, 0, total_blocks, total_blocks, width, depth)
  block = positions // width
  return _median_estimates(table, key, positions.astype(jnp.uint32), positions % width,
                           [shifts[row][block] for row in range(depth)], total_blocks)


def _median_estimates(table: jax.Array, key: jax.Array, element: jax.Array,
                      position: jax.Array, row_shifts: list[jax.Array],
                      total_blocks: int) -> jax.Array:
  """The estimates of the elements numbered ``element`` (uint32) of a sketch over
  ``total_blocks`` blocks: element ``e`` at ``position`` in its block, whose shift in row ``j``
  is ``row_shifts[j]`` (an array per row, broadcast against ``position``), reads bucket
  ``(position + shift) mod width`` of each row, signs it by its hash and takes the median."""
  depth, width = table.shape
  words = [bits_at(key, element + jnp.uint32(word * total_blocks * width))
           for word in range(-(-depth // 32))]
  return median_of_rows([
      _signed(words[row // 32], row,
              table[row].at[(position + row_shifts[row]) % width].get(mode="promise_in_bounds"))
      for row in range(depth)])


def _heavy_in_steps(table: jax.Array, key: jax.Array, size: int, kept: int) -> jax.Array:
  """The decode with heavy hitters on the CPU: the estimates of :func:`_estimates_in_steps`
  with all but the ``kept`` largest magnitudes (ties to the lower position) set to 0.

  The selection is :func:`~jaxcomm._src.compress.select.largest_k`'s, arranged so that XLA's
  CPU backend writes the estimates into the decode's output and masks them there in place:
  the sample's values are recomputed from the table (:func:`_estimates_at`) before the loop
  that writes the estimates, which also packs the candidates' bit words, and the exact
  fallback recomputes the estimates in its branch. The loop updates
  one flat buffer (``fori_loop``): a ``lax.map``'s stacked output, reshaped to 1-D, was not
  masked in place, and the estimates were a fresh 64 MiB temporary at 16M, page-faulted on
  every call (decode 78 -> 55 ms of CPU at 16M, 16,384 x 5). Read by the fallback branch
  instead of recomputed there, they cost 25 ms more; the candidates' gather from them does
  not stop the masking in place, and is 4 ms faster than recomputing the candidates.
  """
  depth, width = table.shape
  total, steps, per_step, unrolled = _blocks(size, width, depth)
  plan = select.fast_plan(size, kept)
  # largest_k's exact path (a short input, or too many kept), or steps of partial words.
  if plan is None or (per_step * width) % 32:
    return _heavy_hitters(_estimates_in_steps(table, key, size), kept)
  sample, rank, slots = plan
  magnitude_bits = lambda values: jax.lax.bitcast_convert_type(jnp.abs(values), jnp.int32)
  threshold = select.kth_largest_bits(magnitude_bits(_estimates_at(
      table, key, jnp.asarray(select.sample_positions(size, sample)), total)), rank)
  threshold = jax.lax.bitcast_convert_type(threshold, jnp.float32)

  step_size = per_step * width
  all_shifts = _step_shifts(key, steps, per_step, total, width, depth)

  def estimate_step(step, valid=None):
    signs = _signs(key, step * per_step, per_step, total, width, depth)
    estimates = _step_estimates(table, SketchHashes(signs, all_shifts[step]), unrolled)
    magnitudes = jnp.abs(estimates).reshape(1, -1)
    if valid is not None:  # the padding's estimates are never candidates
      magnitudes = jnp.where(jax.lax.iota(jnp.int32, step_size) < valid, magnitudes, 0.0)
    return estimates.reshape(-1), select.words_at_least(magnitudes, threshold[None])[0]

  def add_step(step, carry):
    step_estimates, step_words = estimate_step(step)
    return (jax.lax.dynamic_update_slice(carry[0], step_estimates, (step * step_size,)),
            jax.lax.dynamic_update_slice(carry[1], step_words, (step * (step_size // 32),)))

  full = size // step_size
  estimates, words = (jnp.zeros_like(table, shape=(size,)),
                      jnp.zeros_like(table, jnp.uint32, shape=(steps * step_size // 32,)))
  if full:
    estimates, words = jax.lax.fori_loop(0, full, add_step, (estimates, words))
  if full < steps:
    tail, tail_words = estimate_step(full, size - full * step_size)
    estimates = estimates.at[full * step_size:].set(tail[:size - full * step_size])
    words = words.at[full * step_size // 32:].set(tail_words)
  count = jnp.sum(jax.lax.population_count(words).astype(jnp.int32))
  where = select.compact_words(words, size, slots)
  buffer = jnp.where(where < size, magnitude_bits(estimates[jnp.minimum(where, size - 1)]), -1)
  kth = select.kth_largest_bits(buffer, kept)
  ties = buffer == kth
  needed = kept - jnp.sum(buffer > kth, dtype=jnp.int32)
  last_tie = jnp.max(jnp.where(ties & (select.prefix_sum(ties.astype(jnp.int32)) <= needed),
                               where, -1))

  def exact():
    values = _estimates_in_steps(table, key, size)
    return _bound(values, jax.lax.top_k(jnp.abs(values), kept)[1])

  kth, last_tie = jax.lax.cond(
      select.fast_path_holds(count, kept, slots, threshold),
      lambda: (jax.lax.bitcast_convert_type(kth, jnp.float32), last_tie), exact)
  return jnp.where(_within(estimates, kth, last_tie), estimates, 0.0)


def _bound(values: jax.Array, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(t, last)`` of the ``k`` largest ``|values|`` at ``indices`` (ties to the lower
  position): their smallest magnitude ``t``, and the last position picked at ``t``."""
  picked = jnp.abs(values[indices])
  kth = jnp.min(picked)
  return kth, jnp.max(jnp.where(picked == kth, indices, -1))


def _within(values: jax.Array, kth: jax.Array, last_tie: jax.Array) -> jax.Array:
  """The mask of the elements above ``kth`` in magnitude, and of those at ``kth`` up to
  position ``last_tie``: one pass over ``values``."""
  magnitude = jnp.abs(values)
  position = jax.lax.iota(jnp.int32, values.shape[0])
  return (magnitude > kth) | ((magnitude == kth) & (position <= last_tie))


def _kept(values: jax.Array, indices: jax.Array) -> jax.Array:
  """A mask of ``indices``, the positions of the ``k`` largest ``|values|`` (1-D, ties to the
  lower position, as :func:`~jaxcomm._src.compress.select.largest_k` picks them): those above
  the ``k``-th largest magnitude ``t``, and those at ``t`` up to the last one picked. One pass
  over ``values``, where a scatter into zeros writes ``k`` random positions of a fresh array.
  """
  return _within(values, *_bound(values, indices))


def _heavy_hitters(estimates: jax.Array, kept: int) -> jax.Array:
  """``estimates`` (1-D) with all but the ``kept`` largest magnitudes set to 0."""
  return jnp.where(_kept(estimates, select.largest_k(estimates, kept, by_magnitude=True)),
                   estimates, 0.0)


# Deepest sketch whose median is taken by a sorting network; deeper ones sort.
NETWORK_DEPTH = 32


def median_of_rows(rows) -> jax.Array:
  """Median over axis 0 of a ``(depth, n)`` array (or a list of ``depth`` arrays of shape
  ``(n,)``).

  Up to ``NETWORK_DEPTH`` rows, by a sorting network of min/max: ``depth^2 / 2`` elementwise
  compare-exchanges are far cheaper than a sort along a length-``depth`` axis (XLA's CPU sort
  is slow for that layout). Deeper, by ``jnp.sort`` along axis 0: the network's
  ``O(depth^2)`` operations made compiling the decode take more than 20 GB of memory at
  depths above 32. Both pick the same elements, so they agree bit for bit on finite input.
  """
  if len(rows) > NETWORK_DEPTH:
    ordered = jnp.sort(jnp.stack(list(rows)), axis=0)
  else:
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

  Hashes (:func:`sketch_hashes`): the input is cut into blocks of ``width`` elements, and row
  ``j`` adds block ``b`` rotated by a random shift ``r_j(b)``:
  ``h_j(b width + p) = (p + r_j(b)) mod width``, with a random sign ``s_j(i)`` per element.
  Two elements of one block never share a bucket; two of different blocks share it with
  probability exactly ``1 / width`` (over the shifts), the pairwise collision probability of
  a 2-universal hash, on which the variance and median bounds below rest. Rotating whole
  blocks is a contiguous copy where a bucket per element was a scatter-add, which XLA's CPU
  backend runs one element at a time (until session 12 of issue 13: 16M elements, 5 rows,
  320 ms of CPU for an encode and a decode, against 190). An input of at most ``width``
  elements is one block: every row sketches it without collisions, and decodes it exactly.

  Properties: linear: ``sketch(x1 + x2) = sketch(x1) + sketch(x2)`` for one call's hashes,
  so the devices' sketches are ``psum``-ed and decoded once (decode itself is linear only for
  ``depth = 1`` without ``heavy``). The hashes come from the state's key, split at every call:
  the same on every device, new at every step, so one step's error is not repeated at the
  next (with fixed hashes every decoded step of one row lies in the same ``width``-dimensional
  subspace). One row without ``heavy`` is unbiased over the hash draw, with error variance up
  to ``||x||_2^2 / width`` per element (``0`` for ``d <= width``): more than ``||x||^2`` in
  all unless ``width >= d``, so it is not contractive and is flagged ``unbiased=False``
  (error feedback in front of it would grow without bound); the median and the selection are
  biased. With ``width >= 3 / eps^2`` the median errs by more than ``eps ||x||_2`` with
  probability at most ``exp(-depth / 18)`` per element.

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

  def encode(x: jax.Array, state: CountSketchState, key: jax.Array):
    del key
    next_key, hash_key = jax.random.split(state.key)
    table = backends.by_platform(lambda flat, key: _table_in_steps(flat, key, width, depth),
                                 lambda flat, key: _table_at_once(flat, key, width, depth),
                                 x.reshape(-1).astype(jnp.float32), hash_key)
    return CountSketchPayload(table, hash_key), CountSketchState(next_key)

  def decode(payload: CountSketchPayload, shape) -> jax.Array:
    size = num_elements(shape)
    if heavy is None:
      estimates = backends.by_platform(lambda table, key: _estimates_in_steps(table, key, size),
                                       lambda table, key: _estimates_at_once(table, key, size),
                                       payload.table, payload.key)
    else:
      kept = min(size, max(1, math.floor(heavy * size)))
      estimates = backends.by_platform(
          lambda table, key: _heavy_in_steps(table, key, size, kept),
          lambda table, key: _heavy_hitters(_estimates_at_once(table, key, size), kept),
          payload.table, payload.key)
    return estimates.reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del shape, dtype
    return 4 * depth * width + 8

  suffix = "" if heavy is None else f", heavy={heavy:g}"
  return Compressor(init=init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=True, unbiased=False, name=f"count_sketch({width}x{depth}{suffix})")
