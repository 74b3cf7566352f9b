"""Top-k sparsification by magnitude."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import chunks
from jaxcomm._src.compress.base import Compressor, num_elements, stateless_init
from jaxcomm._src.compress.cast import narrow
from jaxcomm._src.nonfinite import has_nonfinite
from jaxcomm._src.validation import (check_bool, check_dtype, check_fraction, check_int_range,
                                     renamed)
from jaxcomm._src.compress.select import largest_k

VALUE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class TopKPayload(NamedTuple):
  """The wire format of top-k: ``k`` values and their int32 flat indices.

  Attributes:
    values: shape ``(k,)``, the compressor's ``value_dtype``.
    indices: shape ``(k,)``, int32 positions in the flattened input.
  """
  values: jax.Array
  indices: jax.Array


def topk_count(shape: tuple[int, ...], density: float | None, k: int | None) -> int:
  """The static number of kept elements: ``max(1, floor(density * d))``, or ``min(k, d)``."""
  size = num_elements(shape)
  if k is not None:
    return min(k, size)
  return min(size, max(1, math.floor(density * size)))


class ChunkedTopKPayload(NamedTuple):
  """The wire format of chunked top-k: ``k_c`` values per chunk and uint16 in-chunk indices.

  Attributes:
    values: shape ``(chunks, k_c)``, the compressor's ``value_dtype``.
    indices: uint16 of shape ``(chunks, k_c)``: positions inside each chunk of at most
      65536 elements.
  """
  values: jax.Array
  indices: jax.Array


MAX_UINT16_CHUNK = 1 << 16


def scatter_sum(indices: jax.Array, values: jax.Array, size: int) -> jax.Array:
  """The sum of several sparse payloads' dense decodings: every value added at its index
  into one float32 zero buffer of ``size`` elements.

  Payloads gathered from ``n`` devices would otherwise be decoded into ``n`` zero buffers
  of ``size`` and summed (:func:`~jaxcomm.compress.sum_stacked`): ``n`` fresh buffers and a
  pass over them, where this writes one. Bit-identical to that sum for two payloads (a
  position in both gets ``v1 + v2`` either way, one in one ``0 + v``); for a single payload
  a ``-0.0`` value gives ``+0.0``; with three or more, a position kept by three or more
  devices may be added in another order (a rounding difference).

  Args:
    indices: int32 flat positions, any shape (e.g. ``(n, k)``).
    values: the values at those positions, ``indices``' shape, any float dtype.
    size: elements of the dense result.

  Returns:
    float32 of shape ``(size,)``.
  """
  return jnp.zeros(size, jnp.float32).at[indices.reshape(-1)].add(
      values.astype(jnp.float32).reshape(-1))


def kept_nonfinite(payload: TopKPayload | ChunkedTopKPayload) -> jax.Array:
  """The ``unsent_nonfinite`` of exact top-k: some kept value, as decoded, is NaN or Inf.

  That is exactly when ``x - decode(payload)`` holds one. NaN and Inf rank above every finite
  magnitude (in every chunk), so a non-finite input entry is kept whenever there is one, and
  its decoded value stays non-finite; a finite kept entry leaves a finite difference unless
  its value overflowed the value dtype (float16 above 65,504), which decodes to Inf. The
  approximate TPU selection may miss an entry, so it does not offer this.
  """
  return has_nonfinite(payload.values)


def select_largest(values: jax.Array, count: int, approximate: bool) -> jax.Array:
  """Indices of the ``count`` largest ``|values|`` on the last axis, in increasing order.

  Exact (:func:`~jaxcomm.compress.select.largest_k`, linear time) except with
  ``approximate`` on TPU, where ``jax.lax.approx_max_k`` is faster (in value order there).
  """
  if approximate and jax.default_backend() == "tpu":
    return jax.lax.approx_max_k(jnp.abs(values), count)[1]
  return largest_k(values, count, by_magnitude=True)


def topk(density: float | None = None, *, k: int | None = None,
         value_dtype: Any = jnp.float32, approximate: bool = False,
         chunk: int | None = None, fraction: float | None = None) -> Compressor:
  """Keeps the ``k`` largest-magnitude elements; all others are sent as zero.

  ``k = max(1, floor(density * d))`` for ``d`` elements (or the given ``k``, capped at ``d``),
  fixed at trace time so shapes are static under ``jit``. Ties in magnitude go to the lower
  index, so the choice is deterministic; the payload lists the kept elements in increasing
  index order. The selection is exact and takes linear time
  (:func:`~jaxcomm.compress.select.largest_k`: a threshold from a fixed sample, compaction of
  the candidates, an exact radix search among them, and ``jax.lax.top_k`` as the fallback
  when the sample misjudges), the same set ``jax.lax.top_k`` picks.

  Properties: biased; a delta-contraction with ``delta = k / d`` on every call,
  ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``; not linear (each device picks its own indices).
  Use it with :func:`~jaxcomm.error_feedback`.

  Bytes: ``k * (itemsize(value_dtype) + 4)``; ``8 k`` for float32 values.

  With ``approximate=True`` the selection uses ``jax.lax.approx_max_k`` (recall target 0.95)
  on TPU, where it is faster; the kept set may then miss some of the true top ``k``, so the
  contraction holds only with the recalled elements' energy. On other backends the exact
  selection is used.

  With ``chunk`` (at most 65536), the flat input is split into ``ceil(d / w)`` chunks of
  ``w = min(chunk, d)`` elements (the last one zero-padded), and each keeps its
  ``k_c = max(1, floor(density * w))`` largest, indexed by uint16 inside the chunk. Bytes
  ``ceil(d / w) * k_c * (itemsize(value_dtype) + 2)``: ``6`` per kept float32 value instead
  of ``8``. Contraction per chunk, hence overall, with ``delta = k_c / w``; needs ``density``.

  Args:
    density: fraction of elements to keep, in (0, 1]. Exactly one of ``density`` and ``k``.
    k: number of elements to keep, >= 1.
    value_dtype: dtype of the sent values: float32, bfloat16 or float16.
    approximate: on TPU, select with ``jax.lax.approx_max_k``.
    chunk: elements per chunk for uint16 indices, in ``[1, 65536]``; ``None`` for int32
      indices over the whole tensor.
    fraction: the former name of ``density`` (deprecated).

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`TopKPayload` payloads, or
    :class:`ChunkedTopKPayload` with ``chunk``.

  References:
    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
    Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
  """
  density = renamed("density", density, "fraction", fraction)
  if (density is None) == (k is None):
    raise ValueError(f"topk needs exactly one of density and k; got density={density!r}, k={k!r}.")
  if density is not None:
    density = check_fraction("density", density)
  else:
    k = check_int_range("k", k, 1)
  value_dtype = check_dtype("value_dtype", value_dtype, VALUE_DTYPES)
  approximate = check_bool("approximate", approximate)
  if chunk is not None:
    chunk = check_int_range("chunk", chunk, 1, MAX_UINT16_CHUNK)
    if density is None:
      raise ValueError(f"topk with chunk={chunk} needs density (kept per chunk), got k={k}.")
    return _chunked_topk(density, chunk, value_dtype, approximate)

  def encode(x: jax.Array, state, key: jax.Array):
    del key
    flat = x.reshape(-1).astype(jnp.float32)
    indices = select_largest(flat, topk_count(x.shape, density, k), approximate)
    return TopKPayload(narrow(flat[indices], value_dtype), indices.astype(jnp.int32)), state

  def decode(payload: TopKPayload, shape) -> jax.Array:
    dense = jnp.zeros(num_elements(shape), jnp.float32)
    return dense.at[payload.indices].set(payload.values.astype(jnp.float32)).reshape(shape)

  def decode_sum(payloads: TopKPayload, shape) -> jax.Array:
    return scatter_sum(payloads.indices, payloads.values, num_elements(shape)).reshape(shape)

  def subtract_decoded(x: jax.Array, payload: TopKPayload) -> jax.Array:
    # x + (-v) rounds as x - v, and every other entry is x - 0 = x: decode's zeros and the
    # subtraction are two passes over x that this scatter of k values does not make.
    negated = -payload.values.astype(jnp.float32)
    return x.reshape(-1).at[payload.indices].add(negated).reshape(x.shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    return topk_count(tuple(shape), density, k) * (value_dtype.itemsize + 4)

  amount = f"{density:g}" if density is not None else f"k={k}"
  suffix = ", approximate" if approximate else ""
  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=False, name=f"topk({amount}{suffix})",
                    decode_sum=decode_sum, subtract_decoded=subtract_decoded,
                    unsent_nonfinite=None if approximate else kept_nonfinite)


def _chunked_topk(density: float, chunk: int, value_dtype: jnp.dtype,
                  approximate: bool) -> Compressor:

  def layout(size: int) -> tuple[int, int, int]:
    # A tensor smaller than one chunk is one chunk of its own size, not a padded 64K one.
    width = min(chunk, max(size, 1))
    return chunks.chunk_count(size, width), width, max(1, math.floor(density * width))

  def encode(x: jax.Array, state, key: jax.Array):
    del key
    _, width, kept = layout(x.size)
    rows = chunks.to_chunks(x.reshape(-1).astype(jnp.float32), width)
    indices = select_largest(rows, kept, approximate)
    values = jnp.take_along_axis(rows, indices, axis=1)
    return ChunkedTopKPayload(narrow(values, value_dtype), indices.astype(jnp.uint16)), state

  def flat_indices(payload: ChunkedTopKPayload, count: int, width: int) -> jax.Array:
    # Padding positions of the last chunk may be selected (as zeros); they fall past `size`.
    return jnp.arange(count, dtype=jnp.int32)[:, None] * width + payload.indices.astype(jnp.int32)

  def decode(payload: ChunkedTopKPayload, shape) -> jax.Array:
    size = num_elements(shape)
    count, width, _ = layout(size)
    dense = jnp.zeros(count * width, jnp.float32)
    dense = dense.at[flat_indices(payload, count, width).reshape(-1)].set(
        payload.values.astype(jnp.float32).reshape(-1))
    return dense[:size].reshape(shape)

  def decode_sum(payloads: ChunkedTopKPayload, shape) -> jax.Array:
    size = num_elements(shape)
    count, width, _ = layout(size)
    return scatter_sum(flat_indices(payloads, count, width), payloads.values,
                       count * width)[:size].reshape(shape)

  def subtract_decoded(x: jax.Array, payload: ChunkedTopKPayload) -> jax.Array:
    # As top-k's: k_c values scattered into x instead of decode's zeros and a subtraction;
    # selected padding positions lie past x's end and are dropped.
    count, width, _ = layout(x.size)
    negated = -payload.values.astype(jnp.float32).reshape(-1)
    return x.reshape(-1).at[flat_indices(payload, count, width).reshape(-1)].add(
        negated, mode="drop").reshape(x.shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    count, _, kept = layout(num_elements(shape))
    return count * kept * (value_dtype.itemsize + 2)

  suffix = ", approximate" if approximate else ""
  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=False,
                    name=f"topk({density:g}, chunk={chunk}{suffix})", decode_sum=decode_sum,
                    subtract_decoded=subtract_decoded,
                    unsent_nonfinite=None if approximate else kept_nonfinite)
