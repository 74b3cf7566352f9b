"""Deep Gradient Compression: sparse velocity exchange with momentum correction."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.accounting import warmup
from jaxcomm._src.collectives import strategies
from jaxcomm._src.compress.error_feedback import ErrorFeedbackState
from jaxcomm._src.compress.topk import topk
from jaxcomm._src.keys import unread_key
from jaxcomm._src.mesh_axes import device_count, manual_axes, require_axes, vary
from jaxcomm._src.optim import hsdp
from jaxcomm._src.validation import check_float, check_fraction, check_int_range, check_unit_interval

PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)  # sparsity 75%, 93.75%, 98.4375%, 99.6%


class DGCState(NamedTuple):
  """State of :func:`dgc`, device-local except ``count``.

  Attributes:
    momentum: ``u``, float32, per leaf: parameter-shaped; with ``fast_axis``, this device's
      ``(ceil(d / G),)`` shard of the flattened leaf (the host's ``G`` devices together hold
      one worker's state, each a different shard).
    velocity: ``v``, float32, shaped like ``momentum``: accumulated momentum not yet sent.
    server_residual: per leaf, float32 ``(ceil(s / N),)`` for a shard of ``s`` elements and
      ``N`` workers: the two-phase server-side residual (``()`` per leaf with
      the gather strategy).
    count: int32 step counter, replicated.
  """
  momentum: Any
  velocity: Any
  server_residual: tuple
  count: jax.Array


def dgc(density: float = 0.001, *, momentum: float = 0.9,
        warmup_densities: Sequence[float] = PAPER_WARMUP, warmup_stage_steps: int = 0,
        clip_norm: float | None = None, momentum_masking: bool = True,
        strategy: str | strategies.Strategy | None = None,
        fast_axis: str | None = None) -> optax.GradientTransformation:
  """Deep Gradient Compression: flat over every device, or across hosts after a dense mean.

  The workers are every device (``fast_axis=None``) or, with ``fast_axis``, the hosts: each
  host first averages its devices' gradients at full precision by a reduce-scatter over
  ``fast_axis``, so that each of its ``G`` devices owns the host mean of ``1/G`` of every
  leaf, and runs DGC on that shard over the remaining (slow) mesh axes, every NIC of the host
  carrying its own shard. Per worker ``i`` and step: clip ``g`` to norm ``clip_norm / sqrt(N)``
  (local gradient clipping, ``N`` workers; the norm is that of the whole model, summed over
  the host's shards); ``u = momentum u + g`` (momentum correction); ``v = v + u``; send the
  top-``k`` of ``v`` per leaf or shard (``k = max(1, floor(density d))`` of its ``d``
  elements); ``v`` keeps what was not sent and, with momentum factor masking, ``u`` is zeroed
  where ``v`` was sent. The result is the mean over workers of the sent velocities (with
  ``fast_axis``, all-gathered back over it), identical on every device: chain
  ``optax.sgd(lr)`` (no momentum: it is already in ``u``) after it. During warm-up the density
  follows ``warmup_densities``, ``warmup_stage_steps`` steps each (an "epoch" in the paper), then
  ``density``.

  With ``density = 1`` and ``momentum_masking=False`` this is momentum SGD on the mean
  gradient, for either topology. (With masking and density 1 every coordinate is sent and
  masked each step, so ``u`` restarts from ``g``: plain SGD.)

  Bytes per device and step, per leaf of ``d`` float32 elements, ``k`` the top-``k`` count of
  the exchanged vector, 8-byte (float32 value, int32 index) pairs:

  * over the workers, gather: one all-gather of the payloads, ``(N - 1) 8k``; two-phase: an
    all-to-all of each chunk's top-k and an all-gather of the re-sparsified owned chunk,
    about ``2 (N-1)/N 8k``, with a server residual.
  * ``fast_axis=None``: that is all; ``N`` is every device and the vector the whole leaf, so
    the all-gather crosses every host.
  * ``fast_axis``: a reduce-scatter of the zero-padded leaf over ``fast_axis``,
    ``(G-1)/G 4 d'`` (``d' = G ceil(d / G)``), the exchange above over the ``N`` hosts with
    ``k`` of the ``ceil(d / G)``-element shard, then an all-gather of the mean shard over
    ``fast_axis``, ``(G-1)/G 4 d'``; with ``clip_norm``, one 4-byte ``psum`` of the squared
    norm over ``fast_axis``. Inter-host bytes shrink from ``(HG - 1) 8k`` to about
    ``(H - 1) 8k / G`` (gather, ``H`` hosts).

  Args:
    density: final fraction of each leaf (or shard) sent, in (0, 1].
    momentum: ``m`` in [0, 1).
    warmup_densities: densities of the warm-up stages, each in (0, 1].
    warmup_stage_steps: steps per warm-up stage; 0 disables the warm-up.
    clip_norm: global-norm threshold of the whole model (``None``: no clipping); each worker
      clips its own gradient at ``clip_norm / sqrt(N)``.
    momentum_masking: zero ``u`` where ``v`` was sent.
    strategy: how the workers exchange the top-k, as for :func:`jaxcomm.compressed_allreduce`:
      ``Gather()`` or ``TwoPhase()`` of :mod:`jaxcomm.collectives` (or the names
      ``'gather'``, ``'two_phase'``), or ``None``: resolved for top-k, which is ``Gather()``.
    fast_axis: the intra-host mesh axis averaged densely before DGC, e.g. ``'local'`` on a
      :func:`jaxcomm.make_mesh` mesh; the other mesh axes are the workers'. ``None``: every
      device is a worker.

  Returns:
    An ``optax.GradientTransformation`` for per-device gradients
    (:func:`jaxcomm.optim.local_grad`) inside ``shard_map``.

  Example:
    >>> tx = optax.chain(jaxcomm.dgc(0.001, fast_axis="local"),
    ...                  optax.sgd(0.1))  # doctest: +SKIP

  References:
    Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training", ICLR 2018.
  """
  density = check_fraction("density", density)
  stages = tuple(check_fraction("warmup_densities", d) for d in warmup_densities)
  stage_steps = check_int_range("warmup_stage_steps", warmup_stage_steps, 0)
  densities = (stages if stage_steps else ()) + (density,)
  momentum = check_unit_interval("momentum", momentum)
  if clip_norm is not None:
    clip_norm = check_float("clip_norm", clip_norm)
  strategy = strategies.check_strategy(strategy, topk(density))
  if fast_axis is not None and (not isinstance(fast_axis, str) or not fast_axis):
    raise TypeError(f"fast_axis must be a non-empty mesh axis name or None, got {fast_axis!r}.")
  compressors = [topk(d) for d in densities]

  def resolved(topo: _Topology) -> strategies.Strategy:
    return strategies.resolve(strategy, compressors[-1], device_count(topo.workers))

  def init(params) -> DGCState:
    topo = _topology(fast_axis, "dgc.init")
    return _init_state(params, topo, resolved(topo))

  def update(grads, state: DGCState, params=None):
    del params
    topo = _topology(fast_axis, "dgc.update")
    leaves, treedef = jax.tree.flatten(grads)
    grads32 = _clip([_host_mean_shard(g.astype(jnp.float32), topo) for g in leaves],
                    clip_norm, topo)
    u = [momentum * m + g for m, g in zip(jax.tree.leaves(state.momentum), grads32)]
    v = [acc + m for acc, m in zip(jax.tree.leaves(state.velocity), u)]
    stage = jnp.minimum(state.count // max(stage_steps, 1), len(densities) - 1)
    stages = [functools.partial(_sparse_step, c, topo.workers, resolved(topo), momentum_masking)
              for c in compressors]
    means, u, v, server = jax.lax.switch(  # the last stage is the steady state
        stage, [warmup(f) for f in stages[:-1]] + stages[-1:], (u, v, state.server_residual))
    updates = [_gather_back(m, g, topo).astype(g.dtype) for m, g in zip(means, leaves)]
    return treedef.unflatten(updates), DGCState(
        momentum=treedef.unflatten(u), velocity=treedef.unflatten(v),
        server_residual=tuple(server), count=state.count + 1)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))


class _Topology(NamedTuple):
  """Where DGC runs: every mesh axis, the workers' axes, the dense fast axis and its size;
  ``prescattered``: under ``data_parallel(..., shard_over=fast_axis)`` each gradient already
  is this device's shard of the host mean and updates stay shards (no reduce-scatter, no
  all-gather: :func:`jaxcomm.optim.hsdp.sharded_leaves`)."""
  axes: tuple[str, ...]
  workers: tuple[str, ...]
  fast_axis: str | None
  group: int  # devices per worker, G
  prescattered: bool = False


def _topology(fast_axis: str | None, caller: str) -> _Topology:
  axes = manual_axes(caller)
  shards = hsdp.sharded_leaves()
  if shards is not None and shards.axis != fast_axis:
    raise ValueError(f"{caller}: the parameters are sharded over {shards.axis!r} (shard_over), "
                     f"so dgc needs fast_axis={shards.axis!r}; got fast_axis={fast_axis!r}.")
  if fast_axis is None:
    return _Topology(axes, axes, None, 1)
  require_axes((fast_axis,), caller)
  workers = tuple(axis for axis in axes if axis != fast_axis)
  if not workers:
    raise ValueError(f"{caller}: fast_axis={fast_axis!r} is the only mesh axis, which leaves "
                     "no axis to exchange over; use fast_axis=None for DGC over its devices.")
  return _Topology(axes, workers, fast_axis, jax.lax.axis_size(fast_axis), shards is not None)


def _shard_shape(leaf, topo: _Topology) -> tuple[int, ...]:
  if topo.fast_axis is None or topo.prescattered:
    return leaf.shape
  return (-(-leaf.size // topo.group),)


def _init_state(params, topo: _Topology, strategy: strategies.Strategy) -> DGCState:
  zeros = lambda p: vary(jnp.zeros(_shard_shape(p, topo), jnp.float32), topo.axes)
  count = device_count(topo.workers)
  server = tuple(
      vary(jnp.zeros((-(-math.prod(_shard_shape(p, topo)) // count),), jnp.float32), topo.axes)
      if strategy.own_residuals else () for p in jax.tree.leaves(params))
  return DGCState(momentum=jax.tree.map(zeros, params), velocity=jax.tree.map(zeros, params),
                  server_residual=server, count=jnp.zeros((), jnp.int32))


def _host_mean_shard(grad, topo: _Topology):
  """This device's shard of the mean of ``grad`` over ``fast_axis`` (reduce-scatter)."""
  if topo.fast_axis is None or topo.prescattered:
    return grad
  flat = grad.reshape(-1) / topo.group
  flat = jnp.pad(flat, (0, topo.group * _shard_shape(grad, topo)[0] - flat.size))
  return jax.lax.psum_scatter(flat, topo.fast_axis, scatter_dimension=0, tiled=True)


def _gather_back(mean, leaf, topo: _Topology):
  """The mean shards of the host's devices put back together (all-gather over fast_axis)."""
  if topo.fast_axis is None or topo.prescattered:
    return mean
  whole = jax.lax.all_gather(mean, topo.fast_axis, tiled=True, to="invarying")
  return whole[:leaf.size].reshape(leaf.shape)


def _clip(grads32: list, clip_norm: float | None, topo: _Topology) -> list:
  """Local gradient clipping at ``clip_norm / sqrt(N)`` of the whole model's norm (summed
  over the host's shards: one 4-byte ``psum`` over ``fast_axis``)."""
  if clip_norm is None:
    return grads32
  threshold = clip_norm / device_count(topo.workers) ** 0.5
  squared = sum(jnp.sum(jnp.square(g)) for g in grads32)
  norm = jnp.sqrt(squared if topo.fast_axis is None else jax.lax.psum(squared, topo.fast_axis))
  return [g * jnp.minimum(1.0, threshold / jnp.maximum(norm, 1e-30)) for g in grads32]


def _exchange(compressor, velocities, server, workers, strategy: strategies.Strategy):
  """``(sum over workers of the sent velocity, unsent velocity, server residual)`` per leaf:
  the velocity is the error-feedback memory, so each exchange starts from a zero residual.
  Every leaf's top-k crosses in one all-gather (gather) or one all-to-all and one all-gather
  (two-phase): the strategies' ``apply_many``."""
  flats = [velocity.reshape(-1) for velocity in velocities]
  if not strategy.own_residuals:  # gather: top-k with error feedback
    results = strategy.apply_many(
        [(flat, compressor, ErrorFeedbackState(jnp.zeros_like(flat), ()), unread_key(), True)
         for flat in flats], workers)
    return [(total, state.residual, s) for (total, state), s in zip(results, server)]
  results = strategy.apply_many(
      [(flat, compressor, strategies.two_phase_init(flat.size, device_count(workers))._replace(
          server_residual=residual), unread_key(), True) for flat, residual in zip(flats, server)],
      workers)
  return [(total, state.worker_residual[:flat.size], state.server_residual)
          for (total, state), flat in zip(results, flats)]


def _sparse_step(compressor, workers, strategy: strategies.Strategy, momentum_masking: bool,
                 operands):
  """One exchange of every leaf's velocity: ``(means, u, unsent v, server residuals)``."""
  u, v, server = operands
  results = _exchange(compressor, v, server, workers, strategy)
  means = [total.reshape(leaf.shape) / device_count(workers)
           for (total, _, _), leaf in zip(results, v)]
  unsent = [residual.reshape(leaf.shape) for (_, residual, _), leaf in zip(results, v)]
  if momentum_masking:
    u = [jnp.where(r != leaf, 0.0, m) for r, leaf, m in zip(unsent, v, u)]
  return means, u, unsent, tuple(s for _, _, s in results)
