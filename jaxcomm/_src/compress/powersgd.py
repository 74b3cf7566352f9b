"""PowerSGD, compressor side: rank-r factors from one warm-started power iteration.

The method on ``p`` devices, per matrix ``M`` (``m x n``) with warm-start ``Q`` (``n x r``):
``P = M Q``; ``P = psum(P) / p``; ``P = orthogonalize(P)``; ``Q = M^T P``;
``Q = psum(Q) / p``; output ``P Q^T``; residual ``M - P Q^T`` with the *averaged* ``Q``.
:func:`project`, :func:`orthogonalize` and :func:`back_project` are those steps, for a
collective that puts the two ``psum`` in between. :func:`powersgd` is the same iteration on
one device's matrix, as a :class:`~jaxcomm.Compressor` (a payload of both factors), for
gather-based collectives and for error feedback.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress import backends
from jaxcomm._src.compress.base import Compressor, num_elements
from jaxcomm._src.keys import as_key, check_seed
from jaxcomm._src.validation import check_float, check_int_range


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd` for a tensor sent as factors.

  Attributes:
    q: float32 of shape ``(n, rank)``: the warm start of the next power iteration, the same on
      every device at ``init`` (drawn from the shared ``seed``).
  """
  q: jax.Array


class PowerSGDPayload(NamedTuple):
  """The wire format of PowerSGD: two rank-r factors, ``M ~= p @ q.T``.

  Attributes:
    p: float32 of shape ``(m, rank)``, orthogonalized columns.
    q: float32 of shape ``(n, rank)``: ``M^T p``.
  """
  p: jax.Array
  q: jax.Array


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(m, n) = (out, rest)``: the last axis (flax's output features / conv output channels)
  against all others, so a conv kernel ``(h, w, in, out)`` becomes ``(out, h * w * in)``."""
  return shape[-1], num_elements(shape[:-1])


def to_matrix(x: jax.Array) -> jax.Array:
  """The ``(out, rest)`` matrix view of a tensor with at least 2 dimensions."""
  return jnp.moveaxis(x, -1, 0).reshape(matrix_shape(x.shape))


def from_matrix(matrix: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`to_matrix`."""
  return jnp.moveaxis(matrix.reshape((shape[-1],) + tuple(shape[:-1])), 0, -1)


def compression_rate(shape: tuple[int, ...], rank: int) -> float:
  """``m n / (r (m + n))``: dense bytes over factor bytes (0 for tensors below 2-D)."""
  if len(shape) < 2:
    return 0.0
  m, n = matrix_shape(shape)
  return m * n / (rank * (m + n)) if m * n else 0.0


def as_rows(x: jax.Array) -> jax.Array:
  """``to_matrix(x).T`` without moving data: ``x`` reshaped to ``(rest, out)``.

  The ``_rows`` functions below take ``M`` in this layout and contract its axes directly, so
  no transposed copy of a gradient is made (XLA's CPU backend transposes far below memory
  speed); their results are those of :func:`project`, :func:`back_project` and ``P Q^T``.
  """
  return x.reshape(-1, x.shape[-1])


# Every product here is float32 at full precision. On GPUs jax's default float32 product is
# TF32 (an 11-bit significand, about 1e-3 relative error): on an H200 it broke the projection
# tests at 1e-4 (session 15). The products are r wide and bound by reading M, so this costs
# next to nothing; XLA's CPU backend computes float32 products in float32 either way.
PRECISION = jax.lax.Precision.HIGHEST
# Rows of ``M^T`` up to which :func:`project_rows` adds rank-1 terms instead of a GEMM.
RANK_ONE_ROWS = 128


def project_rows(rows: jax.Array, q: jax.Array) -> jax.Array:
  """``P = M Q`` from ``rows = M^T`` of shape ``(..., n, m)``: shape ``(..., m, r)``; the
  transpose of :func:`project_rows_t`."""
  return jnp.swapaxes(project_rows_t(rows, q), -1, -2)


def project_rows_t(rows: jax.Array, q: jax.Array) -> jax.Array:
  """``P^T = Q^T M`` from ``rows = M^T`` of shape ``(..., n, m)``: shape ``(..., r, m)``.

  The ``_t`` functions hold ``P`` as ``P^T``, one row per column of ``P`` with ``m`` the minor
  axis, which is the layout every step after the projection reads it in: the projection
  computes it so (no transposed copy), :func:`orthogonalize_t` reduces along the minor axis,
  and the products contract it as it lies.

  Up to ``RANK_ONE_ROWS`` rows (the collective's row blocks of small models) it is
  :func:`rank_one_sum`, the product's sums in its order (bit for bit on charlm's blocks);
  more rows run the product ``Q^T M`` itself, whose output has ``m`` as its minor axis. (Its
  transposed form ``M^T Q``, ``rows``' leading axis contracted into an ``(m, r)`` output,
  once ran at about 1.2 GB/s on XLA's CPU backend, which is why row counts that are
  multiples of 256 were summed over blocks of 256 rows until session 20; on jax 0.10.2 the
  product is faster than those blocks: 4096 x 4096, ``r = 4``, 4.3 -> 3.2 ms of CPU, and
  bit for bit the plain product every other ``n`` ran.)
  """
  if rows.shape[-2] <= RANK_ONE_ROWS:
    return rank_one_sum(rows, q)
  return jnp.einsum("...kr,...ko->...ro", q, rows, precision=PRECISION)


def rank_one_sum(rows: jax.Array, q: jax.Array) -> jax.Array:
  """``(M Q)^T`` (shape ``(..., r, m)``) from ``rows = M^T`` (``(..., n, m)``) as ``n`` outer
  products ``q_k rows_k^T`` added in the order ``k = 0 .. n-1``, in one loop fusion.

  XLA's CPU backend runs the einsum of :func:`project_rows` as an Eigen GEMM that packs the
  transposed ``rows`` for a product only ``r`` wide. Its sums are one fused multiply-add per
  ``k`` in this order, which is what LLVM makes of ``product + total`` (``total + product``
  fuses the wrong term of the first sum), so the result is the same bit for bit on charlm's
  row blocks, ``r = 4``, in 9 -> 5 us (``(64, 16)``), 27 -> 14 us (``(64, 256)``) and
  57 -> 24 us (``(128, 256)``) on one device. Elsewhere equal up to rounding (the GEMM splits
  its sums otherwise for a wide ``m``, e.g. ``(128, 4096)``). The HLO grows with ``n``: 128
  rows add about 0.3 s of compile time.
  """
  total = q[..., 0, :, None] * rows[..., 0, None, :]
  for k in range(1, rows.shape[-2]):
    total = q[..., k, :, None] * rows[..., k, None, :] + total
  return total


def back_project_rows(rows: jax.Array, p: jax.Array) -> jax.Array:
  """``Q = M^T P`` from ``rows = M^T``: shape ``(..., n, r)``."""
  return jnp.einsum("...ko,...or->...kr", rows, p, precision=PRECISION)


def back_project_rows_t(rows: jax.Array, pt: jax.Array) -> jax.Array:
  """:func:`back_project_rows` from ``pt = P^T`` (``(..., r, m)``): ``Q``, ``(..., n, r)``."""
  return jnp.einsum("...ko,...ro->...kr", rows, pt, precision=PRECISION)


def approximation_rows_t(pt: jax.Array, q: jax.Array) -> jax.Array:
  """``(P Q^T)^T = Q P^T`` from ``pt = P^T`` (``(..., r, m)``), the rank-r approximation in
  the ``rows`` layout: ``(..., n, m)``."""
  return jnp.einsum("...kr,...ro->...ko", q, pt, precision=PRECISION)


def outer_sum_rows(p: jax.Array, q: jax.Array) -> jax.Array:
  """``Q P^T`` (``(n, m)`` from ``p`` ``(m, r)`` and ``q`` ``(n, r)``) as
  ``r`` outer products added elementwise, the decode of :func:`powersgd`: XLA fuses it into
  its consumer, so error feedback's ``x - P Q^T`` (:func:`subtract_decoded_rows`, the same
  expression, bit for bit) is one pass over ``x`` with no ``n x m`` product (a 4096 x 4096
  ``M``, ``r = 4``: 69 -> 42 ms of CPU against the product and a subtraction). Equal to
  :func:`approximation_rows_t` of ``p^T`` up to float rounding. :func:`outer_sum_rows_t` of
  ``p``'s transpose."""
  return outer_sum_rows_t(p.T, q)


def outer_sum_rows_t(pt: jax.Array, q: jax.Array) -> jax.Array:
  """:func:`outer_sum_rows` from ``pt = P^T`` (``(r, m)``): the sum of ``q[:, c] pt[c]``
  over ``c = 0 .. r-1`` in that order, each element reading ``pt``'s column ``o`` along
  its minor axis. Given a ``pt`` laid out so (a loop's operand), XLA's CPU backend
  vectorizes the sum, where ``p``'s column (stride ``r``) it did not: 4096 x 4096, ``r = 4``,
  ``rows - Q P^T``: about 7.5 -> 5.1 ms of CPU, the same bits."""
  total = q[:, None, 0] * pt[None, 0, :]
  for column in range(1, q.shape[-1]):
    total = total + q[:, None, column] * pt[None, column, :]
  return total


# Float32 elements per row block (4 MiB) of :func:`subtract_outer_sum_rows`' in-place loop.
SUBTRACT_BLOCK = 1 << 20


def subtract_outer_sum_rows(rows: jax.Array, p: jax.Array, q: jax.Array) -> jax.Array:
  """``rows - outer_sum_rows(p, q)``, the same bits, written over ``rows`` in row blocks.

  Error feedback's residual has two consumers, its NaN check (a reduction that XLA's CPU
  backend runs as an XNNPACK fusion, which fuses no producer) and the select that keeps it,
  so XLA materializes it, and as one expression into a fresh temporary of ``rows``' size: a
  buffer the CPU runtime maps and page-faults anew on every call (64 MiB at 16M float32,
  more CPU time than the subtraction itself). A loop of dynamic-update-slices over blocks
  of ``SUBTRACT_BLOCK`` elements updates a buffer in place instead: ``rows``' own where
  nothing reads ``rows`` afterwards (error feedback's corrected input, itself written over
  the donated gradient). At 16M elements, ``r = 4``, ``ef(powersgd(4))``'s encode went from
  a 64 MiB temporary to 1 MiB and about 75 -> 34 ms of CPU. The loop reads ``P^T``, made
  once before it (:func:`outer_sum_rows_t`; the loop alone 7.6 -> 5.1 ms of CPU at 16M,
  session 20). Matrices of fewer than two blocks take the plain expression (no measurable
  difference there). For the CPU only (:func:`subtract_decoded_rows`): accelerators'
  allocators reuse their memory, and each step of a loop there is a kernel launch.
  """
  n, m = rows.shape
  block = max(1, SUBTRACT_BLOCK // m)
  if n < 2 * block:
    return rows - outer_sum_rows(p, q)

  pt = p.T

  def subtract_block(index, rows):
    start = index * block
    part = jax.lax.dynamic_slice_in_dim(rows, start, block)
    q_part = jax.lax.dynamic_slice_in_dim(q, start, block)
    return jax.lax.dynamic_update_slice_in_dim(rows, part - outer_sum_rows_t(pt, q_part),
                                               start, 0)

  full = n // block * block
  rows = jax.lax.fori_loop(0, n // block, subtract_block, rows)
  if full == n:
    return rows
  tail = rows[full:] - outer_sum_rows_t(pt, q[full:])
  return jax.lax.dynamic_update_slice_in_dim(rows, tail, full, 0)


def subtract_decoded_rows(rows: jax.Array, p: jax.Array, q: jax.Array) -> jax.Array:
  """``rows - outer_sum_rows(p, q)``: :func:`subtract_outer_sum_rows` on the CPU, the plain
  expression on accelerators (the same bits on each)."""
  return backends.by_platform(subtract_outer_sum_rows,
                              lambda rows, p, q: rows - outer_sum_rows(p, q), rows, p, q)


def project(matrix: jax.Array, q: jax.Array) -> jax.Array:
  """``P = M Q``: shape ``(m, r)``. Average it over devices (``psum / p``), then orthogonalize."""
  return jnp.matmul(matrix, q, precision=PRECISION)


def back_project(matrix: jax.Array, p: jax.Array) -> jax.Array:
  """``Q = M^T P``: shape ``(n, r)``, with ``P`` orthogonalized. Average it over devices next."""
  return jnp.matmul(matrix.T, p, precision=PRECISION)


def orthogonalize(p: jax.Array, epsilon: float = 1e-8) -> jax.Array:
  """Gram-Schmidt on the columns of ``p`` (shape ``(..., m, r)``, leading axes a batch of
  matrices), dividing by ``norm + epsilon``.

  The epsilon keeps a rank-deficient ``p`` finite: a zero column stays zero instead of
  becoming NaN (a dependent column keeps only rounding noise, scaled to norm at most 1). Every
  column has norm at most 1 and the columns are orthogonal, so ``p p^T`` is a contraction and
  ``||M - p p^T M|| <= ||M||``. A NaN or Inf in ``p`` leaves a NaN or Inf in the result.
  Computed as :func:`orthogonalize_t` of ``p``'s transpose.
  """
  return jnp.swapaxes(orthogonalize_t(jnp.swapaxes(p, -1, -2), epsilon), -1, -2)


def orthogonalize_t(pt: jax.Array, epsilon: float = 1e-8) -> jax.Array:
  """:func:`orthogonalize` in the transposed layout: Gram-Schmidt on the rows of
  ``pt = P^T`` (shape ``(..., r, m)``), each divided by ``norm + epsilon``.

  Row ``i`` loses ``<q_j, v_i> q_j`` for ``j = 0 .. i-1`` (``v_i`` updated as it goes), then
  is normalized: the column-by-column order of the classic form, with every reduction along
  the minor axis ``m``. The right-looking order (each normalized row's overlaps with all
  later rows in one reduction, ``2 r - 1`` reductions instead of ``r (r + 1) / 2``) was
  tried and dropped: XLA recomputed a row's cancelling difference in the norm's fusion and
  in the division's with different rounding, so a dependent row's noise came out with norms
  up to 4 (tests/compress/test_powersgd_orthogonalize.py). Zero-padding ``m`` (extra zero
  entries in every row) changes no dot product or norm in exact arithmetic and leaves the
  padded entries zero.
  """
  done = []
  for index in range(pt.shape[-2]):
    row = pt[..., index, :]
    for previous in done:
      overlap = jnp.einsum("...m,...m->...", previous, row, precision=PRECISION)
      row = row - overlap[..., None] * previous
    done.append(row / (jnp.linalg.norm(row, axis=-1, keepdims=True) + epsilon))
  return jnp.stack(done, axis=-2)


def initial_q(key: jax.Array, shape: tuple[int, ...], rank: int) -> jax.Array:
  """The first warm start, standard normal ``(n, rank)`` drawn from ``key``: identical on
  every device (shared key); different ``Q`` per device would break the averaged power
  iteration."""
  _, n = matrix_shape(shape)
  return jax.random.normal(key, (n, rank), jnp.float32)


class PowerSGDMethod(NamedTuple):
  """The static parameters of :func:`powersgd` (its ``Compressor.matrix_method``), from which
  ``compressed_allreduce`` builds PowerSGD's two-round collective."""
  rank: int
  min_compression_rate: float
  epsilon: float
  seed: int | jax.Array


def powersgd(rank: int = 1, *, min_compression_rate: float = 2.0, epsilon: float = 1e-8,
             seed: int | jax.Array = 0) -> Compressor:
  """PowerSGD's rank-``r`` approximation of one device's gradient matrix.

  A tensor with at least 2 dimensions whose rate ``m n / (r (m + n))`` reaches
  ``min_compression_rate`` is viewed as the ``(out, rest)`` matrix ``M`` (:func:`to_matrix`)
  and sent as ``P = orthogonalize(M Q)`` and ``Q' = M^T P``, decoded as ``P Q'^T``. ``Q'`` is
  the warm start of the next call (a column that came out zero, e.g. from a zero gradient,
  keeps its previous value so later calls can still find a subspace). Other tensors (1-D,
  biases, small matrices) are sent dense as float32.

  Properties: biased; ``P P^T`` is an orthogonal projection (up to epsilon), so
  ``||C(M) - M||^2 = ||M||^2 - ||P^T M||^2 <= ||M||^2`` (no ``delta > 0`` holds for every input:
  it depends on how close the warm start is to ``M``'s top subspace). Not linear as a
  one-device compressor; the method's linearity (``psum`` of ``P`` and of ``Q``) needs the
  steps :func:`project` / :func:`orthogonalize` / :func:`back_project` with the collective
  in between. Use it with error feedback.

  Bytes: ``4 r (m + n)`` for factorized tensors, ``4 d`` for those sent dense.

  Args:
    rank: ``r``, >= 1.
    min_compression_rate: tensors whose rate is below it are sent dense; > 0.
    epsilon: added to column norms in :func:`orthogonalize`; >= 0.
    seed: int seed or PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``) of the
      initial ``Q``; the same on every device.

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`PowerSGDPayload` payloads and
    :class:`PowerSGDState` state for factorized tensors; float32 ``(d,)`` payloads and
    ``()`` state for dense ones.

  References:
    Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", NeurIPS 2019.
  """
  rank = check_int_range("rank", rank, 1)
  min_compression_rate = check_float("min_compression_rate", min_compression_rate)
  epsilon = check_float("epsilon", epsilon, inclusive=True)
  seed = check_seed("seed", seed)

  def factorized(shape) -> bool:
    return compression_rate(tuple(shape), rank) >= min_compression_rate

  def init(shape, dtype):
    del dtype
    return PowerSGDState(initial_q(as_key(seed), tuple(shape), rank)) if factorized(shape) else ()

  def encode(x: jax.Array, state, key: jax.Array):
    del key
    if not factorized(x.shape):
      return x.reshape(-1).astype(jnp.float32), state
    rows = as_rows(x.astype(jnp.float32))
    p = orthogonalize(project_rows(rows, state.q), epsilon)
    q = back_project_rows(rows, p)
    alive = jnp.linalg.norm(q, axis=0) > 0
    return PowerSGDPayload(p, q), PowerSGDState(jnp.where(alive, q, state.q))

  def decode(payload, shape) -> jax.Array:
    if not factorized(shape):
      return payload.reshape(shape)
    return outer_sum_rows(payload.p, payload.q).reshape(shape)

  def subtract_decoded(x: jax.Array, payload) -> jax.Array:
    if not factorized(x.shape):
      return x - payload.reshape(x.shape)
    return subtract_decoded_rows(as_rows(x), payload.p, payload.q).reshape(x.shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    if not factorized(shape):
      return 4 * num_elements(shape)
    m, n = matrix_shape(tuple(shape))
    return 4 * rank * (m + n)

  return Compressor(init=init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=False, name=f"powersgd({rank})",
                    matrix_method=PowerSGDMethod(rank, min_compression_rate, epsilon, seed),
                    subtract_decoded=subtract_decoded)
