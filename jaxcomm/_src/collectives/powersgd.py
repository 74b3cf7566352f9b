"""PowerSGD's two-round collective: dense inside a host, rank-r factors between hosts.

For ``G`` devices per host, ``H`` hosts and a gradient matrix ``M`` of ``m x n`` float32
(``D = 4 m n`` bytes), each device sends per step:

* fast axis: an all-reduce of the whole gradient, ``2 (G-1)/G D``;
* slow axis: all-reduces of ``P`` (``m x r``) and ``Q`` (``n x r``),
  ``2 (H-1)/H * 4 r (m + n)``.

All matrices of the same shape are stacked so each shape costs one collective per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.powersgd import (approximation_rows, as_rows, back_project_rows,
                                            orthogonalize, project_rows)
from jaxcomm._src.nonfinite import has_nonfinite, keep_if


class PowerSGDLeafState(NamedTuple):
  """State of one factorized gradient leaf.

  Attributes:
    q: float32 ``(n, r)``, the warm start, replicated (it is the all-reduced ``Q``).
    residual: float32, the leaf's shape: this host's unsent error (the same on every device
      of the host, different between hosts).
  """
  q: jax.Array
  residual: jax.Array


def powersgd_reduce(leaves: Sequence[jax.Array], states: Sequence[PowerSGDLeafState | tuple],
                    *, slow_axis: str, epsilon: float, feedback: bool):
  """One PowerSGD step over ``slow_axis`` for leaves already summed over the fast axis.

  Each host ``h`` holds ``M_h`` with ``sum_h M_h`` the target mean. Factorized leaves
  (``states[i]`` is a :class:`PowerSGDLeafState`): ``A = M_h + e_h``;
  ``P = orthogonalize(psum(A Q))``; ``Q' = psum(A^T P)``; output ``P Q'^T`` (the rank-r
  approximation of the mean); ``e_h' = A - P Q'^T / H`` (the averaged ``Q``: subtracting the
  summed one would remove ``H`` times too much). Other leaves (``states[i] == ()``) are
  ``psum``-ed dense.

  Returns:
    ``(outputs, new_states)``, outputs float32, identical on every device.
  """
  hosts = jax.lax.axis_size(slow_axis)
  outputs: list = [None] * len(leaves)
  new_states: list = list(states)
  groups: dict[tuple, list[int]] = {}
  for index, (leaf, state) in enumerate(zip(leaves, states)):
    if isinstance(state, PowerSGDLeafState):
      groups.setdefault((as_rows(leaf).shape, state.q.shape), []).append(index)
    else:
      outputs[index] = jax.lax.psum(leaf.astype(jnp.float32), slow_axis)
  for indices in groups.values():
    # Each matrix is held as ``M^T`` (:func:`as_rows`): no transposed copy is made.
    corrected = jnp.stack([
        as_rows(leaves[i].astype(jnp.float32))
        + (as_rows(states[i].residual) if feedback else 0.0) for i in indices])
    warm = jnp.stack([states[i].q for i in indices])
    p = jax.lax.psum(project_rows(corrected, warm), slow_axis)
    p = jax.vmap(lambda block: orthogonalize(block, epsilon))(p)
    q = jax.lax.psum(back_project_rows(corrected, p), slow_axis)
    approx = approximation_rows(p, q)
    alive = jnp.linalg.norm(q, axis=1, keepdims=True) > 0
    next_q = jnp.where(alive, q, warm)
    for slot, i in enumerate(indices):
      shape = leaves[i].shape
      outputs[i] = approx[slot].reshape(shape)
      residual = ((corrected[slot] - approx[slot] / hosts).reshape(shape) if feedback
                  else states[i].residual)
      # A non-finite gradient anywhere poisons the summed factors: keep the old state.
      new_states[i] = keep_if(has_nonfinite(approx[slot]), states[i],
                              PowerSGDLeafState(q=next_q[slot], residual=residual))
  return outputs, new_states
