"""PowerSGD's two-round collective: row blocks inside a host, rank-r factors between hosts.

A factorized leaf is held as ``M^T`` (:func:`~jaxcomm.compress.powersgd.as_rows`, ``n x m``
float32, ``n`` padded with zero rows to ``n' = G c``, ``c = ceil(n / G)``, ``D' = 4 n' m``
bytes). Each of a host's ``G`` devices holds one block of ``c`` rows of the host's sum and
does the power iteration's work on that block only. For ``H`` hosts each device sends per step
and factorized leaf:

* fast axis: a reduce-scatter of the gradient, ``(G-1)/G D'``; an all-reduce of its part of
  ``P``, ``2 (G-1)/G 4 r m``; an all-reduce of ``r`` floats (``Q``'s squared column norms,
  which also tell a non-finite step), ``2 (G-1)/G 4 r``; an all-gather of the approximation,
  ``(G-1)/G D'``;
* slow axis: all-reduces of ``P`` (``m x r``) and of this device's block of ``Q``
  (``c x r``), ``2 (H-1)/H * 4 r (m + c)``.

Leaves sent dense are all-reduced over the fast axis, then over the slow one. All matrices of
the same shape are stacked, every leaf's ``P`` (with the dense leaves' sums) crosses the slow
axis in one all-reduce and every leaf's ``Q`` in another (:func:`psum_together`), every
``P`` is held as ``P^T`` (``r x m``) and all of them are orthogonalized in one zero-padded
batch (:func:`orthogonalize_batched`), and every leaf's state check crosses the fast axis in
one all-reduce (:func:`column_norms`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.compress.powersgd import (approximation_rows_t, as_rows, back_project_rows_t,
                                            orthogonalize_t, project_rows_t)
from jaxcomm._src.nonfinite import keep_if


class PowerSGDLeafState(NamedTuple):
  """State of one factorized gradient leaf: this device's block of ``c`` rows of ``M^T``.

  Attributes:
    q: float32 ``(c, r)``: this device's rows of the warm start ``Q`` (its block of the
      all-reduced ``Q``), varying over the fast axis, the same on every host.
    residual: float32 ``(c, m)``: this device's rows of its host's unsent error.
  """
  q: jax.Array
  residual: jax.Array


def block_rows(rows: int, devices: int) -> int:
  """``c = ceil(n / G)``: the rows of ``M^T`` each of ``G`` devices holds."""
  return math.ceil(rows / devices)


def pad_rows(rows: jax.Array, devices: int) -> jax.Array:
  """``rows`` (``n x k``) with zero rows appended up to ``G c`` rows, ``G = devices`` (a copy
  only where ``G`` does not divide ``n``)."""
  padded = devices * block_rows(rows.shape[0], devices)
  if padded == rows.shape[0]:
    return rows
  return jnp.pad(rows, ((0, padded - rows.shape[0]), (0, 0)))


def row_block(leaf: jax.Array, fast_axis: str) -> jax.Array:
  """This device's ``(c, m)`` block of ``psum(as_rows(leaf), fast_axis)``: one reduce-scatter
  of the rows padded by :func:`pad_rows`."""
  rows = pad_rows(as_rows(leaf), jax.lax.axis_size(fast_axis))
  return jax.lax.psum_scatter(rows, fast_axis, scatter_dimension=0, tiled=True)


def gather_rows(block: jax.Array, shape: tuple[int, ...], fast_axis: str) -> jax.Array:
  """Inverse of :func:`row_block`'s scatter: all-gathers the ``(c, m)`` blocks over
  ``fast_axis`` and returns the leaf of ``shape``, identical on the axis's devices."""
  rows = jax.lax.all_gather(block, fast_axis, tiled=True, to="invarying")
  return rows[:math.prod(shape[:-1])].reshape(shape)


def powersgd_reduce(blocks: Sequence[jax.Array], states: Sequence[PowerSGDLeafState | tuple],
                    shapes: Sequence[tuple[int, ...]], *, fast_axis: str, slow_axis: str,
                    epsilon: float, feedback: bool):
  """One PowerSGD step over ``slow_axis``, each device working on its block of rows.

  Each host ``h`` holds ``M_h`` with ``sum_h M_h`` the target mean; for a factorized leaf
  (``states[i]`` is a :class:`PowerSGDLeafState`) ``blocks[i]`` is this device's ``(c, m)``
  block ``M_{h,g}^T`` of its rows (:func:`row_block`), else it is the leaf's host sum. With
  ``A_g = M_{h,g}^T + e_{h,g}``: ``P = orthogonalize(psum_fast,slow(A_g^T Q_g))`` (``M Q``
  summed over row blocks and hosts); ``Q'_g = psum_slow(A_g P)``; the output's rows
  ``Q'_g P^T`` are all-gathered over ``fast_axis``; ``e_{h,g}' = A_g - Q'_g P^T / H`` (the
  averaged ``Q``). That is PowerSGD on the whole matrix up to float rounding. Other leaves
  are ``psum``-ed dense over ``slow_axis``.

  Args:
    blocks: per leaf, the row block (factorized) or the host sum (dense).
    states: per leaf, its :class:`PowerSGDLeafState` or ``()``.
    shapes: per leaf, its shape.
    fast_axis: the axis the row blocks are spread over.
    slow_axis: the axis the factors are summed over.
    epsilon: added to column norms in :func:`~jaxcomm.compress.powersgd.orthogonalize`.
    feedback: update the residuals (else they stay as they are).

  Returns:
    ``(outputs, new_states)``, outputs float32 of the leaves' shapes, identical on every device.
  """
  outputs: list = [None] * len(blocks)
  new_states: list = list(states)
  groups: dict[tuple, list[int]] = {}
  dense = []
  for index, (block, state) in enumerate(zip(blocks, states)):
    if isinstance(state, PowerSGDLeafState):
      groups.setdefault((block.shape, state.q.shape), []).append(index)
    else:
      dense.append(index)
  corrected = [jnp.stack([blocks[i].astype(jnp.float32) + (states[i].residual if feedback else 0.0)
                          for i in indices]) for indices in groups.values()]
  warm = [jnp.stack([states[i].q for i in indices]) for indices in groups.values()]
  sums = psum_together([jax.lax.psum(project_rows_t(rows, q), fast_axis)
                        for rows, q in zip(corrected, warm)]
                       + [blocks[i].astype(jnp.float32) for i in dense], slow_axis)
  for i, total in zip(dense, sums[len(groups):]):
    outputs[i] = total
  ps = orthogonalize_batched(sums[:len(groups)], epsilon)
  qs = psum_together([back_project_rows_t(rows, p) for rows, p in zip(corrected, ps)], slow_axis)
  totals = jax.lax.psum(column_norms(qs), fast_axis) if qs else []
  ends = np.cumsum([q.shape[0] for q in qs])
  for indices, rows, q, p, summed, end in zip(groups.values(), corrected, warm, ps, qs, ends):
    approx, group_states = _factor_group(rows, q, p, summed, totals[end - len(indices):end],
                                         [states[i] for i in indices], slow_axis=slow_axis,
                                         feedback=feedback)
    for slot, i in enumerate(indices):
      outputs[i] = gather_rows(approx[slot], shapes[i], fast_axis)
      new_states[i] = group_states[slot]
  return outputs, new_states


def psum_together(arrays: Sequence[jax.Array], axis: str) -> list[jax.Array]:
  """``[psum(x, axis) for x in arrays]`` (float32) as one all-reduce of their concatenation,
  so every array crosses ``axis`` in one rendezvous whatever XLA's all-reduce combiner makes
  of separate ones (it paired the embedding's ``Q`` with the other leaves' ``P``, a second
  slow-axis round in series). Each entry is the same sum of the same terms: equal bit for bit."""
  if not arrays:
    return []
  total = jax.lax.psum(jnp.concatenate([x.reshape(-1) for x in arrays]), axis)
  ends = np.cumsum([x.size for x in arrays])
  return [total[end - x.size:end].reshape(x.shape) for x, end in zip(arrays, ends)]


def orthogonalize_batched(factors: Sequence[jax.Array], epsilon: float) -> list[jax.Array]:
  """:func:`~jaxcomm.compress.powersgd.orthogonalize_t` of each ``(k, r, m)`` stack of
  ``P^T``s, all of them in one batch: each is zero-padded to the largest ``m`` (zero entries
  change no dot product or norm in exact arithmetic, and stay zero), so the step runs one
  Gram-Schmidt, whose ``r (r + 1) / 2`` reductions XLA's CPU backend runs as two to three
  small kernels each, whatever the leaves' shapes. Equal to each stack's own Gram-Schmidt up to
  the order of each reduction's sum (see tests/compress/test_powersgd_orthogonalize.py)."""
  if not factors:
    return []
  width = max(factor.shape[-1] for factor in factors)
  batch = orthogonalize_t(jnp.concatenate([
      jnp.pad(factor, ((0, 0), (0, 0), (0, width - factor.shape[-1]))) for factor in factors]),
      epsilon)
  ends = np.cumsum([factor.shape[0] for factor in factors])
  return [batch[end - factor.shape[0]:end, :, :factor.shape[-1]]
          for factor, end in zip(factors, ends)]


def column_norms(qs: Sequence[jax.Array]) -> jax.Array:
  """The squared column norms of every leaf's ``Q`` block, ``(leaves, r)`` from the stacks
  ``qs`` (``(k, c, r)`` each, one ``r``): each stack's own reduction, side by side, so that
  one all-reduce carries them all (a NaN or Inf in one leaf's rows stays in its own row)."""
  return jnp.concatenate([jnp.sum(q * q, axis=1) for q in qs])


def _factor_group(corrected, warm, p, q, totals, states, *, slow_axis: str, feedback: bool):
  """:func:`powersgd_reduce` for the stacked row blocks ``corrected`` (``(k, c, m)``, residual
  added) of same-shaped leaves, their warm starts ``(k, c, r)``, orthogonalized ``P^T``
  (``(k, r, m)``), ``Q = psum_slow(A_g P)`` (``(k, c, r)``) and ``Q``'s squared column norms
  summed over the host's row blocks (``(k, r)``, :func:`column_norms`): the rows of the
  approximation ``(k, c, m)`` and the new states."""
  approx = approximation_rows_t(p, q)
  # Q's squared column norms, summed over the host's row blocks (one all-reduce), also say
  # whether the step was bad, with no pass over the approximation: a NaN or Inf in any
  # device's block or residual makes its rows of P = sum A_g^T Q_g non-finite (NaN * x and
  # Inf * 0 are NaN, Inf * x is +-Inf, and a sum with a NaN or Inf is not finite), P is summed
  # over every device, Gram-Schmidt spreads it to every column, and Q = A_g P takes it into
  # every device's rows; the norms then are NaN or Inf. Non-finite norms with finite
  # entries take |Q| above ~1.8e19, where the approximation Q P^T (|P| <= 1) is within a
  # factor r of overflowing too.
  next_q = jnp.where(totals[:, None, :] > 0, q, warm)
  bad = ~jnp.all(jnp.isfinite(totals), axis=1)
  hosts = jax.lax.axis_size(slow_axis)
  new_states = []
  for slot, state in enumerate(states):
    residual = corrected[slot] - approx[slot] / hosts if feedback else state.residual
    new_states.append(keep_if(bad[slot], state,
                              PowerSGDLeafState(q=next_q[slot], residual=residual)))
  return approx, new_states
