"""Deep Gradient Compression: sparse velocity exchange with momentum correction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.accounting import warmup
from jaxcomm.collectives import strategies
from jaxcomm.collectives.axes import require_axes
from jaxcomm.compress.base import (check_float, check_fraction, check_int_range,
                                   check_unit_interval)
from jaxcomm.compress.error_feedback import ErrorFeedbackState, error_feedback
from jaxcomm.compress.topk import topk
from jaxcomm.optim import hsdp
from jaxcomm.optim.local_training import device_count, manual_axes, vary

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
      ``strategy='gather'``).
    count: int32 step counter, replicated.
  """
  momentum: Any
  velocity: Any
  server_residual: tuple
  count: jax.Array


def dgc(density: float = 0.001, *, momentum: float = 0.9,
        warmup_densities: Sequence[float] = PAPER_WARMUP, warmup_steps: int = 0,
        clip_norm: float | None = None, momentum_masking: bool = True,
        strategy: str = "gather", fast_axis: str | None = None) -> optax.GradientTransformation:
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
  follows ``warmup_densities``, ``warmup_steps`` steps each (an "epoch" in the paper), then
  ``density``.

  With ``density = 1`` and ``momentum_masking=False`` this is momentum SGD on the mean
  gradient, for either topology. (With masking and density 1 every coordinate is sent and
  masked each step, so ``u`` restarts from ``g``: plain SGD.)

  Bytes per device and step, per leaf of ``d`` float32 elements, ``k`` the top-``k`` count of
  the exchanged vector, 8-byte (float32 value, int32 index) pairs:

  * over the workers, ``strategy='gather'``: one all-gather of the payloads, ``(N - 1) 8k``;
    ``'two_phase'``: an all-to-all of each chunk's top-k and an all-gather of the
    re-sparsified owned chunk, about ``2 (N-1)/N 8k``, with a server residual.
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
    warmup_steps: steps per warm-up stage; 0 disables the warm-up.
    clip_norm: global-norm threshold of the whole model (``None``: no clipping); each worker
      clips its own gradient at ``clip_norm / sqrt(N)``.
    momentum_masking: zero ``u`` where ``v`` was sent.
    strategy: ``'gather'`` or ``'two_phase'``.
    fast_axis: the intra-host mesh axis averaged densely before DGC, e.g. ``'local'`` on a
      :func:`jaxcomm.make_mesh` mesh; the other mesh axes are the workers'. ``None``: every
      device is a worker.

  Returns:
    An ``optax.GradientTransformation`` for per-device gradients
    (:func:`jaxcomm.local_grad`) inside ``shard_map``.

  Example:
    >>> tx = optax.chain(jaxcomm.dgc(0.001, fast_axis="local"),
    ...                  optax.sgd(0.1))  # doctest: +SKIP

  References:
    Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training", ICLR 2018.
  """
  density = check_fraction("density", density)
  stages = tuple(check_fraction("warmup_densities", d) for d in warmup_densities)
  warmup_steps = check_int_range("warmup_steps", warmup_steps, 0)
  densities = (stages if warmup_steps else ()) + (density,)
  momentum = check_unit_interval("momentum", momentum)
  if clip_norm is not None:
    clip_norm = check_float("clip_norm", clip_norm)
  if strategy not in ("gather", "two_phase"):
    raise ValueError(f"strategy must be 'gather' or 'two_phase', got {strategy!r}.")
  if fast_axis is not None and (not isinstance(fast_axis, str) or not fast_axis):
    raise TypeError(f"fast_axis must be a non-empty mesh axis name or None, got {fast_axis!r}.")
  compressors = [error_feedback(topk(d)) for d in densities]

  def topology(caller: str) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """``(every mesh axis, the workers' axes, devices per worker G)``."""
    axes = manual_axes(caller)
    if fast_axis is None:
      return axes, axes, 1
    require_axes((fast_axis,), caller)
    workers = tuple(axis for axis in axes if axis != fast_axis)
    if not workers:
      raise ValueError(f"{caller}: fast_axis={fast_axis!r} is the only mesh axis, which leaves "
                       "no axis to exchange over; use fast_axis=None for DGC over its devices.")
    return axes, workers, jax.lax.axis_size(fast_axis)

  def prescattered(caller: str) -> bool:
    """Under ``data_parallel(..., shard_over=fast_axis)`` each gradient already is this
    device's shard of the host mean and updates stay shards: no reduce-scatter, no
    all-gather (``group`` is then ``None`` below)."""
    shards = hsdp.sharded_leaves()
    if shards is not None and shards.axis != fast_axis:
      raise ValueError(f"{caller}: the parameters are sharded over {shards.axis!r} "
                       f"(shard_over), so dgc needs fast_axis={shards.axis!r}; got "
                       f"fast_axis={fast_axis!r}.")
    return shards is not None

  def shard_shape(leaf, group: int | None) -> tuple[int, ...]:
    return leaf.shape if fast_axis is None or group is None else (-(-leaf.size // group),)

  def host_mean_shard(grad, group: int | None):
    """This device's shard of the mean of ``grad`` over ``fast_axis`` (reduce-scatter)."""
    if fast_axis is None or group is None:
      return grad
    flat = grad.reshape(-1) / group
    flat = jnp.pad(flat, (0, group * shard_shape(grad, group)[0] - flat.size))
    return jax.lax.psum_scatter(flat, fast_axis, scatter_dimension=0, tiled=True)

  def gather_back(mean, leaf, group: int | None):
    """The mean shards of the host's devices put back together (all-gather over fast_axis)."""
    if fast_axis is None or group is None:
      return mean
    whole = jax.lax.all_gather(mean, fast_axis, tiled=True, to="invarying")
    return whole[:leaf.size].reshape(leaf.shape)

  def init(params) -> DGCState:
    axes, workers, group = topology("dgc.init")
    group = None if prescattered("dgc.init") else group
    zeros = lambda p: vary(jnp.zeros(shard_shape(p, group), jnp.float32), axes)
    count = device_count(workers)
    server = tuple(
        vary(jnp.zeros((-(-math.prod(shard_shape(p, group)) // count),), jnp.float32), axes)
        if strategy == "two_phase" else () for p in jax.tree.leaves(params))
    return DGCState(momentum=jax.tree.map(zeros, params), velocity=jax.tree.map(zeros, params),
                    server_residual=server, count=jnp.zeros((), jnp.int32))

  def exchange(compressor, velocity, server, workers):
    """``(sum over workers of the sent velocity, unsent velocity, server residual)``."""
    flat = velocity.reshape(-1)
    key = jax.random.PRNGKey(0)  # top-k is deterministic
    if strategy == "gather":
      unsent = ErrorFeedbackState(jnp.zeros_like(flat), (), jnp.ones((1,), jnp.bool_))
      total, state = strategies.gather_sum(flat, compressor, unsent, key, workers)
      return total, state.residual, server
    empty = strategies.two_phase_init(flat.size, device_count(workers))
    total, state = strategies.two_phase_sum(
        flat, compressor, empty._replace(server_residual=server), key, workers)
    return total, state.worker_residual[:flat.size], state.server_residual

  def sparse_step(stage, workers, operands):
    u, v, server = operands
    compressor = compressors[stage] if strategy == "gather" else topk(densities[stage])
    results = [exchange(compressor, leaf, s, workers) for leaf, s in zip(v, server)]
    means = [total.reshape(leaf.shape) / device_count(workers)
             for (total, _, _), leaf in zip(results, v)]
    unsent = [residual.reshape(leaf.shape) for (_, residual, _), leaf in zip(results, v)]
    if momentum_masking:
      u = [jnp.where(r != leaf, 0.0, m) for r, leaf, m in zip(unsent, v, u)]
    return means, u, unsent, tuple(s for _, _, s in results)

  def update(grads, state: DGCState, params=None):
    del params
    _, workers, group = topology("dgc.update")
    group = None if prescattered("dgc.update") else group
    leaves, treedef = jax.tree.flatten(grads)
    grads32 = [host_mean_shard(g.astype(jnp.float32), group) for g in leaves]
    if clip_norm is not None:
      threshold = clip_norm / device_count(workers) ** 0.5
      squared = sum(jnp.sum(jnp.square(g)) for g in grads32)
      norm = jnp.sqrt(squared if fast_axis is None else jax.lax.psum(squared, fast_axis))
      grads32 = [g * jnp.minimum(1.0, threshold / jnp.maximum(norm, 1e-30)) for g in grads32]
    u = [momentum * m + g for m, g in zip(jax.tree.leaves(state.momentum), grads32)]
    v = [acc + m for acc, m in zip(jax.tree.leaves(state.velocity), u)]
    stage = jnp.minimum(state.count // max(warmup_steps, 1), len(densities) - 1)
    stages = [lambda ops, s=s: sparse_step(s, workers, ops) for s in range(len(densities))]
    means, u, v, server = jax.lax.switch(  # the last stage is the steady state
        stage, [warmup(f) for f in stages[:-1]] + stages[-1:], (u, v, state.server_residual))
    updates = [gather_back(m, g, group).astype(g.dtype) for m, g in zip(means, leaves)]
    return treedef.unflatten(updates), DGCState(
        momentum=treedef.unflatten(u), velocity=treedef.unflatten(v),
        server_residual=tuple(server), count=state.count + 1)

  return optax.GradientTransformation(init, update)
