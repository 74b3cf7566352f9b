"""Megatron-style sequence parallelism: move activations between sequence and tensor sharding.

In a tensor-parallel block the layer norms, dropout and residual adds are replicated over the
tensor-parallel axis. Sequence parallelism shards those activations along the sequence
instead, with the same communication volume as plain tensor parallelism:

* before a column-parallel linear, ``gather_sequence``: all-gather the sequence (backward:
  reduce-scatter the partial input gradients of the column shards);
* after a row-parallel linear, whose per-device products are partial sums over its shard of
  the inner dimension, ``reduce_scatter_sequence``: sum and scatter along the sequence in one
  reduce-scatter (backward: all-gather).
* where a replicated activation enters the sequence-parallel region and no partial sums are
  involved (embeddings, weights replicated over the axis), a reduce-scatter would multiply by
  ``T``: ``split_sequence`` keeps the local slice (backward: all-gather).

For a ``(B, S, E)`` activation and ``T`` devices on the axis, every all-gather and every
reduce-scatter moves ``B * (S/T) * E * itemsize * (T-1)`` bytes per device in each direction
(ring algorithm), versus ``2 *`` that for the all-reduce of tensor parallelism alone.

All three are called inside ``jax.shard_map`` over ``axis_name``. The gradients of gather and
reduce-scatter are JAX's own transposes (``all_gather`` <-> ``psum_scatter``); the slice has a
custom VJP because its automatic one would all-reduce a zero-padded full-length cotangent.

References:
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  https://arxiv.org/abs/2205.05198
"""

from __future__ import annotations

import functools

import jax

from jaxcomm._src.parallel import _checks


def gather_sequence(x: jax.Array, axis_name: str, *, axis: int = 1) -> jax.Array:
  """All-gathers the sequence shards: ``(B, S/T, E) -> (B, S, E)``, before a column linear.

  Backward: reduce-scatter (``psum_scatter``) of the cotangent along ``axis``, which sums the
  partial input gradients of the column shards and leaves each device its sequence slice.

  Args:
    x: the local sequence shard.
    axis_name: the tensor/sequence-parallel mesh axis.
    axis: the sequence axis of ``x``.

  Returns:
    The full sequence, the same on every device (typed as varying over ``axis_name``).
  """
  _checks.bound_axis_size(axis_name)
  return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def reduce_scatter_sequence(x: jax.Array, axis_name: str, *, axis: int = 1) -> jax.Array:
  """Sums partial results over the axis and scatters the sequence: ``(B, S, E) -> (B, S/T, E)``.

  Use after a row-parallel linear. Backward: all-gather of the cotangent along ``axis``.

  Args:
    x: this device's partial sum over the full sequence.
    axis_name: the tensor/sequence-parallel mesh axis.
    axis: the sequence axis of ``x``.

  Returns:
    The local sequence slice of the sum over all devices.
  """
  size = _checks.bound_axis_size(axis_name)
  if x.shape[axis] % size:
    raise ValueError(f"sequence length {x.shape[axis]} (x.shape[{axis}]) is not divisible by "
                     f"the size {size} of axis_name={axis_name!r}.")
  return jax.lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)


def split_sequence(x: jax.Array, axis_name: str, *, axis: int = 1) -> jax.Array:
  """Keeps this device's slice of a replicated full sequence: ``(B, S, E) -> (B, S/T, E)``.

  Use where a replicated activation enters the sequence-parallel region. No forward
  communication; backward: all-gather of the cotangent slices into the (replicated) full
  cotangent.

  Args:
    x: the full sequence, identical (invariant) on every device of ``axis_name``.
    axis_name: the tensor/sequence-parallel mesh axis.
    axis: the sequence axis of ``x``.

  Returns:
    The local contiguous slice ``[r * S/T, (r+1) * S/T)`` along ``axis``.
  """
  size = _checks.bound_axis_size(axis_name)
  if x.shape[axis] % size:
    raise ValueError(f"sequence length {x.shape[axis]} (x.shape[{axis}]) is not divisible by "
                     f"the size {size} of axis_name={axis_name!r}.")
  return _split(x, axis_name, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _split(x, axis_name, axis):
  length = x.shape[axis] // jax.lax.axis_size(axis_name)
  start = jax.lax.axis_index(axis_name) * length
  return jax.lax.dynamic_slice_in_dim(x, start, length, axis=axis)


def _split_fwd(x, axis_name, axis):
  return _split(x, axis_name, axis), None


def _split_bwd(axis_name, axis, _, cotangent):
  return (jax.lax.all_gather(cotangent, axis_name, axis=axis, tiled=True, to="invarying"),)


_split.defvjp(_split_fwd, _split_bwd)
