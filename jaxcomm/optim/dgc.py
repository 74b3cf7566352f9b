"""Deep Gradient Compression: sparse velocity exchange with momentum correction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.collectives import strategies
from jaxcomm.compress.base import check_float, check_fraction, check_int_range
from jaxcomm.compress.error_feedback import ErrorFeedbackState, error_feedback
from jaxcomm.compress.topk import topk
from jaxcomm.optim.local_training import device_count, manual_axes, vary

PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)  # sparsity 75%, 93.75%, 98.4375%, 99.6%


class DGCState(NamedTuple):
  """State of :func:`dgc`, device-local except ``count``.

  Attributes:
    momentum: ``u``, parameter-shaped, float32: this device's corrected momentum.
    velocity: ``v``, parameter-shaped, float32: accumulated momentum not yet sent.
    server_residual: per leaf, float32 ``(ceil(d / N),)``: the two-phase server-side
      residual (``()`` per leaf with ``strategy='gather'``).
    count: int32 step counter, replicated.
  """
  momentum: Any
  velocity: Any
  server_residual: tuple
  count: jax.Array


def dgc(density: float = 0.001, *, momentum: float = 0.9,
        warmup_densities: Sequence[float] = PAPER_WARMUP, warmup_steps: int = 0,
        clip_norm: float | None = None, momentum_masking: bool = True,
        strategy: str = "gather") -> optax.GradientTransformation:
  """Deep Gradient Compression over every device (each device is a DGC worker).

  Per device ``i`` and step: clip ``g`` to norm ``clip_norm / sqrt(N)`` (local gradient
  clipping, ``N`` devices); ``u = momentum u + g`` (momentum correction); ``v = v + u``; send
  the top-``k`` of ``v`` per leaf (``k = density d``); ``v`` keeps what was not sent and, with
  momentum factor masking, ``u`` is zeroed where ``v`` was sent. The result is the mean over
  devices of the sent velocities, identical on every device: chain ``optax.sgd(lr)`` (no
  momentum: it is already in ``u``) after it. During warm-up the density follows
  ``warmup_densities``, ``warmup_steps`` steps each (an "epoch" in the paper), then
  ``density``.

  With ``density = 1`` and ``momentum_masking=False`` this is momentum SGD on the mean
  gradient. (With masking and density 1 every coordinate is sent and masked each step, so
  ``u`` restarts from ``g``: plain SGD.)

  Bytes per device per leaf of ``d`` float32 elements (``k = density d``, 8-byte
  value-index pairs): ``strategy='gather'`` all-gathers the payloads over all devices,
  ``(N - 1) 8k``; ``'two_phase'`` sends each device's per-chunk top-k by all-to-all and
  the re-sparsified owned chunk by all-gather, about ``2 (N-1)/N 8k``, with a server residual.

  Args:
    density: final fraction of each leaf sent, in (0, 1].
    momentum: ``m`` in [0, 1).
    warmup_densities: densities of the warm-up stages, each in (0, 1].
    warmup_steps: steps per warm-up stage; 0 disables the warm-up.
    clip_norm: global-norm threshold of the whole model (``None``: no clipping); each device
      clips its own gradient at ``clip_norm / sqrt(N)``.
    momentum_masking: zero ``u`` where ``v`` was sent.
    strategy: ``'gather'`` or ``'two_phase'``.

  Returns:
    An ``optax.GradientTransformation`` for per-device gradients
    (:func:`jaxcomm.local_grad`) inside ``shard_map``.

  References:
    Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training", ICLR 2018.
  """
  density = check_fraction("density", density)
  stages = tuple(check_fraction("warmup_densities", d) for d in warmup_densities)
  warmup_steps = check_int_range("warmup_steps", warmup_steps, 0)
  densities = (stages if warmup_steps else ()) + (density,)
  momentum = check_float("momentum", momentum, minimum=0.0, inclusive=True)
  if momentum >= 1.0:
    raise ValueError(f"momentum must be in [0, 1), got {momentum}.")
  if clip_norm is not None:
    clip_norm = check_float("clip_norm", clip_norm)
  if strategy not in ("gather", "two_phase"):
    raise ValueError(f"strategy must be 'gather' or 'two_phase', got {strategy!r}.")
  compressors = [error_feedback(topk(d)) for d in densities]

  def init(params) -> DGCState:
    axes = manual_axes("dgc.init")
    zeros = lambda p: vary(jnp.zeros(p.shape, jnp.float32), axes)
    count = device_count(axes)
    server = tuple(vary(jnp.zeros((-(-p.size // count),), jnp.float32), axes)
                   if strategy == "two_phase" else () for p in jax.tree.leaves(params))
    return DGCState(momentum=jax.tree.map(zeros, params), velocity=jax.tree.map(zeros, params),
                    server_residual=server, count=jnp.zeros((), jnp.int32))

  def exchange(compressor, velocity, server, axes):
    """``(sum over devices of the sent velocity, unsent velocity, server residual)``."""
    flat = velocity.reshape(-1)
    key = jax.random.PRNGKey(0)  # top-k is deterministic
    if strategy == "gather":
      unsent = ErrorFeedbackState(jnp.zeros_like(flat), (), jnp.ones((1,), jnp.bool_))
      total, state = strategies.gather_sum(flat, compressor, unsent, key, axes)
      return total, state.residual, server
    empty = strategies.two_phase_init(flat.size, device_count(axes))
    total, state = strategies.two_phase_sum(
        flat, compressor, empty._replace(server_residual=server), key, axes)
    return total, state.worker_residual[:flat.size], state.server_residual

  def sparse_step(stage, operands):
    u, v, server = operands
    axes = manual_axes("dgc.update")
    compressor = compressors[stage] if strategy == "gather" else topk(densities[stage])
    results = [exchange(compressor, leaf, s, axes) for leaf, s in zip(v, server)]
    means = [total.reshape(leaf.shape) / device_count(axes)
             for (total, _, _), leaf in zip(results, v)]
    unsent = [residual.reshape(leaf.shape) for (_, residual, _), leaf in zip(results, v)]
    if momentum_masking:
      u = [jnp.where(r != leaf, 0.0, m) for r, leaf, m in zip(unsent, v, u)]
    return means, u, unsent, tuple(s for _, _, s in results)

  def update(grads, state: DGCState, params=None):
    del params
    axes = manual_axes("dgc.update")
    leaves, treedef = jax.tree.flatten(grads)
    grads32 = [g.astype(jnp.float32) for g in leaves]
    if clip_norm is not None:
      threshold = clip_norm / device_count(axes) ** 0.5
      norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads32))
      grads32 = [g * jnp.minimum(1.0, threshold / jnp.maximum(norm, 1e-30)) for g in grads32]
    u = [momentum * m + g for m, g in zip(jax.tree.leaves(state.momentum), grads32)]
    v = [acc + m for acc, m in zip(jax.tree.leaves(state.velocity), u)]
    stage = jnp.minimum(state.count // max(warmup_steps, 1), len(densities) - 1)
    means, u, v, server = jax.lax.switch(
        stage, [lambda ops, s=s: sparse_step(s, ops) for s in range(len(densities))],
        (u, v, state.server_residual))
    updates = [m.astype(g.dtype) for m, g in zip(means, leaves)]
    return treedef.unflatten(updates), DGCState(
        momentum=treedef.unflatten(u), velocity=treedef.unflatten(v),
        server_residual=tuple(server), count=state.count + 1)

  return optax.GradientTransformation(init, update)
