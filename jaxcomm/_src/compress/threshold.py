"""Threshold sparsification with a static-capacity payload, fixed or adaptive threshold."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor, num_elements, stateless_init
from jaxcomm._src.validation import check_float, check_fraction
from jaxcomm._src.compress.hashing import hash_bits
from jaxcomm._src.compress.select import bit_words, compact_words, kth_largest_bits, largest_k


class ThresholdPayload(NamedTuple):
  """The wire format of threshold sparsification: a fixed-capacity list plus a count.

  Attributes:
    values: float32 of shape ``(capacity,)``; slots from ``count`` on hold 0.
    indices: int32 of shape ``(capacity,)``, flat positions; slots from ``count`` on hold 0.
    count: int32 of shape ``(1,)``: how many slots are used.
  """
  values: jax.Array
  indices: jax.Array
  count: jax.Array


def capacity_count(size: int, capacity: float) -> int:
  """Static number of slots: ``max(1, ceil(capacity * d))``, capped at ``d``."""
  return min(size, max(1, math.ceil(capacity * size)))


def _threshold_compressor(threshold_of: Callable[[jax.Array, jax.Array], jax.Array],
                          capacity: float, name: str) -> Compressor:
  """Shared body: send the largest elements with ``|x_i| >= threshold``, at most ``capacity``."""

  def encode(x: jax.Array, state, key: jax.Array):
    flat = x.reshape(-1).astype(jnp.float32)
    threshold = threshold_of(flat, key)
    slots = capacity_count(flat.shape[0], capacity)
    if slots == 0:
      empty = jnp.zeros((0,), jnp.float32)
      return ThresholdPayload(empty, empty.astype(jnp.int32), jnp.zeros((1,), jnp.int32)), state
    # The mask is packed into bit words once: their population counts give the count, and
    # the same words the compaction (a mask kept for both was a d-byte temporary and a
    # second packing pass). The magnitudes are recomputed inside each pass, never kept: the
    # conditional's operand |x| was a fresh d-element buffer, page-faulted on every call.
    words = bit_words(jnp.abs(flat) >= threshold)
    passed = jnp.sum(jax.lax.population_count(words).astype(jnp.int32))
    # When they fit, the elements above the threshold are compacted in index order (linear
    # time); when more pass, the largest of them win the slots (exact linear-time top-k).
    # The compaction runs outside the conditional: XLA's CPU backend runs work inside a
    # branch several times slower. The overflow branch ranks the masked magnitudes inside
    # largest_k's passes (at_least): a masked copy of x was a d-element temporary that, though
    # the branch is rarely taken, put the call's whole block of temporaries (95 MiB at 16M)
    # above glibc's mmap threshold, so the usual path's few MiB were page-faulted every call.
    fitting = compact_words(words, flat.shape[0], slots)
    indices = jax.lax.cond(passed <= slots, lambda: fitting,
                           lambda: largest_k(flat, slots, at_least=threshold))
    count = jnp.minimum(passed, slots)
    used = jnp.arange(slots) < count
    indices = jnp.where(used, indices, 0)
    values = jnp.where(used, flat[indices], 0.0)
    return ThresholdPayload(values, indices, count.reshape(1)), state

  def decode(payload: ThresholdPayload, shape) -> jax.Array:
    used = jnp.arange(payload.values.shape[0]) < payload.count[0]
    # Unused slots point at 0 with value 0; adding (not setting) them cannot clobber a real
    # value sent for position 0. Masking by `used` keeps that true even if the values went
    # through a quantizer that does not map 0 to 0.
    values = jnp.where(used, payload.values.astype(jnp.float32), 0.0)
    dense = jnp.zeros(num_elements(shape), jnp.float32).at[payload.indices].add(values)
    return dense.reshape(shape)

  def subtract_decoded(x: jax.Array, payload: ThresholdPayload) -> jax.Array:
    # The sent values scattered into x (x + (-v) rounds as x - v; an unused slot adds -0.0 at
    # position 0, which leaves any x unchanged) instead of decode's zeros and a subtraction.
    used = jnp.arange(payload.values.shape[0]) < payload.count[0]
    negated = jnp.where(used, -payload.values.astype(jnp.float32), -0.0)
    return x.reshape(-1).at[payload.indices].add(negated).reshape(x.shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    return 8 * capacity_count(num_elements(shape), capacity) + 4

  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=False, name=name, subtract_decoded=subtract_decoded)


def threshold(value: float, *, capacity: float = 0.01) -> Compressor:
  """Sends the elements with ``|x_i| >= value``, at most ``capacity * d`` of them.

  The payload has a static capacity so shapes stay fixed under ``jit``. When more elements
  pass the threshold, the largest ones are sent and the rest are not: ``decode`` gives exactly
  what was sent, so under :func:`~jaxcomm.error_feedback` the overflow stays in the residual
  and goes out in later steps; nothing is lost.

  Properties: biased; ``||C(x) - x||^2 = ||x||^2 - sum_sent x_i^2 <= ||x||^2``, with no
  contraction ``delta > 0`` valid for every input (nothing is sent when all ``|x_i| < value``);
  not linear. Use it with error feedback.

  Bytes: ``8 * max(1, ceil(capacity * d)) + 4`` (float32 values, int32 indices, int32 count).

  Args:
    value: the threshold, > 0.
    capacity: the most elements sent, as a fraction of ``d`` in (0, 1].

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`ThresholdPayload` payloads.

  References:
    Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
    Interspeech 2015; Dryden et al., "Communication Quantization for Data-Parallel Training
    of Deep Neural Networks", MLHPC 2016.
  """
  value = check_float("value", value)
  capacity = check_fraction("capacity", capacity)
  return _threshold_compressor(lambda flat, key: jnp.float32(value), capacity,
                               f"threshold({value:g}, capacity={capacity:g})")


def adaptive_threshold(density: float, *, capacity: float | None = None,
                       sample: float = 0.01) -> Compressor:
  """Threshold sparsification whose threshold targets a density, estimated from a sample (DGC).

  Each call draws ``m = max(1, ceil(sample * d))`` positions at random (with replacement, by
  hashing the ``encode`` key, :mod:`~jaxcomm.compress.hashing`) and takes as threshold the
  ``max(1, floor(density * m))``-th largest magnitude of the sample, so about ``density * d``
  elements pass. The payload has static
  capacity ``capacity * d`` (default ``2 * density``, capped at 1); elements that pass beyond it
  are left to the residual, as in :func:`threshold`.

  Properties: biased; no contraction ``delta > 0`` for every input (the estimate is random),
  ``||C(x) - x||^2 <= ||x||^2``; not linear. Use it with error feedback.

  Bytes: ``8 * max(1, ceil(capacity * d)) + 4``.

  Args:
    density: target fraction of elements sent, in (0, 1].
    capacity: the most elements sent, as a fraction of ``d`` in (0, 1]; at least ``density``.
    sample: fraction of elements sampled to estimate the threshold, in (0, 1].

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`ThresholdPayload` payloads.

  References:
    Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018.
  """
  density = check_fraction("density", density)
  sample = check_fraction("sample", sample)
  capacity = min(1.0, 2.0 * density) if capacity is None else check_fraction("capacity", capacity)
  if capacity < density:
    raise ValueError(f"capacity must be >= density={density:g}, got capacity={capacity:g}.")

  def threshold_of(flat: jax.Array, key: jax.Array) -> jax.Array:
    size = flat.shape[0]
    if size == 0:  # nothing to sample: no element passes
      return jnp.array(jnp.inf, jnp.float32)
    drawn = max(1, math.ceil(sample * size))
    positions = hash_bits(key, (drawn,)) % jnp.uint32(size)
    sampled = jax.lax.bitcast_convert_type(jnp.abs(flat[positions]), jnp.int32)
    rank = max(1, math.floor(density * drawn))
    return jax.lax.bitcast_convert_type(kth_largest_bits(sampled, rank), jnp.float32)

  return _threshold_compressor(threshold_of, capacity,
                               f"adaptive_threshold({density:g}, capacity={capacity:g})")
