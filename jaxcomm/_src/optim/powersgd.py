"""``powersgd_allreduce``: PowerSGD (Vogels et al. 2019) as an optax transformation."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.accounting import warmup
from jaxcomm._src.collectives.powersgd import (PowerSGDLeafState, block_rows, gather_rows,
                                               pad_rows, powersgd_reduce, row_block)
from jaxcomm._src.compress.base import psum_payload
from jaxcomm._src.compress.powersgd import (PowerSGDMethod, compression_rate, initial_q,
                                            matrix_shape)
from jaxcomm._src.mesh_axes import require_axes, require_varying, vary
from jaxcomm._src.keys import check_seed, nth_key
from jaxcomm._src.optim import hsdp
from jaxcomm._src.nonfinite import has_nonfinite, keep_if
from jaxcomm._src.optim.nonfinite import with_nonfinite_policy
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS
from jaxcomm._src.validation import check_float, check_float_input, check_float_tree, check_int_range


class PowerSGDAllReduceState(NamedTuple):
  """State of :func:`powersgd_allreduce`.

  Attributes:
    leaves: per gradient leaf (``jax.tree.leaves`` order): a
      :class:`~jaxcomm.collectives.powersgd.PowerSGDLeafState` for factorized leaves (this
      device's block of rows: ``q`` varying over the fast axis only, ``residual`` over both),
      ``()`` for leaves sent dense.
    count: int32 step counter.
  """
  leaves: tuple
  count: jax.Array


def powersgd_allreduce(rank: int = 4, *, min_compression_rate: float = 2.0,
                       warmup_steps: int = 0, feedback: bool = True, epsilon: float = 1e-8,
                       seed: int | jax.Array = 0, fast_axis: str = LOCAL_AXIS,
                       slow_axis: str = HOST_AXIS) -> optax.GradientTransformation:
  """Mean of per-device gradients: dense inside a host, rank-``r`` PowerSGD between hosts.

  Each leaf with at least 2 dimensions whose compression rate ``m n / (r (m + n))`` reaches
  ``min_compression_rate`` is viewed as the ``(out, rest)`` matrix ``M`` (conv kernels become
  ``(out, h w in)``) and held as ``M^T``, ``n`` rows; each step it is reduce-scattered over
  ``fast_axis`` at full precision, so each of a host's ``G`` devices holds ``c = ceil(n / G)``
  rows of the host's sum, and runs one warm-started power iteration with error feedback on its
  rows: ``P = M Q`` is summed over the row blocks and over ``slow_axis``, ``Q = M^T P`` (this
  device's rows) over ``slow_axis``, and the rows of the approximation are all-gathered over
  ``fast_axis``. That is PowerSGD on the whole matrix up to float rounding, without each
  device of a host repeating it. Same-shaped matrices are stacked into one collective; other
  leaves are ``psum``-ed dense over both axes. For the first ``warmup_steps`` steps everything
  is sent dense (the paper's warm-up; a factorized leaf's rows over ``slow_axis``). ``Q``
  starts from a key shared by every device.

  Bytes per device and step for a factorized float32 leaf (``D' = 4 G c m``), ``G`` devices per
  host and ``H`` hosts: over the fast axis ``2 (G-1)/G D'`` (reduce-scatter and all-gather)
  plus ``2 (G-1)/G 4 (r m + r)``; over the slow axis ``2 (H-1)/H 4 r (m + c)`` (see
  :mod:`jaxcomm.collectives.powersgd`).

  Args:
    rank: ``r`` >= 1.
    min_compression_rate: leaves below this rate are sent dense; > 0.
    warmup_steps: steps of dense warm-up, >= 0.
    feedback: keep error-feedback residuals (the paper's method); without, the output is the
      plain rank-r approximation of the mean.
    epsilon: added to column norms when orthogonalizing; >= 0.
    seed: int seed or PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``) of the
      initial ``Q``s: leaf ``i``'s is drawn from :func:`jaxcomm.keys.nth_key` ``(seed, i)``.
    fast_axis: intra-host mesh axis.
    slow_axis: inter-host mesh axis.

  Returns:
    An ``optax.GradientTransformation``; create its state with :func:`jaxcomm.optim.sharded_init`.

  References:
    Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization", NeurIPS 2019.
  """
  rank = check_int_range("rank", rank, 1)
  min_compression_rate = check_float("min_compression_rate", min_compression_rate)
  warmup_steps = check_int_range("warmup_steps", warmup_steps, 0)
  epsilon = check_float("epsilon", epsilon, inclusive=True)
  seed = check_seed("seed", seed)
  if not isinstance(feedback, bool):
    raise TypeError(f"feedback must be a bool, got {feedback!r}.")
  for name, axis in (("fast_axis", fast_axis), ("slow_axis", slow_axis)):
    if not isinstance(axis, str) or not axis:
      raise TypeError(f"{name} must be a non-empty mesh axis name, got {axis!r}.")
  if fast_axis == slow_axis:
    raise ValueError(f"fast_axis and slow_axis must differ, both are {fast_axis!r}.")
  axes = (fast_axis, slow_axis)

  def init(params) -> PowerSGDAllReduceState:
    require_axes(axes, "powersgd_allreduce.init")
    return _init_state(params, rank, min_compression_rate, seed, fast_axis, slow_axis,
                       _sharded_leaves(fast_axis))

  def update(grads, state: PowerSGDAllReduceState, params=None):
    del params
    require_axes(axes, "powersgd_allreduce.update")
    check_float_tree(grads, "grads")
    require_varying(grads, axes, "powersgd_allreduce.update")
    leaves, treedef = jax.tree.flatten(grads)
    shards = _sharded_leaves(fast_axis)
    host_sums = _host_sums(leaves, state.leaves, shards, fast_axis, slow_axis)
    shapes = None if shards is not None else [leaf.shape for leaf in leaves]
    dense = functools.partial(_dense_sums, slow_axis, fast_axis, shapes)

    def compressed(operands):
      reduce = (functools.partial(powersgd_reduce, shapes=shapes, fast_axis=fast_axis)
                if shards is None else functools.partial(hsdp.powersgd_on_shards, shards=shards))
      return reduce(*operands, slow_axis=slow_axis, epsilon=epsilon, feedback=feedback)

    operands = (host_sums, list(state.leaves))
    if warmup_steps:
      outputs, states = jax.lax.cond(state.count < warmup_steps, warmup(dense), compressed,
                                     operands)
    else:
      outputs, states = compressed(operands)
    means = [out.astype(g.dtype) for out, g in zip(outputs, leaves)]
    return treedef.unflatten(means), PowerSGDAllReduceState(tuple(states), state.count + 1)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))


def _sharded_leaves(fast_axis: str) -> hsdp.ShardedLeaves | None:
  """Under ``data_parallel(..., shard_over=)``: the leaves are flat shards, factorized by
  column blocks (:func:`jaxcomm.optim.hsdp.powersgd_on_shards`); else ``None``."""
  return hsdp.sharded_leaves_over(fast_axis, "powersgd_allreduce")


def _host_sums(leaves, states, shards, fast_axis: str, slow_axis: str) -> list:
  """Each leaf's host sum of ``g / (G H)``: for a factorized leaf this device's block of its
  rows (:func:`jaxcomm.collectives.powersgd.row_block`, a reduce-scatter over ``fast_axis``),
  for a dense one a ``psum`` over ``fast_axis``; under ``shard_over`` each device already holds
  its shard of the host's mean, divided by ``H``."""
  if shards is not None:
    return [(g / jax.lax.axis_size(slow_axis)).astype(g.dtype) for g in leaves]
  devices = jax.lax.axis_size(fast_axis) * jax.lax.axis_size(slow_axis)
  sums = []
  for g, state in zip(leaves, states):
    mean = (g / devices).astype(g.dtype)
    sums.append(row_block(mean, fast_axis) if isinstance(state, PowerSGDLeafState)
                else jax.lax.psum(mean, fast_axis))
  return sums


def _init_state(params, rank: int, min_compression_rate: float, seed: int | jax.Array,
                fast_axis: str, slow_axis: str, shards=None) -> PowerSGDAllReduceState:
  """Per factorized leaf this device's rows of the warm start ``Q`` and a zero residual
  (:class:`~jaxcomm.collectives.powersgd.PowerSGDLeafState`), ``()`` per leaf sent dense;
  under ``shard_over`` (``shards``) by column blocks."""
  if shards is not None:
    check_float_tree(params, "params")
    states = hsdp.powersgd_states(jax.tree.leaves(params), shards, rank=rank,
                                  min_compression_rate=min_compression_rate, seed=seed,
                                  slow_axis=slow_axis)
    return PowerSGDAllReduceState(leaves=states, count=jnp.zeros((), jnp.int32))
  states = []
  devices = jax.lax.axis_size(fast_axis)
  for index, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(params)):
    check_float_input(leaf, f"params{jax.tree_util.keystr(path)}")
    if compression_rate(tuple(leaf.shape), rank) < min_compression_rate:
      states.append(())
      continue
    m, n = matrix_shape(tuple(leaf.shape))
    rows = block_rows(n, devices)
    q = pad_rows(initial_q(nth_key(seed, index), leaf.shape, rank), devices)
    q = jax.lax.dynamic_slice_in_dim(q, jax.lax.axis_index(fast_axis) * rows, rows)
    states.append(PowerSGDLeafState(
        q=vary(q, (fast_axis,)),
        residual=vary(jnp.zeros((rows, m), jnp.float32), (fast_axis, slow_axis))))
  return PowerSGDAllReduceState(leaves=tuple(states), count=jnp.zeros((), jnp.int32))


def _dense_sums(slow_axis: str, fast_axis: str, shapes, operands):
  """Warm-up: every host sum ``psum``-ed over ``slow_axis`` in float32, a factorized leaf's
  row blocks then all-gathered over ``fast_axis`` (unless ``shapes`` is ``None``: under
  ``shard_over`` the outputs stay shards); states untouched."""
  sums, states = operands
  outputs = [jax.lax.psum(s.astype(jnp.float32), slow_axis) for s in sums]
  if shapes is not None:
    outputs = [gather_rows(out, shape, fast_axis) if isinstance(state, PowerSGDLeafState)
               else out for out, state, shape in zip(outputs, states, shapes)]
  return outputs, list(states)


def matrix_allreduce(compressor, *, strategy, feedback: bool, bucket_bytes, residual_dtype,
                     nonfinite: str, fast_axis: str, slow_axis: str
                     ) -> optax.GradientTransformation:
  """``compressed_allreduce(compressor)`` for a compressor that needs a matrix (PowerSGD).

  Runs :func:`powersgd_allreduce` with the compressor's parameters, so the inter-host bytes
  are the rank-r factors, ``2 (H-1)/H 4 r (m + ceil(n / G))`` per factorized leaf (``P`` and
  this device's rows of ``Q``), not a flattened
  shard sent dense. ``nonfinite='skip'`` wraps it in :func:`jaxcomm.skip_nonfinite` (one
  4-byte ``psum``), ``'zero'`` zeroes non-finite entries first, ``'propagate'`` runs it as
  is; its residuals never take a non-finite value in any mode.

  Raises:
    ValueError: for an option the matrix collective cannot honour exactly (a strategy,
      buckets, a residual dtype other than float32), naming it.
  """
  method = compressor.matrix_method
  for name, value, allowed in (("strategy", strategy, None), ("bucket_bytes", bucket_bytes, None),
                               ("residual_dtype", jnp.dtype(residual_dtype),
                                jnp.dtype(jnp.float32))):
    if value != allowed:
      raise ValueError(f"{compressor.name} runs its own matrix collective, which takes no "
                       f"{name}={value!r} (allowed: {allowed!r}).")
  if not isinstance(method, PowerSGDMethod):
    return with_nonfinite_policy(leaf_allreduce(compressor, feedback=feedback,
                                                fast_axis=fast_axis, slow_axis=slow_axis),
                                 nonfinite, (fast_axis, slow_axis))
  inner = powersgd_allreduce(method.rank, min_compression_rate=method.min_compression_rate,
                             feedback=feedback, epsilon=method.epsilon, seed=method.seed,
                             fast_axis=fast_axis, slow_axis=slow_axis)
  return with_nonfinite_policy(inner, nonfinite, (fast_axis, slow_axis))


class LeafAllReduceState(NamedTuple):
  """State of :func:`leaf_allreduce`.

  Attributes:
    compressor: per leaf, the compressor's state (shared keys: replicated).
    residual: per leaf, float32 of the leaf's shape: this host's unsent error (the same on
      every device of the host), or ``()`` without feedback.
  """
  compressor: tuple
  residual: tuple


def leaf_allreduce(compressor, *, feedback: bool, fast_axis: str,
                   slow_axis: str) -> optax.GradientTransformation:
  """Dense inside a host, a linear whole-leaf compressor (e.g. :func:`jaxcomm.compress.gradzip`)
  between hosts.

  Each step: ``psum`` over ``fast_axis`` of the gradient divided by the device count; each
  host encodes ``a = host sum + residual`` leaf by leaf with the compressor's shared state
  (the same basis on every host), the payloads are ``psum``-ed over ``slow_axis`` and decoded
  once; the residual keeps ``a - decode(own payload)``.

  Bytes per device and step for a leaf of ``D`` bytes with a payload of ``c`` bytes (its
  replicated fields, such as a shared key, are not summed and not counted):
  ``2 (G-1)/G D`` over the fast axis and ``2 (H-1)/H c`` over the slow axis.
  """
  if not compressor.linear:
    raise ValueError(f"{compressor.name} needs a matrix but is not linear: only linear "
                     "whole-leaf compressors can be summed over the slow axis.")
  axes = (fast_axis, slow_axis)

  def init(params) -> LeafAllReduceState:
    require_axes(axes, f"compressed_allreduce({compressor.name}).init")
    leaves = jax.tree.leaves(params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      check_float_input(leaf, f"params{jax.tree_util.keystr(path)}")
    residual = tuple(
        vary(jnp.zeros(leaf.shape, jnp.float32), (slow_axis,))
        if feedback else () for leaf in leaves)
    return LeafAllReduceState(tuple(compressor.init(leaf.shape, jnp.float32) for leaf in leaves),
                              residual)

  def update(grads, state: LeafAllReduceState, params=None):
    del params
    require_axes(axes, f"compressed_allreduce({compressor.name}).update")
    check_float_tree(grads, "grads")
    require_varying(grads, axes, f"compressed_allreduce({compressor.name}).update")
    leaves, treedef = jax.tree.flatten(grads)
    devices = jax.lax.axis_size(fast_axis) * jax.lax.axis_size(slow_axis)
    means, states, residuals = [], [], []
    for leaf, cstate, residual in zip(leaves, state.compressor, state.residual):
      corrected = jax.lax.psum(leaf.astype(jnp.float32) / devices, fast_axis)
      if feedback:
        corrected = corrected + residual
      payload, new_cstate = compressor.encode(corrected, cstate, None)
      mean = compressor.decode(psum_payload(payload, slow_axis), leaf.shape)
      if feedback:
        kept = corrected - compressor.decode(payload, leaf.shape)
        residual = keep_if(has_nonfinite(mean), residual, kept)
      means.append(mean.astype(leaf.dtype))
      states.append(new_cstate)
      residuals.append(residual)
    return treedef.unflatten(means), LeafAllReduceState(tuple(states), tuple(residuals))

  return optax.GradientTransformation(init, update)
