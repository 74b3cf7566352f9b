"""Periodic averaging of device-local models: the engine of local SGD, DiLoCo, SlowMo, FedAvg.

Every device runs an inner optimizer on its own parameters. Every ``H`` steps (per fragment
of the parameters, in turn, for streaming DiLoCo) the devices average their *pseudo-gradients*
``Delta_i = theta_sync - theta_i`` through a synchronization transformation (by default the
dense hierarchical :func:`jaxcomm.compressed_allreduce`; any compressor with error feedback
fits), an outer optimizer moves ``theta_sync`` along the mean, and each device merges the new
``theta_sync`` into its parameters, ``theta_i = mix theta_i + (1 - mix) theta_sync``,
``delay`` steps later. The synchronization runs under ``lax.cond``/``lax.switch``: its
collectives execute only on synchronization steps.

Bytes per device per synchronization of a fragment of ``D_f`` bytes: those of the ``sync``
transformation for ``D_f`` (dense two-level: ``2(G-1)/G D_f`` intra-host and
``2(H-1)/H D_f/G`` inter-host); amortized over ``H`` steps per fragment round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import functools

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.keys import as_key, check_seed
from jaxcomm._src.mesh_axes import device_count, manual_axes, vary
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.compressed_allreduce import compressed_allreduce
from jaxcomm._src.validation import check_float, check_int_range, check_unit_interval

WeightFn = Callable[[jax.Array, tuple[str, ...]], jax.Array]


class PeriodicState(NamedTuple):
  """State of the periodic-averaging algorithms.

  Attributes:
    inner: the inner optimizer's state, device-local (varying over the mesh axes).
    anchor: ``theta_sync``, the last synchronized (global) parameters, replicated.
    outer: one outer-optimizer state per fragment, replicated.
    sync: one ``sync`` transformation state per fragment (error-feedback residuals are
      device-local).
    key: PRNG key shared by all devices (client sampling), split every step.
    count: int32 step counter, replicated.
  """
  inner: Any
  anchor: Any
  outer: tuple
  sync: tuple
  key: jax.Array
  count: jax.Array


def worker_axes(caller: str) -> tuple[str, ...]:
  """The mesh axes across which workers hold different models: every manual axis, but the
  one parameters are sharded over under ``data_parallel(..., shard_over=)`` (there a host's
  devices together hold one worker's model: :func:`jaxcomm.optim.hsdp.sharded_leaves`)."""
  shards = hsdp.sharded_leaves()
  return tuple(a for a in manual_axes(caller) if shards is None or a != shards.axis)


def fragment_leaves(sizes: list[int], fragments: int) -> list[list[int]]:
  """Splits leaf indices into ``fragments`` contiguous, non-empty groups of about equal size."""
  if fragments > len(sizes):
    raise ValueError(f"fragments={fragments} exceeds the {len(sizes)} parameter leaves.")
  groups: list[list[int]] = [[] for _ in range(fragments)]
  total, done, last = sum(sizes), 0, 0
  for index, size in enumerate(sizes):
    balanced = done * fragments // max(total, 1)
    # never skip a group, and leave at least one leaf for every later group
    last = min(max(balanced, fragments - (len(sizes) - index), last), last + 1 if index else 0)
    groups[last].append(index)
    done += size
  return groups


def check_period(period: int, fragments: int, delay: int, mixing: float, warmup: int):
  check_int_range("period", period, 1)
  check_int_range("fragments", fragments, 1)
  if period % fragments:
    raise ValueError(f"period must be a multiple of fragments, got period={period}, "
                     f"fragments={fragments}.")
  check_int_range("delay", delay, 0, period // fragments - 1)
  mixing = check_unit_interval("mixing", mixing)
  check_int_range("warmup_steps", warmup, 0)
  if warmup and fragments > 1:
    raise ValueError(f"warmup_steps={warmup} needs fragments=1, got fragments={fragments}.")
  return mixing


def periodic_averaging(inner: optax.GradientTransformation,
                       outer: optax.GradientTransformation, period: int, *,
                       sync: optax.GradientTransformation | None = None,
                       fragments: int = 1, delay: int = 0, mixing: float = 0.0,
                       warmup_steps: int = 0, proximal: float = 0.0,
                       client_weight: WeightFn | None = None,
                       seed: int | jax.Array = 0) -> optax.GradientTransformation:
  """The general form behind :func:`local_sgd`, :func:`diloco`, :func:`slowmo`, :func:`fedavg`.

  Step ``t`` (0-based): the inner optimizer updates this device's parameters (with the
  gradient plus ``proximal * (theta_i - theta_sync)`` when ``proximal > 0``). Fragment ``f``
  synchronizes after steps ``t`` with ``t + 1`` a multiple of ``s = period / fragments``
  and ``(t + 1) / s - 1 = f (mod fragments)``; during the first ``warmup_steps`` steps every
  step synchronizes (post-local SGD). A synchronization computes
  ``mean_i w_i Delta_i`` with the ``sync`` transformation (``w_i = 1`` or
  ``devices * client_weight``), applies ``outer`` to ``theta_sync`` and, ``delay`` steps later,
  sets ``theta_i = mixing theta_i + (1 - mixing) theta_sync``.

  Args:
    inner: the per-device optimizer, e.g. ``optax.adamw(1e-3)``; it includes its learning rate.
    outer: the optimizer of ``theta_sync`` on the averaged pseudo-gradient.
    period: ``H >= 1`` inner steps between synchronizations of each fragment.
    sync: averaging transformation run inside ``shard_map`` over every mesh axis
      (default :func:`jaxcomm.compressed_allreduce` at full precision).
    fragments: parameter fragments (contiguous leaf groups) synchronized in turn.
    delay: steps between a fragment's synchronization and its merge, in
      ``[0, period / fragments)``: the communication overlaps with that many inner steps.
    mixing: weight of the local parameters in the merge, in ``[0, 1)``.
    warmup_steps: initial steps that all synchronize (``fragments = 1`` only).
    proximal: FedProx ``mu >= 0``.
    client_weight: ``client_weight(key, axes) -> w`` for this device, with weights summing to
      one over devices; ``None`` for the plain mean.
    seed: an int seed or a PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``) of the
      shared key passed to ``client_weight``.

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters (see
    :func:`jaxcomm.optim.local_training_step`); ``update`` needs ``params``.
  """
  mixing = check_period(period, fragments, delay, mixing, warmup_steps)
  proximal = check_float("proximal", proximal, minimum=0.0, inclusive=True)
  seed = check_seed("seed", seed)
  # The user's optimizers run on the shards as they are: check_shardable checks them.
  inner = hsdp.user_optimizer(inner, "periodic_averaging.inner")
  outer = hsdp.user_optimizer(outer, "periodic_averaging.outer")
  sync = hsdp.user_optimizer(compressed_allreduce() if sync is None else sync,
                             "periodic_averaging.sync")
  plan = _Plan(outer=outer, sync=sync,
               period=period, fragments=fragments, delay=delay, mixing=mixing,
               warmup_steps=warmup_steps, client_weight=client_weight)

  def init(params) -> PeriodicState:
    return _init_state(params, inner, plan, as_key(seed))

  def update(grads, state: PeriodicState, params=None):
    if params is None:
      raise ValueError("periodic averaging needs params in update(grads, state, params).")
    if proximal:
      grads = jax.tree.map(lambda g, p, a: g + proximal * (p - a), grads, params, state.anchor)
    steps, inner_state = inner.update(grads, state.inner, params)
    local, treedef = jax.tree.flatten(optax.apply_updates(params, steps))
    anchor = jax.tree.leaves(state.anchor)
    groups = fragment_leaves([leaf.size for leaf in anchor], fragments)
    key, round_key = jax.random.split(state.key)
    branches = [lambda ops: ops] + [
        functools.partial(_synchronize, plan, f, group, round_key)
        for f, group in enumerate(groups)]
    local, anchor, outer_states, sync_states = jax.lax.switch(
        _sync_branch(plan, state.count), branches, (local, anchor, state.outer, state.sync))
    if delay:
      local = jax.lax.switch(_merge_branch(plan, state.count), [lambda ops: ops[0]] + [
          functools.partial(_merged, mixing, group) for group in groups], (local, anchor))
    updates = jax.tree.map(lambda new, old: new - old, treedef.unflatten(list(local)), params)
    return updates, PeriodicState(inner=inner_state, anchor=treedef.unflatten(list(anchor)),
                                  outer=outer_states, sync=sync_states, key=key,
                                  count=state.count + 1)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))


class _Plan(NamedTuple):
  """The static configuration of one :func:`periodic_averaging`."""
  outer: optax.GradientTransformation
  sync: optax.GradientTransformation
  period: int
  fragments: int
  delay: int
  mixing: float
  warmup_steps: int
  client_weight: WeightFn | None


def _init_state(params, inner: optax.GradientTransformation, plan: _Plan,
                key: jax.Array) -> PeriodicState:
  axes = worker_axes("periodic averaging init")
  anchor = jax.tree.map(lambda leaf: jax.lax.pmean(leaf, axes), params)
  leaves = jax.tree.leaves(anchor)
  groups = fragment_leaves([leaf.size for leaf in leaves], plan.fragments)
  return PeriodicState(
      inner=inner.init(params), anchor=anchor,
      outer=tuple(plan.outer.init([leaves[i] for i in group]) for group in groups),
      sync=tuple(plan.sync.init([jax.tree.leaves(params)[i] for i in group])
                 for group in groups),
      key=key, count=jnp.zeros((), jnp.int32))


def _sync_branch(plan: _Plan, t: jax.Array) -> jax.Array:
  """0 after step ``t`` (0-based) if nothing synchronizes, else ``1 + `` the fragment that does."""
  if plan.fragments == 1:
    due = (t < plan.warmup_steps) | ((t + 1 - plan.warmup_steps) % plan.period == 0)
    return jnp.where(due, 1, 0)
  stride = plan.period // plan.fragments
  return jnp.where((t + 1) % stride == 0, ((t + 1) // stride - 1) % plan.fragments + 1, 0)


def _merge_branch(plan: _Plan, t: jax.Array) -> jax.Array:
  """0 after step ``t`` if no delayed merge is due, else ``1 + `` the fragment to merge."""
  stride = plan.period // plan.fragments
  arrived = t + 1 - plan.delay
  return jnp.where((arrived > 0) & (arrived % stride == 0),
                   (arrived // stride - 1) % plan.fragments + 1, 0)


def _merge(mixing: float, local: list, anchor: list, group: list[int]) -> None:
  """``theta_i = mixing theta_i + (1 - mixing) theta_sync`` on the group's leaves, in place."""
  axes = worker_axes("periodic averaging update")
  for i in group:
    local[i] = vary(anchor[i], axes) if mixing == 0.0 else \
        mixing * local[i] + (1 - mixing) * anchor[i]


def _merged(mixing: float, group: list[int], operands) -> list:
  local, anchor = list(operands[0]), operands[1]
  _merge(mixing, local, anchor, group)
  return local


def _synchronize(plan: _Plan, f: int, group: list[int], round_key: jax.Array, operands):
  """Fragment ``f``: the (weighted) mean pseudo-gradient through ``sync``, the outer step on
  ``theta_sync`` and, without delay, the merge."""
  local, anchor, outer_states, sync_states = (list(x) for x in operands)
  axes = worker_axes("periodic averaging update")
  scale = 1.0 if plan.client_weight is None else \
      device_count(axes) * plan.client_weight(round_key, axes)
  deltas = [(anchor[i] - local[i]) * scale for i in group]
  mean, sync_states[f] = plan.sync.update(deltas, sync_states[f])
  steps, outer_states[f] = plan.outer.update(mean, outer_states[f], [anchor[i] for i in group])
  for i, step in zip(group, steps):
    anchor[i] = anchor[i] + step
  if plan.delay == 0:
    _merge(plan.mixing, local, anchor, group)
  return local, anchor, tuple(outer_states), tuple(sync_states)
