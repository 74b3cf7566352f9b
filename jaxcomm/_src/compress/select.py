"""Exact top-k selection in O(d): a sampled threshold, compaction, and a radix search.

``jax.lax.top_k`` on the CPU backend costs about as much as a sort (0.05-0.3 GB/s for k = 1%
of 16M elements). :func:`largest_k` returns exactly the same set of ``k`` positions (the
largest magnitudes, ties to the lower index) with work linear in ``d``:

1. a threshold ``t`` is read off a fixed pseudo-random sample of ``m`` magnitudes (by
   :func:`kth_largest_bits`, as in step 3), at a rank
   chosen so that the number ``c`` of elements ``>= t`` lies in ``[k, capacity]`` with high
   probability (:func:`sample_plan`: six standard deviations of ``c`` on either side);
2. the ``c`` candidates are packed into bit words by one memory-bound pass
   (:func:`words_at_least`) and compacted, in index order, into a buffer of static size
   ``capacity`` (:func:`compact`: population counts, a prefix sum over ``d / 32``
   word counts, and each slot's word from a scatter of ``d / 32`` marks prefix-summed over the
   slots; no prefix sum over ``d``);
3. the ``k``-th largest candidate bit pattern ``T`` is found exactly (:func:`kth_largest_bits`:
   ``jax.lax.top_k`` for one row and a small share ``k``, a search of 3 bits per pass for a
   larger share of a short row, else a 31-step binary search on the bits; non-negative
   float32 values order like their int32 bits), and the buffer
   keeps every candidate above ``T`` plus the lowest-indexed ties at ``T`` (compacted again).

All elements outside the candidates are below ``t <= T``, so the result is exactly the top
``k``. When the sample misjudges (``c < k`` or ``c > capacity``, e.g. for inputs with huge
numbers of exact ties) or ``t`` is not a normal float (0, subnormal or NaN),
``jax.lax.cond`` takes the exact ``jax.lax.top_k`` path instead; the
outcome is the same set either way, only the time differs.

References:
  Lin et al., "Deep Gradient Compression", ICLR 2018 (sampled thresholds); Shanbhag, Pirk &
  Madden, "Efficient Top-K Query Processing on Massively Parallel Hardware", SIGMOD 2018.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.compress import backends
from jaxcomm._src.compress.hashing import hash_bits

SAMPLE = 1 << 16
WORD = 32
# Below this many elements a plain ``jax.lax.top_k`` is as fast as the sampled path.
MIN_FAST_SIZE = 1 << 15
_SAMPLE_KEY = (0x5EED, 0x70B5)
# Gathers bit 0 of each byte of a uint32 into its top four bits (see _pack_flags).
_NIBBLE_GATHER = np.uint32(0x10204080)
_NIBBLE_SHIFTS = np.arange(0, WORD, 4, dtype=np.uint32)
# Up to this k, one row's k-th largest is read off ``jax.lax.top_k`` rather than searched in
# 31 passes: each pass is an iteration of an XLA while loop, ~4 us of overhead on the CPU
# backend, while its TopK kernel finds the 40th largest of 2,048 in ~18 us, the 327th of 970
# in ~27 us and the 760th of 65,536 in ~0.45 ms (the search: 113 us, 71 us, 2.1 ms).
TOP_K_MAX = 1024
# A single row's k-th largest is read off jax.lax.top_k while k <= n / TOP_K_SHARE, and
# searched digit by digit above that up to DIGIT_MAX_SIZE elements (see kth_largest_bits).
TOP_K_SHARE = 20
DIGIT_MAX_SIZE = 1 << 14
# Bits resolved per pass of the digit search (see _digit_kth): 2^3 trial values per pass.
DIGIT_BITS = 3
# Bits resolved per pass of the accelerators' search (see _digits_kth): 16 trial values.
ACCELERATOR_DIGIT_BITS = 4
# Counters per row of the searches' counting passes (see _radix_kth, _digit_kth).
LANES = 128
# Deviations of the candidates' count between k, its expected value and the capacity.
SIGMAS = 6
# Elements per piece of the CPU's exact top-k of one long row (see _exact_in_pieces).
EXACT_PIECE = 1 << 21


def bit_words(mask: jax.Array) -> jax.Array:
  """A 1-D bool mask as uint32 words, element ``32 w + b`` in bit ``b`` of word ``w``:
  shape ``(ceil(d / 32),)``, the last word zero-padded."""
  return _pack_flags(jnp.pad(mask.astype(jnp.uint8), (0, (-mask.shape[0]) % WORD)))


def _pack_flags(flags: jax.Array) -> jax.Array:
  """uint8 flags (0 or 1) on the last axis, of a length divisible by 32, as uint32 words:
  flag ``32 w + b`` in bit ``b`` of word ``w`` (shape ``(..., d / 32)``).

  Each four flags are read as one little-endian uint32 ``sum_i f_i 2^(8 i)``. Its product
  with ``0x10204080 = sum_t 2^(28 - 7 t)`` holds ``f_i`` in bit ``28 + i``: the partial
  products land on the distinct bits ``8 i + 28 - 7 t`` (no carries), ``t = i`` on bit
  ``28 + i``, ``t > i`` below it and ``t < i`` past bit 31. Eight such nibbles make a word.
  One multiply per four elements: the sum of 32 selected powers of two per word that this
  replaces ran far below memory speed on XLA's CPU backend (16M float32 elements compared
  with a threshold and packed: 9.5 against 2.0 ms of CPU, session 20).
  """
  quads = jax.lax.bitcast_convert_type(flags.reshape(*flags.shape[:-1], -1, WORD // 4, 4),
                                       jnp.uint32)
  nibbles = (quads * _NIBBLE_GATHER) >> 28
  return jnp.sum(nibbles << _NIBBLE_SHIFTS, axis=-1, dtype=jnp.uint32)


def _select_bit(words: jax.Array, rank: jax.Array) -> jax.Array:
  """Position (0-31) of the ``rank``-th set bit (0-based) of each uint32 word: a binary
  search over halves, quarters, ... of the word by population counts (elementwise)."""
  bit = jnp.zeros_like(rank)
  for width in (16, 8, 4, 2, 1):
    low = jax.lax.population_count(words & jnp.uint32((1 << width) - 1)).astype(rank.dtype)
    skip = rank >= low
    rank = jnp.where(skip, rank - low, rank)
    words = jnp.where(skip, words >> width, words)
    bit = jnp.where(skip, bit + width, bit)
  return bit


def words_at_least(values: jax.Array, threshold: jax.Array) -> jax.Array:
  """:func:`bit_words` of ``values >= threshold`` for each row, NaN counted as passing:
  uint32 of shape ``(rows, ceil(d / 32))`` for ``values`` of shape ``(rows, d)`` and
  ``threshold`` of shape ``(rows,)``.

  Written as ``where(values < threshold, 0, 1)``: a float compare and a select per element,
  no bit cast or shift, so that XLA's CPU cost model counts the pass as memory-bound and runs
  it as one task. As an integer compare of the bits it counted as compute-bound and was split
  into parallel tasks (8 on the 8 simulated devices of a 2-core host), whose hand-offs cost
  more than the pass (32,768 elements: ~15% of the selection). Packed by :func:`_pack_flags`.
  """
  flags = jnp.where(values < threshold[:, None], jnp.uint8(0), jnp.uint8(1))
  return _pack_flags(jnp.pad(flags, ((0, 0), (0, (-values.shape[1]) % WORD))))


def prefix_sum(values: jax.Array) -> jax.Array:
  """Inclusive prefix sum of 1-D int32 ``values`` (shape kept).

  On the CPU an ``associative_scan`` (XLA's CPU ``cumsum`` costs ~20 ns per element). On an
  accelerator ``jnp.cumsum``, which JAX lowers there to XLA's own scan (a windowed reduction
  that XLA's GPU backend rewrites into a few blocked passes); the ``associative_scan`` is
  ``2 log2(n)`` dependent slice-and-add steps, each its own kernel (about 80 for 2^20
  elements), which on a GPU cost a launch each whatever their size. Integer sums: the two
  agree exactly.
  """
  return backends.by_platform(_scan_sum, _cumsum, values)


def _scan_sum(values: jax.Array) -> jax.Array:
  return jax.lax.associative_scan(jnp.add, values)


def _cumsum(values: jax.Array) -> jax.Array:
  return jnp.cumsum(values, dtype=values.dtype)


def compact(mask: jax.Array, count: int) -> jax.Array:
  """Positions of the first ``count`` ``True`` of a 1-D ``mask``, in increasing order.

  The mask is packed into uint32 words (one fused pass over ``d``), counted per word by
  ``population_count``, and the ``d / 32`` counts are prefix-summed (``associative_scan``:
  XLA's CPU ``cumsum`` costs ~20 ns per element). Output slot ``r`` then finds its word as
  the number of words whose prefix sum is at most ``r``: a 1 is scattered at each word's
  prefix sum and the ``count`` marks are prefix-summed (a binary search of every slot in the
  prefix sums, ``log2(d / 32)`` gathers per slot, took three times as long: 32,768 elements,
  2,009 slots: 155 against 48 us; 256 rows of 65,536: 17.7 against 5.7 ms). Its bit is
  found by :func:`_select_bit`. Work: one pass over ``mask``, a scatter of ``d / 32`` marks
  and ``O(1)`` per slot. Slots beyond the number of ``True`` give ``d``.

  Args:
    mask: bool of shape ``(d,)``.
    count: static number of slots, >= 0.

  Returns:
    int32 of shape ``(count,)``.
  """
  return compact_words(bit_words(mask), mask.shape[0], count)


def compact_words(words: jax.Array, size: int, count: int) -> jax.Array:
  """:func:`compact` of a mask of ``size`` elements already packed by :func:`bit_words`
  (uint32 of shape ``(ceil(size / 32),)``); slots beyond its ``True`` give ``size``."""
  counts = jax.lax.population_count(words).astype(jnp.int32)
  ends = prefix_sum(counts)
  # searchsorted(ends, r, side="right") for every slot r: words ending at or before r.
  marks = jnp.zeros(count, jnp.int32).at[ends].add(1, mode="drop")
  word = jnp.minimum(prefix_sum(marks), words.shape[0] - 1)
  ranks = jnp.arange(count, dtype=jnp.int32)
  bit = _select_bit(words[word], ranks - (ends[word] - counts[word]))
  return jnp.where(ranks < ends[-1], word * WORD + bit, size).astype(jnp.int32)


def count_true(mask: jax.Array) -> jax.Array:
  """``True`` per row of a ``(rows, d)`` bool array, as int32 ``(rows,)``: the population
  counts of the mask's :func:`bit_words`. XLA's CPU backend packs words at memory speed but
  reduces a long boolean axis about ten times slower (16M elements: 3 ms against 40)."""
  words = jax.vmap(bit_words)(mask)
  return jnp.sum(jax.lax.population_count(words).astype(jnp.int32), axis=1)


def kth_largest_bits(bits: jax.Array, k: int) -> jax.Array:
  """The ``k``-th largest of each row of non-negative int32 ``bits`` (shape ``(n,)`` or
  ``(rows, n)``; negative entries, such as ``-1`` for an empty slot, never count while a
  row holds at least ``k`` others).

  Non-negative float32 values order like their int32 bit patterns, so this is also the
  ``k``-th largest magnitude. A single row takes the smallest of ``jax.lax.top_k``'s values
  while ``k <= TOP_K_MAX`` and ``k <= n / TOP_K_SHARE``; XLA's CPU TopK kernel costs ~5 ns
  per element plus ~0.13 us per kept one (a heap of ``k``, then its sort), so a larger
  share of a row of at most ``DIGIT_MAX_SIZE`` is searched digit by digit instead
  (:func:`_digit_kth`; the 327th largest of 2,009: ~25 against ~65 us). Longer rows, and
  batches of rows (which XLA's CPU backend sorts rather than pass to its TopK kernel), are
  searched bit by bit (:func:`_radix_kth`).

  On an accelerator a single row is searched :data:`ACCELERATOR_DIGIT_BITS` bits per pass
  instead (:func:`_digits_kth`): 8 counting passes unrolled, where the bit search is an XLA
  while loop of 31 counting passes (a kernel launch or more each on a GPU), and XLA's GPU
  TopK kernel covers only small ``k`` (larger ones become a sort). A batch of rows keeps the
  bit search, whose 31 passes are then long: on an H200, chunked top-k of 256M elements in
  rows of 65,536 ran at 197 GB/s with the digits and 311 with the bits (session 15). All
  give the same value.

  Returns:
    int32 of shape ``()`` or ``(rows,)``.
  """
  return backends.by_platform(lambda b: _cpu_kth(b, k), lambda b: accelerator_kth(b, k), bits)


def accelerator_kth(bits: jax.Array, k: int) -> jax.Array:
  """:func:`kth_largest_bits` as an accelerator computes it (:func:`_digits_kth` for one row,
  :func:`_radix_kth` for several); callable on any backend, so that the CPU tests compare it
  with the CPU's."""
  if bits.ndim == 1:
    return _digits_kth(bits[None], k)[0]
  if bits.shape[0] > 1:
    return _radix_kth(bits, k)
  return _digits_kth(bits, k)


def _cpu_kth(bits: jax.Array, k: int) -> jax.Array:
  """:func:`kth_largest_bits` on the CPU: ``jax.lax.top_k``, the digit or the bit search."""
  if bits.ndim == 2:
    if bits.shape[0] == 1:
      return _cpu_kth(bits[0], k)[None]
    return _radix_kth(bits, k)
  size = bits.shape[0]
  if k > TOP_K_MAX or k * TOP_K_SHARE > size:
    return _digit_kth(bits, k) if size <= DIGIT_MAX_SIZE else _radix_kth(bits[None], k)[0]
  # A negative entry becomes +0.0, the smallest magnitude: with >= k other entries, all >= 0,
  # the k-th largest is unchanged. The minimum of the values (not the k-th index) keeps
  # XLA's CPU TopK kernel; reading one index of its output made XLA lower it to a sort. The
  # minimum is taken over the bits: a float minimum returned NaN whenever a NaN was kept.
  magnitudes = jax.lax.bitcast_convert_type(jnp.maximum(bits, 0), jnp.float32)
  return jnp.min(jax.lax.bitcast_convert_type(jax.lax.top_k(magnitudes, k)[0], jnp.int32))


def _digit_kth(bits: jax.Array, k: int) -> jax.Array:
  """:func:`kth_largest_bits` of one row, ``DIGIT_BITS`` bits per pass (11 passes for 31
  bits): each pass counts the entries at or above every value of the next digit at once and
  keeps the largest digit that ``k`` of them reach. The counts run down the middle axis of
  a ``(digits, n / LANES, LANES)`` layout in 16-bit lanes, which XLA's CPU backend
  vectorizes; ``n <= DIGIT_MAX_SIZE`` keeps each pass one small kernel."""
  size = bits.shape[0]
  lanes = jnp.pad(bits, (0, (-size) % LANES), constant_values=-1).reshape(-1, LANES)
  value = jnp.zeros((), jnp.int32)
  low = 31
  while low > 0:
    width = min(DIGIT_BITS, low)
    low -= width
    trials = value + (np.arange(1 << width, dtype=np.int32) << low)
    reached = (lanes >= trials[:, None, None]).astype(jnp.int16)
    counts = jnp.sum(jnp.sum(reached, axis=1, dtype=jnp.int16), axis=1, dtype=jnp.int32)
    # The counts fall as the digit grows, and digit 0 is reached by >= k entries.
    value = value + (jnp.sum(counts >= k, dtype=jnp.int32) - 1) * (1 << low)
  return value


def _radix_kth(bits: jax.Array, k: int) -> jax.Array:
  """:func:`kth_largest_bits` of each row of ``(rows, n)`` ``bits`` by a 31-step binary
  search on the bits, one counting pass each.

  The rows are laid out as ``(rows, n / LANES, LANES)`` (padded with ``-1``, which no trial
  value reaches) once, before the loop, and each pass counts down the middle axis in 16-bit
  lanes: XLA's CPU backend vectorizes that sum, where a count along a row ran several
  times slower, and reshaping inside the loop made it transpose the rows at every pass.
  """
  rows, size = bits.shape
  lanes = jnp.pad(bits, ((0, 0), (0, (-size) % LANES)), constant_values=-1)
  lanes = lanes.reshape(rows, -1, LANES)
  lane_dtype = jnp.int16 if lanes.shape[1] < 1 << 15 else jnp.int32

  def refine(bit, value):
    trial = value | jnp.left_shift(jnp.int32(1), 30 - bit)
    reached = (lanes >= trial[:, None, None]).astype(lane_dtype)
    count = jnp.sum(jnp.sum(reached, axis=1, dtype=lane_dtype), axis=1, dtype=jnp.int32)
    return jnp.where(count >= k, trial, value)
  # the carry starts from bits (not a constant) so that it varies over the mesh axes as they do
  return jax.lax.fori_loop(0, 31, refine, jnp.zeros_like(bits[:, 0]))


def _digits_kth(bits: jax.Array, k: int) -> jax.Array:
  """:func:`kth_largest_bits` of each row of ``(rows, n)`` ``bits``,
  ``ACCELERATOR_DIGIT_BITS`` bits per pass (8 passes for 31 bits), unrolled at trace time.

  Each pass compares every entry with the ``2^b`` trial values of the next digit and counts
  the entries reaching each; the counts are a reduction over ``n`` with the trial axis
  minor, which XLA can emit as one column reduction that reads each entry once per pass and
  does the ``2^b`` compares in registers. A row with fewer than ``k`` non-negative entries
  gives 0, as the bit search does.
  """
  value = jnp.zeros_like(bits[:, 0])
  low = 31
  while low > 0:
    width = min(ACCELERATOR_DIGIT_BITS, low)
    low -= width
    trials = value[:, None] + (np.arange(1 << width, dtype=np.int32) << low)
    counts = jnp.sum(bits[:, :, None] >= trials[:, None, :], axis=1, dtype=jnp.int32)
    # The counts fall as the digit grows; digit 0 is reached by >= k entries (or none is).
    digit = jnp.maximum(jnp.sum(counts >= k, axis=1, dtype=jnp.int32) - 1, 0)
    value = value + digit * (1 << low)
  return value


def _top_of_buffer(bits: jax.Array, k: int, kth: jax.Array) -> jax.Array:
  """Buffer positions of the ``k`` largest ``bits``, ties to the lower position, in order,
  given their ``k``-th largest ``kth`` (:func:`kth_largest_bits`)."""
  above = bits > kth
  ties = bits == kth
  needed = k - count_true(above[None])[0]
  tie_rank = prefix_sum(ties.astype(jnp.int32))
  return compact(above | (ties & (tie_rank <= needed)), k)


def sample_positions(size: int, sample: int) -> np.ndarray:
  """The fixed pseudo-random sample of a row of ``size``: ``sample`` hashed positions, sorted
  at trace time (a constant), so that the gather walks each row forward (16M elements in rows
  of 65,536: 2 ms against 5 in hash order). The sample is the same set either way."""
  with jax.ensure_compile_time_eval():
    positions = hash_bits(jnp.array(_SAMPLE_KEY, jnp.uint32), (sample,)) % jnp.uint32(size)
  return np.sort(np.asarray(positions).astype(np.int32))


def sample_plan(size: int, k: int, sample: int) -> tuple[int, int]:
  """``(rank, capacity)`` of the fast path for rows of ``size``: the sample rank whose value
  is the threshold, and the static buffer size.

  The number ``c`` of a row's elements at or above the ``r``-th largest of ``m`` sampled ones
  is ``size`` times a Beta(``r``, ``m - r + 1``) fraction: mean ``r size / m``, standard
  deviation ``sigma(c) ~ sqrt(c size / m)``. The rank aims at the ``c`` that lies
  ``SIGMAS`` deviations above ``k``, and the capacity lies ``SIGMAS`` deviations above it
  (plus 64), so that a row falls back with probability about ``1e-9``; the bounds held
  before (``k + 8 sqrt(k size / m)`` around a midpoint) were about 3.3 deviations, which
  sent one 16M-element input in four to the fallback in rows of 65,536.
  """
  spread = SIGMAS * math.sqrt(size / sample)
  aim = ((spread + math.sqrt(spread**2 + 4 * k)) / 2) ** 2  # aim - spread sqrt(aim) = k
  rank = max(1, min(sample, round(aim * sample / size)))
  return rank, min(size, math.ceil(aim + spread * math.sqrt(aim)) + 64)


def _exact(magnitude: jax.Array, k: int) -> jax.Array:
  return jnp.sort(jax.lax.top_k(magnitude, k)[1], axis=-1).astype(jnp.int32)


def _fallback(values: jax.Array, k: int, magnitude) -> jax.Array:
  """:func:`largest_k`'s exact branch for ``(rows, d)`` ``values``: ``jax.lax.top_k`` of the
  magnitudes, recomputed from ``values`` by the elementwise ``magnitude``. On the CPU row by
  row (``jax.lax.map``), and a long row in pieces (:func:`_exact_in_pieces`): for the whole
  input at once the magnitudes were a temporary of its size, and although the branch is
  rarely taken, XLA's CPU runtime allocates every call's temporaries as one block, which that
  size put above glibc's mmap threshold, so the fast path's own small temporaries were
  page-faulted afresh on every call (chunked top-k at 16M: 65 -> 14 MiB of temporaries,
  encode + decode 43.8 -> 36.6 ms of CPU; ``topk(0.01)``, one row: 64 -> 18 MiB, 26.5 ->
  21.0 ms). Accelerators keep the batched call."""

  def on_cpu(rows):
    if rows.shape[0] == 1 and k < EXACT_PIECE < rows.shape[1] // 2:
      return _exact_in_pieces(rows[0], k, magnitude)[None]
    return jax.lax.map(lambda row: _exact(magnitude(row), k), rows)

  return backends.by_platform(on_cpu, lambda rows: _exact(magnitude(rows), k), values)


def _exact_in_pieces(row: jax.Array, k: int, magnitude) -> jax.Array:
  """:func:`_exact` of one long row in pieces of ``EXACT_PIECE`` elements: the ``k`` largest
  of each piece (a loop), then the ``k`` largest of those candidates. The same set, ties
  included: a piece holds at most ``k`` of the row's ``k`` largest, all among its own ``k``
  largest, and ``jax.lax.top_k`` lists equal values by increasing position, so the candidates
  of equal value keep the row's order.

  The loop keeps only the candidates' positions, and their magnitudes are gathered from the
  row after it: stacked beside the positions they were another ``4 k`` bytes per piece while
  the loop's piece was live (the threshold's encode at 16M, 2% slots: 31.0 -> 23.0 MiB of
  temporaries)."""
  size = row.shape[0]
  full = size // EXACT_PIECE

  def piece_top(piece):
    start = piece * EXACT_PIECE
    return jax.lax.top_k(magnitude(jax.lax.dynamic_slice_in_dim(row, start, EXACT_PIECE)),
                         k)[1] + start

  where = jax.lax.map(piece_top, jnp.arange(full, dtype=jnp.int32)).reshape(-1)
  if full * EXACT_PIECE < size:
    tail_where = jax.lax.top_k(magnitude(row[full * EXACT_PIECE:]),
                               min(k, size - full * EXACT_PIECE))[1]
    where = jnp.concatenate([where, tail_where + full * EXACT_PIECE])
  return jnp.sort(where[jax.lax.top_k(magnitude(row[where]), k)[1]]).astype(jnp.int32)


def _magnitude_of(by_magnitude: bool, at_least: jax.Array | None):
  """The elementwise function whose ``k`` largest :func:`largest_k` finds."""
  if at_least is None:
    return jnp.abs if by_magnitude else (lambda values: values)
  # A compare with NaN is false: NaN counts as 0, as in the threshold compressors' mask.
  return lambda values: jnp.where(jnp.abs(values) >= at_least, jnp.abs(values), 0.0)


def fast_plan(size: int, k: int) -> tuple[int, int, int] | None:
  """``(sample, rank, capacity)`` of :func:`largest_k`'s fast path for rows of ``size``
  (:func:`sample_plan`), or ``None`` where it takes the exact branch: a row shorter than
  ``MIN_FAST_SIZE``, or a capacity above a quarter of the row."""
  sample = min(SAMPLE, size // 16)
  if size < MIN_FAST_SIZE:
    return None
  rank, slots = sample_plan(size, k, sample)
  return None if slots > size // 4 else (sample, rank, slots)


def fast_path_holds(counts: jax.Array, k: int, slots: int, threshold: jax.Array) -> jax.Array:
  """Whether the fast path's result is exact: every row has between ``k`` and ``slots``
  candidates at or above its float32 ``threshold``, which is normal (for a subnormal or zero
  threshold the float compare and the bits' order could disagree)."""
  normal = threshold >= np.finfo(np.float32).tiny
  return jnp.all((counts >= k) & (counts <= slots) & normal)


def largest_k(values: jax.Array, k: int, *, by_magnitude: bool = False,
              at_least: jax.Array | None = None) -> jax.Array:
  """Positions of the ``k`` largest entries of each row, in increasing order.

  Exactly the set ``jax.lax.top_k(values, k)`` picks in each row (ties to the lower
  position), for ``values >= 0`` without NaN; sorted by position instead of by value. With
  ``by_magnitude``, the same for ``|values|`` (any sign); with ``at_least``, for
  ``where(|values| >= at_least, |values|, 0)`` (NaN counted as 0; the threshold
  compressors' overflow). Such magnitudes are taken inside each pass rather than
  materialized, which saves a d-sized temporary (on the CPU backend, a fresh one is
  page-faulted on every call).

  Args:
    values: float32 of shape ``(d,)`` or ``(rows, d)``; non-negative unless ``by_magnitude``.
    k: static count per row, ``1 <= k <= d``.
    by_magnitude: rank by ``|values|``.
    at_least: float32 scalar or None: rank by magnitude, those below it (and NaN) as 0.

  Returns:
    int32 of shape ``(k,)`` or ``(rows, k)``.
  """
  if values.ndim == 1:
    return largest_k(values[None], k, by_magnitude=by_magnitude, at_least=at_least)[0]
  magnitude = _magnitude_of(by_magnitude, at_least)
  size = values.shape[1]
  plan = fast_plan(size, k)
  if plan is None:
    return _exact(magnitude(values), k)
  sample, rank, slots = plan
  positions = sample_positions(size, sample)
  # Magnitudes are taken of what is read (the sample, the words' pass, the candidates), so
  # that no consumer needs them over the whole row: XLA's CPU backend wrote a magnitude of
  # several operations (`at_least`'s) into a d-sized temporary for its three consumers.
  bits = lambda read: jax.lax.bitcast_convert_type(magnitude(read), jnp.int32)
  threshold = jax.lax.bitcast_convert_type(kth_largest_bits(bits(values[:, positions]), rank),
                                           jnp.float32)
  # The candidates are packed into bit words once: their population counts give both the
  # count checked below and the compaction (a separate count over d cost 4x the packing).
  # For a normal threshold (checked below) the float compare passes exactly the elements
  # whose bits are at or above the threshold's, NaN included.
  words = words_at_least(magnitude(values), threshold)
  counts = jnp.sum(jax.lax.population_count(words).astype(jnp.int32), axis=1)

  def candidates(row, row_words):
    where = compact_words(row_words, size, slots)
    return where, jnp.where(where < size, bits(row[jnp.minimum(where, size - 1)]), -1)

  # The fast path runs outside the conditional: inside a branch, XLA's CPU backend ran it
  # about 4x slower (55 vs 13 ms at 4M elements), so the branch only picks the result. The
  # exact branch recomputes the magnitudes from `values`, so that they need not be kept.
  where, buffer = jax.vmap(candidates)(values, words)
  kth = kth_largest_bits(buffer, k)
  fast = jax.vmap(lambda w, b, t: w[_top_of_buffer(b, k, t)])(where, buffer, kth)
  return jax.lax.cond(fast_path_holds(counts, k, slots, threshold), lambda: fast,
                      lambda: _fallback(values, k, magnitude))
