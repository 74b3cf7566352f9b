"""``compressed_allreduce``: the topology-aware gradient mean as an optax transformation."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.collectives import buckets as bucketing
from jaxcomm._src.mesh_axes import require_axes, require_varying
from jaxcomm._src.collectives.hierarchical import (Level, check_levels, gather_back,
                                                   init_states, level, reduce_shards,
                                                   shard_zeros)
from jaxcomm._src.collectives.strategies import (Strategy, TwoPhaseState, as_strategy,
                                                   check_strategy)
from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.optim import hsdp
from jaxcomm._src.validation import check_dtype, check_float_tree
from jaxcomm._src.compress.error_feedback import (ErrorFeedbackState, EstimateFeedbackState,
                                                  error_feedback, estimate_feedback)
from jaxcomm._src.compress.policy import CompressionPolicy
from jaxcomm._src.keys import as_key, check_seed
from jaxcomm._src.nonfinite import (agree, check_nonfinite_mode, keep_finite, keep_if, zero_if,
                                    zero_nonfinite)
from jaxcomm._src.optim.powersgd import matrix_allreduce
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS

FEEDBACKS = ("estimate", "bounded", "residual", "none")
RESIDUAL_DTYPES = (jnp.float32, jnp.bfloat16)


class CompressedAllReduceState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    estimates: one entry per bucket: with ``feedback='estimate'`` (EF21) on a slow axis of more
      than one device, this device's shard of the mean of every device's estimate, which the
      update all-gathers over the fast axis and returns; else ``()``. Float32 of the bucket's
      flat size zero-padded to a multiple of the fast axis's size, divided by it (the
      full bucket with one device per host); device-local over the fast axis, replicated
      over the slow one.
    level_states: one entry per bucket (per gradient leaf without bucketing, in
      ``jax.tree.leaves`` order), each a tuple with one state per level (``()`` for dense
      levels), e.g. ``level_states[i][1].residual`` is the error-feedback residual of leaf
      ``i``'s slow-axis shard. Device-local (varying over the mesh axes): inside ``shard_map``
      a leaf of shape ``(n,)`` is this device's; outside it is the concatenation over devices,
      sharded along its first dimension. :func:`jaxcomm.optim.sharded_init` builds these specs.
    key: PRNG key, replicated; split every step.
    count: int32 step counter, replicated; a skipped step does not count.
    skipped_steps: int32, replicated: steps skipped by ``nonfinite='skip'`` because some
      device's gradients held a NaN or Inf.
  """
  estimates: tuple
  level_states: tuple
  key: jax.Array
  count: jax.Array
  skipped_steps: jax.Array


def _check_two_level_axes(fast_axis, slow_axis) -> None:
  for name, axis in (("fast_axis", fast_axis), ("slow_axis", slow_axis)):
    if not isinstance(axis, str) or not axis:
      raise TypeError(f"{name} must be a non-empty mesh axis name, got {axis!r}.")
  if fast_axis == slow_axis:
    raise ValueError(f"fast_axis and slow_axis must differ, both are {fast_axis!r}.")


# EF21 refreshes every coordinate's estimate only as fast as the compressor contracts: a
# sparsifier's estimates go stale for about 1/delta steps, which a momentum after the mean
# turns into divergence (top-1%, delta 0.08, 2x4, SGD momentum 0.9: docs/quality.md), while
# scaled sign (delta 0.64) needs the estimates to converge at all. Residuals (bounded:
# RESIDUAL_BOUND) stay the default below this contraction; 0.5 also keeps top-10% (0.44),
# not measured with estimates, on residuals.
ESTIMATE_MIN_CONTRACTION = 0.5

# feedback='bounded' keeps a residual of norm at most this many times the current input's
# (jaxcomm.compress.error_feedback(bound=)). Top-1%'s classic residual grew to 20-1200 times
# the gradient once the model fit the data and was released in bursts that a momentum after
# the mean turned into loss spikes (up to the initial loss); capped at 3, top-1% under SGD
# momentum 0.9 on 8x1 went from -0.89 to -0.06 points of fp32 over seeds 0-4; bounds 1.5 and
# 10 lost 0.45 and 0.67 points there (docs/quality.md, section 9).
RESIDUAL_BOUND = 3.0


def contraction(compressor: Compressor, size: int = 4096) -> float:
  """``delta = 1 - ||C(x) - x||^2 / ||x||^2`` on a fixed standard normal ``x`` of ``size``
  elements: 2/pi for scaled sign, about 1 for 8-bit quantization, k/d plus the tail's share
  for top-k (0.09 for 1%); negative for unbiased compressors whose variance exceeds
  ``||x||^2``."""
  with jax.ensure_compile_time_eval():
    x = jax.random.normal(jax.random.PRNGKey(0), (size,))
    payload, _ = compressor.encode(x, compressor.init((size,), jnp.float32),
                                   jax.random.PRNGKey(1))
    error = compressor.decode(payload, (size,)) - x
    return float(1.0 - jnp.sum(error ** 2) / jnp.sum(x ** 2))


def _feedback_for(feedback: str, compressor: Compressor | None) -> str:
  """``'auto'`` resolved for one compressor: ``'estimate'`` for a biased compressor of
  flattened shards that contracts by at least :data:`ESTIMATE_MIN_CONTRACTION`,
  ``'bounded'`` for one that contracts less (sparsifiers), else ``'residual'`` (matrix
  compressors keep their collective's residuals; an unbiased one may then use two-phase: see
  :func:`~jaxcomm.collectives.strategies.resolve`)."""
  if feedback != "auto" or compressor is None:
    return feedback
  if compressor.unbiased or compressor.needs_matrix:
    return "residual"
  return "estimate" if contraction(compressor) >= ESTIMATE_MIN_CONTRACTION else "bounded"


def _check_feedback(feedback, strategy, residual_dtype) -> str:
  """The feedback mode named by ``feedback``.

  ``True`` is ``'auto'`` (resolved per compressor by :func:`_feedback_for`) except where
  estimates cannot be kept exactly, which keep ``'residual'``: the ``two_phase`` strategy
  (its own worker and server residuals) and a ``bfloat16`` ``residual_dtype``. ``False`` is
  ``'none'``.
  """
  own_residuals = strategy is not None and strategy.own_residuals
  if feedback is True:
    keeps_residuals = own_residuals or residual_dtype != jnp.float32
    return "residual" if keeps_residuals else "auto"
  if feedback is False:
    feedback = "none"
  if feedback not in FEEDBACKS:
    raise ValueError(f"feedback must be one of {', '.join(FEEDBACKS)} or a bool; got "
                     f"{feedback!r}.")
  if feedback in ("estimate", "bounded") and own_residuals:
    raise ValueError("strategy='two_phase' keeps its own worker and server residuals: use it "
                     f"with feedback='residual' (or 'none'), or use feedback={feedback!r} "
                     "with 'gather' or 'linear'.")
  if feedback == "estimate" and residual_dtype != jnp.float32:
    raise ValueError(f"residual_dtype={jnp.dtype(residual_dtype).name} needs "
                     "feedback='residual': the EF21 estimates stay float32 so that the "
                     "estimate of the mean is exactly the mean of the devices' estimates.")
  return feedback


def _leaf_topologies(compressor, strategy, feedback, levels, fast_axis, slow_axis):
  """``topologies(tree) -> (distinct topologies, topology index per leaf)``, validated now.

  ``feedback`` is the mode from :func:`_check_feedback`, or ``None`` when the caller left
  ``feedback`` at its default (the only setting allowed with ``levels``).
  """
  if levels is not None:
    if compressor is not None or strategy is not None or feedback is not None:
      raise ValueError("Pass either levels or compressor/strategy/feedback, not both: each "
                       "Level carries its own compressor, strategy and feedback.")
    fixed = check_levels(levels)
    return (fixed,), lambda tree: [0] * len(jax.tree.leaves(tree))
  _check_two_level_axes(fast_axis, slow_axis)

  def make(choice):
    if strategy is not None:  # checked on the user's compressor, before any feedback wrapping
      check_strategy(strategy, choice)
    mode = _feedback_for(feedback, choice)
    if mode == "estimate":
      choice = estimate_feedback(choice)
    elif mode == "bounded":
      choice = error_feedback(choice, bound=RESIDUAL_BOUND)
    return (level(fast_axis),
            level(slow_axis, choice, strategy=strategy, feedback=mode == "residual"))

  if not isinstance(compressor, CompressionPolicy):
    return (make(compressor),), lambda tree: [0] * len(jax.tree.leaves(tree))
  choices = [compressor.default] + [rule.compressor for rule in compressor.rules] + [None]
  distinct = list(dict.fromkeys(id(c) for c in choices))
  by_id = {id(c): c for c in choices}
  topologies = tuple(make(by_id[i]) for i in distinct)
  return topologies, lambda tree: [distinct.index(id(c)) for c in compressor.assign(tree)]


def _estimated(levels) -> bool:
  """Whether ``levels`` returns the change of an EF21 estimate rather than the mean itself:
  some level compresses with :func:`estimate_feedback` over more than one device."""
  return any(lv.compressor is not None and jax.lax.axis_size(lv.axis) > 1
             and isinstance(lv.compressor.init((1,), jnp.float32), EstimateFeedbackState)
             for lv in levels)


def _is_residual_node(node) -> bool:
  return isinstance(node, (ErrorFeedbackState, TwoPhaseState))


def _cast_residuals(level_states, dtype):
  """``level_states`` with every error-feedback residual (worker and server) cast to ``dtype``."""
  def cast(node):
    if isinstance(node, ErrorFeedbackState):
      return node._replace(residual=node.residual.astype(dtype))
    if isinstance(node, TwoPhaseState):
      return TwoPhaseState(*(residual.astype(dtype) for residual in node))
    return node
  return jax.tree.map(cast, level_states, is_leaf=_is_residual_node)


def _check_arguments(compressor, feedback, nonfinite) -> None:
  """Raises naming the argument of :func:`compressed_allreduce` that has a wrong type or value."""
  if compressor is not None and not isinstance(compressor, (Compressor, CompressionPolicy)):
    raise TypeError("compressor must be a jaxcomm.Compressor, a jaxcomm.policy(...) or None, "
                    f"got {type(compressor).__name__}.")
  if not isinstance(feedback, (bool, str)):
    raise TypeError(f"feedback must be a bool or one of {', '.join(FEEDBACKS)}, got "
                    f"{feedback!r}.")
  check_nonfinite_mode(nonfinite)


def _level_inputs(packed: list[jax.Array], estimates) -> list[jax.Array]:
  """What the levels reduce of each bucket: float32 where it keeps an EF21 estimate (so that
  the estimate stays exactly the mean of the devices' estimates), else the bucket itself."""
  return [x.astype(jnp.float32) if isinstance(estimate, jax.Array) else x
          for x, estimate in zip(packed, estimates)]


def _reduce_buckets(inputs: list[jax.Array], topologies, level_states, estimates,
                    keys: list[jax.Array]):
  """``(shards, new level states, new estimates, nonfinite)`` of every bucket's
  :func:`_level_inputs`, in one engine call
  (:func:`~jaxcomm.collectives.hierarchical.reduce_shards`: the gather levels send all
  buckets' payloads in one collective); ``nonfinite`` is the bool scalar "some bucket holds a
  NaN or Inf" of this device, not agreed (:class:`~jaxcomm.collectives.hierarchical.ReducedShards`).

  With an EF21 estimate the levels return this device's shard of the summed change of the
  devices' estimates; it is added to the estimate's shard, and :func:`_gather_means` gathers
  that new shard back (in float32, then cast): the same values as gathering the change and
  adding the whole estimate, without a pass over a full-size copy.
  """
  shards, level_states, nonfinite = reduce_shards(inputs, topologies, level_states, keys)
  estimates = [estimate + shard if isinstance(estimate, jax.Array) else estimate
               for estimate, shard in zip(estimates, shards)]
  return (shards, level_states, estimates,
          functools.reduce(jnp.logical_or, nonfinite, jnp.zeros((), jnp.bool_)))


def _gather_means(packed: list[jax.Array], inputs: list[jax.Array], topologies, shards,
                  estimates) -> list[jax.Array]:
  """Each bucket's mean: its reduced shard, or its EF21 estimate's shard, gathered back over
  the levels and cast to the bucket's dtype."""
  return [gather_back(estimate if isinstance(estimate, jax.Array) else shard, x32,
                      levels).astype(x.dtype)
          for x, x32, shard, estimate, levels
          in zip(packed, inputs, shards, estimates, topologies)]


def compressed_allreduce(
    compressor: Compressor | None = None,
    *,
    strategy: str | Strategy | None = None,
    feedback: bool | str = True,
    levels: Sequence[Level] | None = None,
    bucket_bytes: int | None = None,
    fast_axis: str = LOCAL_AXIS,
    slow_axis: str = HOST_AXIS,
    seed: int | jax.Array = 0,
    nonfinite: str = "skip",
    residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformation:
  """Averages per-device gradients: full precision inside a host, compressed across hosts.

  Place it first in an ``optax.chain``; the transformations after it see the global mean
  gradient, identical on every device. Both ``init`` and ``update`` run inside
  ``jax.shard_map`` over a mesh with the topology's axes. The state is partly device-local:
  create it with :func:`jaxcomm.optim.sharded_init`, which also returns the ``PartitionSpec`` pytree
  to use for it in the train step's ``in_specs``/``out_specs``.

  In front of an adaptive optimizer (``optax.adamw``) no feedback mode gives fp32's quality:
  error feedback conserves the sum of the means it returns, while Adam's step depends on their
  squares too (docs/quality.md, sections 8 and 11). Per-chunk sign scales
  (``jaxcomm.sign(64)``) narrow the gap; :func:`jaxcomm.optim.compress_updates`, which
  compresses Adam's update instead, closes it.

  Bytes per device and step for each bucket of ``D`` bytes on the default two levels
  (``G`` devices per host, ``H`` hosts, payload ``c`` for the bucket's ``1/G`` shard):
  ``2(G-1)/G D`` over the fast axis; over the slow axis ``(H-1) c`` (gather), about ``2c``
  (two-phase) or ``2(H-1)/H c`` (linear). See :mod:`jaxcomm.collectives.strategies`.

  Args:
    compressor: compressor for the slow axis, e.g. ``jaxcomm.topk(0.01)``; ``None`` for full
      precision everywhere; or a :func:`jaxcomm.policy` choosing one per leaf (leaves with
      the same choice share buckets). A compressor that needs a matrix
      (``jaxcomm.powersgd(r)``) runs PowerSGD's two-round collective on each leaf's matrix
      (:func:`jaxcomm.powersgd_allreduce` and its state; no strategy, buckets or bf16
      residuals).
    strategy: how the slow axis sums payloads: a strategy value of
      :mod:`jaxcomm.collectives` (``Linear()``, ``Gather()``, ``TwoPhase()``, ``Dense()``) or
      its name (``'linear'``, ``'gather'``, ``'two_phase'``, ``'dense'``), or ``None`` to
      choose from the compressor's facts and the axis size
      (:func:`~jaxcomm.collectives.resolve`).
    feedback: how what a compressor did not send is carried over. ``'estimate'`` (EF21):
      every device keeps an estimate of its shard and sends the compressed change of it;
      every device keeps its shard of the mean of the estimates (float32, ``1/G`` of the
      gradient) and returns the mean, so nothing unsent is released late in a burst, which a
      momentum after the mean amplifies into divergence (docs/quality.md). ``'residual'``:
      classic error feedback, the unsent rest added to the next input (with ``two_phase``,
      worker and server residuals). ``'bounded'``: classic residuals whose norm is capped at
      :data:`RESIDUAL_BOUND` times this step's input's (per device and bucket; the excess is
      dropped: :func:`jaxcomm.compress.error_feedback` ``bound``), so no stale mass many times
      the current gradient is released into the momentum after the mean (docs/quality.md,
      section 9). ``'none'`` (``False``): nothing is carried over.
      ``True`` (default): per compressor, ``'estimate'`` for a biased one whose
      :func:`contraction` is at least :data:`ESTIMATE_MIN_CONTRACTION` (sign), ``'bounded'``
      for a biased one below it (sparsifiers such as top-k, whose estimates would go stale),
      ``'residual'`` for unbiased compressors (int8, which may then use ``two_phase``);
      ``'residual'`` always with ``two_phase`` or a ``bfloat16`` ``residual_dtype``. With
      ``'linear'`` the estimates stay exact where decoding is linear too (every linear
      compressor here but a count sketch of depth > 1, whose median decoding of the summed
      sketch is not the sum of the devices' decodings).
    levels: a full topology instead of ``compressor``/``strategy``/``feedback``: a sequence of
      :func:`jaxcomm.collectives.level`, fastest first (e.g. chip, host, pod).
    bucket_bytes: pack consecutive leaves of one dtype into flat buckets of at most this many
      bytes, so each level issues one collective per bucket; ``None``: one per leaf.
    fast_axis: the intra-host mesh axis name (two-level form).
    slow_axis: the inter-host mesh axis name (two-level form).
    seed: int seed or PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``) of the key
      used by stochastic compressors; an int and either key made from it draw alike.
    nonfinite: what a NaN or Inf in any device's gradients does to the step. All devices
      ``'skip'`` (default): the devices agree with one 4-byte ``psum`` over every mesh axis
      (``2(N-1)/N * 4`` bytes per device for ``N`` devices), and if any saw one, every device
      returns zero updates and the state unchanged except ``skipped_steps``. ``'zero'``:
      non-finite entries are replaced by 0 before the reduction (no agreement needed).
      ``'propagate'``: the mean carries them on to the next transformation. In every mode
      residuals and other floating-point state never take a non-finite value: an entry that
      would keeps its previous value.
    residual_dtype: dtype the error-feedback residuals (worker and server) are kept in between
      steps: ``float32`` (default) or ``bfloat16``, which halves their memory and rounds what
      is carried over to 8 significant bits. They are widened to float32 for the update.
      EF21 estimates are always float32 (``feedback='estimate'`` refuses ``bfloat16``).

  Returns:
    An ``optax.GradientTransformation``. ``update(grads, state, params=None)`` expects this
    device's own gradients (varying over every axis: see :func:`jaxcomm.optim.local_grad`) and
    returns their mean.

  Example:
    >>> tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.sign()),
    ...                  optax.sgd(0.1, momentum=0.9))  # doctest: +SKIP

    With AdamW, compress its update instead (docs/quality.md, section 8):

    >>> tx = jaxcomm.optim.compress_updates(optax.adamw(1e-3), jaxcomm.sign())  # doctest: +SKIP
  """
  _check_arguments(compressor, feedback, nonfinite)
  seed = check_seed("seed", seed)
  residual_dtype = check_dtype("residual_dtype", residual_dtype, RESIDUAL_DTYPES)
  left_default = feedback is True
  strategy = as_strategy(strategy)
  feedback = _check_feedback(feedback, strategy, residual_dtype)
  if isinstance(compressor, Compressor) and compressor.needs_matrix and levels is None:
    _check_two_level_axes(fast_axis, slow_axis)
    if feedback in ("estimate", "bounded"):
      raise ValueError(f"feedback={feedback!r} is not available for {compressor.name}, which "
                       "compresses whole matrices: use 'residual' or 'none'.")
    return matrix_allreduce(compressor, strategy=strategy, feedback=feedback != "none",
                            bucket_bytes=bucket_bytes, residual_dtype=residual_dtype,
                            nonfinite=nonfinite, fast_axis=fast_axis, slow_axis=slow_axis)
  topologies, topology_of_leaves = _leaf_topologies(
      compressor, strategy, None if left_default and levels is not None else feedback, levels,
      fast_axis, slow_axis)
  bucket_bytes = bucketing.check_bucket_bytes(bucket_bytes)
  axes = tuple(lv.axis for lv in topologies[0])

  def plan(tree):
    """Buckets of leaves sharing a topology; ``bucket.group`` indexes ``topologies``."""
    return bucketing.plan_buckets(jax.tree.leaves(tree), bucket_bytes, topology_of_leaves(tree))

  def init(params) -> CompressedAllReduceState:
    require_axes(axes, "compressed_allreduce.init")
    check_float_tree(params, "params")
    buckets = plan(params)
    level_states = tuple(init_states(topologies[bucket.group], bucket.size, bucket.dtype)
                         for bucket in buckets)
    estimates = tuple(shard_zeros(topologies[bucket.group], bucket.size)
                      if _estimated(topologies[bucket.group]) else () for bucket in buckets)
    return CompressedAllReduceState(
        estimates=estimates,
        level_states=_cast_residuals(level_states, residual_dtype),
        key=as_key(seed),
        count=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32))

  def update(grads, state: CompressedAllReduceState, params=None):
    del params
    require_axes(axes, "compressed_allreduce.update")
    check_float_tree(grads, "grads")
    require_varying(grads, axes, "compressed_allreduce.update")
    key, step_key = jax.random.split(state.key)
    leaves, treedef = jax.tree.flatten(grads)
    if nonfinite == "zero":
      leaves = zero_nonfinite(leaves)
    buckets = plan(grads)
    packed = [bucketing.pack(leaves, bucket) for bucket in buckets]
    inputs = _level_inputs(packed, state.estimates)
    bucket_topologies = [topologies[bucket.group] for bucket in buckets]
    shards, new_states, estimates, nonfinite_here = _reduce_buckets(
        inputs, bucket_topologies, _cast_residuals(state.level_states, jnp.float32),
        state.estimates, [jax.random.fold_in(step_key, index) for index in range(len(buckets))])
    new_states = keep_finite(_cast_residuals(tuple(new_states), residual_dtype),
                             state.level_states)
    new_state = CompressedAllReduceState(
        estimates=keep_finite(tuple(estimates), state.estimates), level_states=new_states,
        key=key, count=state.count + 1, skipped_steps=state.skipped_steps)
    if nonfinite == "skip":
      skip = agree(nonfinite_here, axes)
      new_state = keep_if(skip, state, new_state)._replace(
          skipped_steps=state.skipped_steps + skip)
      # The means come from the estimates kept: one pass makes the new estimate, keeps it and
      # feeds the gather, where gathering the unkept one took a second. Equal unless the step
      # is skipped (its means are zeroed) or an estimate overflowed from finite inputs (its
      # old, finite entries are sent instead of an Inf).
      estimates = new_state.estimates
    bucket_means = _gather_means(packed, inputs, bucket_topologies, shards, estimates)
    if nonfinite == "skip":
      bucket_means = zero_if(skip, bucket_means)
    means: list[Any] = [None] * len(leaves)
    for bucket, mean in zip(buckets, bucket_means):
      for leaf_index, leaf_mean in zip(bucket.leaves, bucketing.unpack(mean, bucket)):
        means[leaf_index] = leaf_mean
    return treedef.unflatten(means), new_state

  return hsdp.shard_aware(optax.GradientTransformation(init, update))
