"""N-level allreduce: dense over fast axes, compressed over slow ones.

A topology is a sequence of :class:`Level`, fastest first, e.g. chip -> host -> pod. A level
without a compressor is *dense*: the data is reduce-scattered over it on the way in and
all-gathered back on the way out, so every slower level works on a ``1/size`` shard and all
devices of the fast group use their own link in parallel. A level with a compressor sums its
current shard with a strategy of :mod:`jaxcomm.collectives.strategies` (linear, gather or
two-phase), keeping its own error-feedback state; compressed levels nest.

Bytes each device sends for an array of ``D`` bytes on the default two levels (``G`` devices
per host, ``H`` hosts, payload ``c`` bytes for the ``ceil(d/G)`` shard):

* fast axis: reduce-scatter ``(G-1)/G D`` + all-gather ``(G-1)/G D`` = ``2(G-1)/G D``;
* slow axis: ``(H-1) c`` (gather), about ``2c`` (two-phase) or ``2(H-1)/H c`` (linear).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.accounting import NO_COST, Cost
from jaxcomm._src.collectives import strategies
from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.mesh_axes import require_axes, vary
from jaxcomm._src.nonfinite import has_nonfinite
from jaxcomm._src.validation import check_dtype, check_float_input

DENSE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class Level(NamedTuple):
  """One mesh axis of a topology and how data crosses it.

  Attributes:
    axis: the mesh axis name.
    compressor: ``None`` for full precision (the level is reduce-scattered), else the
      compressor of the data crossing this axis.
    strategy: ``None`` (automatic) or a strategy value (:class:`~jaxcomm.collectives.Dense`,
      ``Linear``, ``Gather``, ``TwoPhase``); :func:`level` also takes a name from
      :data:`strategies.STRATEGIES`.
    feedback: keep error-feedback residuals for this level's compressor.
    dtype: for a dense level, the dtype the data is summed in (``None``: as given).
    gather: how the gather and two-phase strategies all-gather payloads: ``'all_gather'``,
      ``'psum'`` (:func:`~jaxcomm.collectives.strategies.psum_gather`) or ``None`` for the
      backend's measured preference.
  """
  axis: str
  compressor: Compressor | None = None
  strategy: strategies.Strategy | None = None
  feedback: bool = True
  dtype: Any = None
  gather: str | None = None


def level(axis: str, compressor: Compressor | None = None, *,
          strategy: str | strategies.Strategy | None = None,
          feedback: bool = True, dtype: Any = None, gather: str | None = None) -> Level:
  """Builds a validated :class:`Level` (errors name the parameter and the allowed values)."""
  if not isinstance(axis, str) or not axis:
    raise TypeError(f"axis must be a non-empty mesh axis name, got {axis!r}.")
  if compressor is not None and not isinstance(compressor, Compressor):
    raise TypeError(f"compressor must be a jaxcomm.Compressor or None, got "
                    f"{type(compressor).__name__}.")
  if not isinstance(feedback, bool):
    raise TypeError(f"feedback must be a bool, got {feedback!r}.")
  if dtype is not None:
    if compressor is not None:
      raise ValueError("dtype applies to dense levels only; for a compressed level cast with "
                       "its compressor.")
    dtype = check_dtype("dtype", dtype, DENSE_DTYPES)
  if gather is not None and gather not in strategies.GATHERS:
    raise ValueError(f"gather must be one of {', '.join(strategies.GATHERS)} or None; got "
                     f"{gather!r}.")
  strategy = strategies.check_strategy(strategy, compressor)
  return Level(axis, compressor, strategy, feedback, dtype, gather)


def check_levels(levels: Sequence[Level]) -> tuple[Level, ...]:
  """Validates a topology: a non-empty sequence of :class:`Level` with distinct axes."""
  levels = tuple(levels)
  if not levels or not all(isinstance(lv, Level) for lv in levels):
    raise TypeError("levels must be a non-empty sequence of jaxcomm.collectives.Level "
                    f"(made with jaxcomm.collectives.level), got {levels!r}.")
  axes = [lv.axis for lv in levels]
  if len(set(axes)) != len(axes):
    raise ValueError(f"levels must name distinct mesh axes, got {axes}.")
  return tuple(lv._replace(strategy=strategies.as_strategy(lv.strategy)) for lv in levels)


_PRESCATTERED: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "jaxcomm_prescattered", default=frozenset())


@contextlib.contextmanager
def prescattered(axes: Sequence[str]) -> Iterator[None]:
  """While active, dense levels over ``axes`` are already done by the caller.

  For sharded data parallelism (:func:`jaxcomm.data_parallel` with ``shard_over``): each
  device's input is already its ``1/size`` shard of the *mean* over each of ``axes`` (the
  transpose of the parameter all-gather is a reduce-scatter), and the caller keeps the
  result sharded. :func:`init_states` and :func:`hierarchical_allreduce` then neither
  reduce-scatter nor all-gather over those axes (0 bytes there), do not divide the other
  levels' shard lengths by their sizes, and divide only by the other levels' device counts.
  The group of devices along ``axes`` acts as one worker. A compressed level over one of
  ``axes`` is a ``ValueError``.
  """
  token = _PRESCATTERED.set(_PRESCATTERED.get() | frozenset(axes))
  try:
    yield
  finally:
    _PRESCATTERED.reset(token)


def _done(lv: Level) -> bool:
  """Whether ``lv`` is a dense level the caller already reduce-scattered (:func:`prescattered`)."""
  if lv.axis not in _PRESCATTERED.get():
    return False
  if lv.compressor is not None:
    raise ValueError(f"The level over mesh axis {lv.axis!r} has compressor "
                     f"{type(lv.compressor).__name__}, but the data is already reduce-scattered "
                     "over that axis (sharded data parallelism): only the other axes can be "
                     "compressed; make that level dense (level(axis)).")
  return True


def resolve_level(lv: Level, axis_size: int) -> strategies.Strategy:
  """The strategy value level ``lv`` runs on an axis of ``axis_size`` devices, with the
  level's dense ``dtype`` and ``gather`` implementation folded in."""
  strategy = strategies.resolve(lv.strategy, lv.compressor, axis_size)
  if isinstance(strategy, strategies.Dense) and lv.dtype is not None:
    return strategy._replace(dtype=lv.dtype)
  if isinstance(strategy, (strategies.Gather, strategies.TwoPhase)) and lv.gather is not None:
    return strategy._replace(implementation=lv.gather)
  return strategy


def _axis_size(axis: str) -> int:
  return jax.lax.axis_size(axis)


def _shard_sizes(levels: Sequence[Level], size: int,
                 axis_size: Callable[[str], int] = _axis_size) -> tuple[int, list[int]]:
  """Padded length and the shard length each level sees, dense levels dividing it."""
  dense = 1
  for lv in levels:
    if lv.compressor is None and not _done(lv):
      dense *= axis_size(lv.axis)
  padded = -(-size // dense) * dense
  lengths, current = [], padded
  for lv in levels:
    lengths.append(current)
    if lv.compressor is None and not _done(lv):
      current //= axis_size(lv.axis)
  return padded, lengths


def init_states(levels: Sequence[Level], size: int, dtype: Any) -> tuple:
  """Per-level state for an array of ``size`` elements; call inside ``shard_map``.

  Returns:
    A tuple with one entry per level: ``()`` for dense levels and levels without state, else
    the level's state: residuals and flags marked varying over the axes where the level's
    shard differs between devices (device-local there, replicated elsewhere); integer leaves
    such as shared PRNG keys replicated.
  """
  levels = check_levels(levels)
  require_axes([lv.axis for lv in levels], "init_states")
  _, lengths = _shard_sizes(levels, size)
  states = []
  for index, (lv, length) in enumerate(zip(levels, lengths)):
    if lv.compressor is None:
      states.append(())
      continue
    axis_size = jax.lax.axis_size(lv.axis)
    state = resolve_level(lv, axis_size).init(lv.compressor, length, axis_size, lv.feedback,
                                              dtype)
    varying = _distinct_axes(levels, index)
    # Residuals differ per device; integer leaves (shared PRNG keys, counters) stay
    # replicated: every device must hold the same one.
    states.append(jax.tree.map(
        lambda leaf: leaf if jnp.issubdtype(leaf.dtype, jnp.integer) else vary(leaf, varying),
        state))
  return tuple(states)


def _distinct_axes(levels: Sequence[Level], index: int) -> tuple[str, ...]:
  """Axes over which level ``index``'s shard differs between devices.

  Dense levels before it scattered different pieces to their devices; compressed levels
  before it left the same sum on all of theirs; levels from ``index`` on have not summed yet.
  """
  return tuple(lv.axis for i, lv in enumerate(levels)
               if i >= index or lv.compressor is None)


def _level_key(key: jax.Array, levels: Sequence[Level], index: int, shared: bool) -> jax.Array:
  """A key that differs exactly where level ``index``'s data differs.

  Devices holding the same shard must draw the same randomness, or their "means" would
  diverge; with ``shared`` (linear strategy) the key is also the same across the level's own
  axis, so shared indices / hashes line up.
  """
  position = jnp.zeros((), jnp.int32)
  for axis in _distinct_axes(levels, index):
    if not (shared and axis == levels[index].axis):
      position = position * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return jax.random.fold_in(jax.random.fold_in(key, index), position)


def hierarchical_allreduce(x: jax.Array, levels: Sequence[Level], states: tuple,
                           key: jax.Array) -> tuple[jax.Array, tuple]:
  """Mean of ``x`` over every level's axis, compressed where a level says so.

  Must be called inside ``jax.shard_map`` over all the levels' axes. ``x`` is divided by the
  total device count once, before any sum (so float16 sums cannot overflow), flattened and
  zero-padded to a multiple of the dense levels' sizes. Levels are then visited fastest first:
  dense ones reduce-scatter, compressed ones sum their shard (in float32) with their strategy;
  finally the dense levels all-gather back, slowest first. A compressed level whose axis has a
  single device is skipped: nothing crosses it. Inside :func:`prescattered`, dense levels over
  its axes are taken as done: ``x`` is already this device's shard of their mean.

  Args:
    x: this device's array, any shape, float32/bfloat16/float16.
    levels: the topology, fastest first (see :func:`level`).
    states: per-level state from :func:`init_states` for ``x.size`` elements.
    key: PRNG key, the same on every device. Each level folds in the device's position over
      the axes where its shard differs (not over the level's own axis for the linear
      strategy: shared indices / hashes), so devices holding the same data draw the same
      randomness and every device ends with the same mean.

  Returns:
    ``(mean, new_states)``: the mean in ``x``'s dtype and shape, identical on every device.
  """
  (mean,), (new_states,) = hierarchical_allreduce_many([x], [levels], [states], [key])
  return mean, new_states


def hierarchical_allreduce_many(xs: Sequence[jax.Array], topologies: Sequence[Sequence[Level]],
                                states: Sequence[tuple], keys: Sequence[jax.Array]
                                ) -> tuple[list[jax.Array], list[tuple]]:
  """:func:`hierarchical_allreduce` of several arrays (e.g. gradient buckets) in one call.

  Each array is reduced exactly as :func:`hierarchical_allreduce` reduces it alone (same
  results, bit for bit, and the same bytes), but the compressed levels with the
  :class:`~jaxcomm.collectives.Gather` strategy send every array's payload in one collective
  per level and call (:func:`~jaxcomm.collectives.strategies.gather_sums`), and those with
  :class:`~jaxcomm.collectives.TwoPhase` in one all-to-all and one all-gather
  (:func:`~jaxcomm.collectives.strategies.two_phase_sums`): one rendezvous per collective
  instead of one per array.

  Args:
    xs: the arrays, each as :func:`hierarchical_allreduce` takes it.
    topologies: one topology per array; all must name the same axes in the same order (their
      compressors and strategies may differ).
    states: per array, its per-level states from :func:`init_states`.
    keys: per array, its PRNG key (the same on every device).

  Returns:
    ``(means, new_states)``: one entry per array.
  """
  shards, new_states, _ = reduce_shards(xs, topologies, states, keys)
  return ([gather_back(shard, x, levels) for shard, x, levels in zip(shards, xs, topologies)],
          new_states)


class ReducedShards(NamedTuple):
  """What :func:`reduce_shards` returns, one entry per array in each field.

  Attributes:
    shards: this device's shard of the mean (1-D, shaped and varying like
      :func:`shard_zeros`, before any cast back to the array's dtype), which
      :func:`gather_back` turns into the mean.
    states: the new per-level states.
    nonfinite: bool scalars, not agreed between devices: whether this device's part of the
      array holds a NaN or Inf, read on the shard after the first dense level's
      reduce-scatter where :func:`scattered_check_exact` allows (the level's devices are then
      checked together, each on ``1/size`` of the data), else on this device's input.
      ``True`` on some device exactly when some device's input holds a NaN or Inf.
  """
  shards: list
  states: list
  nonfinite: list


def scattered_check_exact(levels: Sequence[Level], dtype: Any,
                          axis_size: Callable[[str], int] = _axis_size) -> bool:
  """Whether a NaN or Inf in some device's input of ``dtype`` shows, entry for entry, in
  the reduce-scattered shard of the first level of ``levels`` that is not
  :func:`prescattered`, and a finite input never turns non-finite there.

  True for a dense level that sums in the input's ``dtype`` over an axis of at most half the
  devices averaged over: each input is divided by that device count ``N`` before the sum, so
  ``n <= N/2`` finite terms are at most half the dtype's largest value together (no overflow,
  whatever the rounding), while a NaN or Inf term leaves a NaN or Inf in the sum. Not for a
  compressed first level, a ``Level.dtype`` other than ``dtype`` (a narrower cast can
  overflow), nor an axis of all ``N`` devices (``N`` terms of nearly ``max / N`` could round
  past the largest value).
  """
  levels = [lv for lv in levels if not _done(lv)]
  if not levels or levels[0].compressor is not None:
    return False
  first = levels[0]
  if first.dtype is not None and jnp.dtype(first.dtype) != jnp.dtype(dtype):
    return False
  total = 1
  for lv in levels:
    total *= axis_size(lv.axis)
  return 2 * axis_size(first.axis) <= total


def reduce_shards(xs: Sequence[jax.Array], topologies: Sequence[Sequence[Level]],
                  states: Sequence[tuple], keys: Sequence[jax.Array]) -> ReducedShards:
  """:func:`hierarchical_allreduce_many` up to the dense levels' all-gathers, with each
  array's non-finite check (:class:`ReducedShards`; unused checks cost nothing: XLA drops
  them).

  The check on the reduce-scattered shard reads ``1/size`` of the input: on the char LM's
  2x4 step, checking every full gradient instead cost sign+EF21 about 1 ms of CPU per step
  (docs/collectives.md, session 12).
  """
  if not xs:  # an empty gradient tree: nothing to reduce
    return ReducedShards([], [], [])
  topologies = [check_levels(levels) for levels in topologies]
  axes = [lv.axis for lv in topologies[0]]
  if any([lv.axis for lv in levels] != axes for levels in topologies):
    raise ValueError(f"topologies must name the same axes in the same order; got "
                     f"{[[lv.axis for lv in levels] for levels in topologies]}.")
  require_axes(axes, "hierarchical_allreduce")
  shards = [_first_shard(x, levels) for x, levels in zip(xs, topologies)]
  new_states = [list(level_states) for level_states in states]
  # None: checked on the first dense level's shard below; else on the input, here. Empty
  # inputs too: JAX drops their zero-size reduce-scatter, which cannot be lowered, unless a
  # check reads it.
  nonfinite = [None if x.size and scattered_check_exact(levels, x.dtype) else has_nonfinite(x)
               for x, levels in zip(xs, topologies)]
  for index, axis in enumerate(axes):
    axis_size = jax.lax.axis_size(axis)
    batched: dict[strategies.Strategy, list[int]] = {}
    for b, levels in enumerate(topologies):
      lv = levels[index]
      if _done(lv):
        continue
      strategy = resolve_level(lv, axis_size)
      if lv.compressor is None:
        shards[b] = strategy.scatter(shards[b], axis)
        if nonfinite[b] is None:
          nonfinite[b] = has_nonfinite(shards[b])
      elif axis_size == 1:
        shards[b] = jax.lax.psum(shards[b], axis)  # one device: a no-op that marks it reduced
      elif strategies.batches(strategy) and shards[b].size:
        # (An empty shard is summed alone: in a shared collective its zero-size reduce-scatter
        # above would be read and could not be lowered.)
        batched.setdefault(strategy, []).append(b)
      else:
        shards[b], new_states[b][index] = strategy.apply(
            shards[b], lv.compressor, new_states[b][index],
            _level_key(keys[b], levels, index, strategy.shared_key), axis, lv.feedback)
    for strategy, members in batched.items():
      items = [(shards[b], topologies[b][index].compressor, new_states[b][index],
                _level_key(keys[b], topologies[b], index, strategy.shared_key),
                topologies[b][index].feedback)
               for b in members]
      for b, (shard, state) in zip(members, strategy.apply_many(items, axis)):
        shards[b], new_states[b][index] = shard, state
  return ReducedShards(shards, [tuple(level_states) for level_states in new_states], nonfinite)


def shard_zeros(levels: Sequence[Level], size: int) -> jax.Array:
  """Float32 zeros shaped like the shard :func:`reduce_shards` returns for an array of
  ``size`` elements (its padded length divided by the dense levels' sizes), varying over the
  dense levels' axes as that shard does; call inside ``shard_map``."""
  levels = check_levels(levels)
  padded, _ = _shard_sizes(levels, size)
  for lv in levels:
    if lv.compressor is None and not _done(lv):
      padded //= jax.lax.axis_size(lv.axis)
  return vary(jnp.zeros((padded,), jnp.float32), _distinct_axes(levels, len(levels)))


def _first_shard(x: jax.Array, levels: tuple[Level, ...]) -> jax.Array:
  """``x`` divided by the devices it is averaged over, flattened and zero-padded to a
  multiple of the dense levels' sizes."""
  check_float_input(x)
  total = 1
  for lv in levels:
    if not _done(lv):
      total *= jax.lax.axis_size(lv.axis)
  padded, _ = _shard_sizes(levels, x.size)
  return jnp.pad((x / total).astype(x.dtype).reshape(-1), (0, padded - x.size))


def gather_back(shard: jax.Array, x: jax.Array, levels: Sequence[Level]) -> jax.Array:
  """The dense levels' all-gathers of a :func:`reduce_shards` shard, slowest first, back to
  ``x``'s dtype (cast before the gathers) and shape."""
  shard = shard.astype(x.dtype)
  for lv in reversed(levels):
    if lv.compressor is None and not _done(lv):
      shard = resolve_level(lv, jax.lax.axis_size(lv.axis)).gather(shard, lv.axis)
  return shard[:x.size].reshape(x.shape)


def hierarchical_cost(levels: Sequence[Level], size: int, axis_sizes: Mapping[str, int],
                      dtype: Any = jnp.float32) -> dict[str, Cost]:
  """Steps and bytes per device on each level's axis of one :func:`hierarchical_allreduce`
  of ``size`` elements of ``dtype``, from each level's strategy ``cost``; nothing compiled.

  The tests check it against the bytes of the compiled HLO (:mod:`jaxcomm.accounting`).

  Args:
    levels: the topology, fastest first.
    size: elements of the array reduced.
    axis_sizes: devices on each level's axis, e.g. ``dict(mesh.shape)``.
    dtype: the array's dtype.

  Returns:
    ``{axis: Cost}`` for every level (``NO_COST`` where nothing crosses the axis).
  """
  levels = check_levels(levels)
  _, lengths = _shard_sizes(levels, size, axis_sizes.__getitem__)
  costs = {}
  for lv, length in zip(levels, lengths):
    n = axis_sizes[lv.axis]
    skipped = _done(lv) or (lv.compressor is not None and n == 1)
    costs[lv.axis] = NO_COST if skipped else resolve_level(lv, n).cost(
        lv.compressor, length, n, dtype)
  return costs
