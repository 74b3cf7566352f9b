"""How one mesh axis sums a 1-D shard: strategies as values with ``init``, ``apply``, ``cost``.

A strategy is a small immutable value (:class:`Dense`, :class:`Linear`, :class:`Gather`,
:class:`TwoPhase`); :func:`resolve` picks one for a compressor and an axis size, once per
level. The engine (:mod:`jaxcomm.collectives.hierarchical`) calls its ``init`` and ``apply``;
the cost model, the planner and the benchmarks' projections call its ``cost``, which builds
every figure from :func:`jaxcomm.accounting.ring_cost`, the one place the ring factors live;
the tests check ``cost`` against the bytes of the compiled HLO.

Bytes each device sends over the axis, for ``n`` devices, a shard of ``D`` bytes and a payload
of ``c`` bytes for the whole shard (``c_n`` for one of its ``n`` chunks):

===========  ===================================  ============================================
strategy     collectives                          bytes per device
===========  ===================================  ============================================
dense        reduce-scatter + all-gather          ``2 (n-1)/n D`` (``D`` at the sum's dtype)
linear       ``psum`` of the payload              ``2 (n-1)/n c`` (integer codes widened to 4 B)
gather       ``all_gather`` of payloads           ``(n-1) c``
two_phase    ``all_to_all`` + ``all_gather``      ``2 (n-1) c_n ~= 2 c``
===========  ===================================  ============================================

``gather`` grows with the number of peers; ``two_phase`` stays at about ``2 c`` for any ``n``
(Tang et al. 2021's compressed allreduce, here for any compressor): each device decodes and
sums the one chunk it owns, re-compresses it with a server-side residual, and the re-compressed
chunks are all-gathered.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src.accounting import NO_COST, Cost, ring_cost
from jaxcomm._src.compress.base import (AxisContext, Compressor, Shape, combining,
                                        decode_and_sum, decode_each, psum_payload,
                                        replicated_fields, subtract_decoded)
from jaxcomm._src.compress.error_feedback import error_feedback
from jaxcomm._src.nonfinite import has_nonfinite, keep_if

GATHERS = ("all_gather", "psum")
SCATTERS = ("reduce_scatter", "psum")


class TwoPhaseState(NamedTuple):
  """Two-sided error feedback of :func:`two_phase_sum` on one device.

  Attributes:
    worker_residual: float32 ``(n * chunk,)``: what this device's own encode left unsent.
    server_residual: float32 ``(chunk,)``: what the re-encode of the owned chunk left unsent.
  """
  worker_residual: jax.Array
  server_residual: jax.Array


def stateless(compressor: Compressor | None) -> bool:
  """Whether ``compressor`` keeps no state between calls (``not compressor.stateful``)."""
  return compressor is None or not compressor.stateful


def over_axis(axis: str) -> AxisContext:
  """The :class:`~jaxcomm.compress.AxisContext` of an exchange over mesh axis ``axis``: its
  size, and agreement by ``pmax`` over it."""
  return AxisContext(jax.lax.axis_size(axis), lambda value: jax.lax.pmax(value, axis))


@functools.lru_cache(maxsize=256)
def _probe(compressor: Compressor, shape: Shape, dtype_name: str, axis_size: int):
  """``(payload shapes, bytes of each value agreed on)`` of one encode on an axis of
  ``axis_size`` devices; shapes only (``jax.eval_shape``), nothing computed."""
  agreed = []

  def record(value):
    agreed.append(int(np.prod(value.shape, dtype=np.int64)) * jnp.dtype(value.dtype).itemsize)
    return value

  def encode(x, key):
    return compressor.encode(x, compressor.init(x.shape, x.dtype), key)[0]

  with combining(AxisContext(axis_size, record)):
    payload = jax.eval_shape(encode, jax.ShapeDtypeStruct(shape, dtype_name),
                             jax.ShapeDtypeStruct((2,), jnp.uint32))
  return payload, tuple(agreed)


def _agreement_cost(compressor, shape: Shape, dtype: Any, axis_size: int) -> Cost:
  """What one encode's agreements (:class:`~jaxcomm.compress.AxisContext` ``agree_max``, a
  ``pmax`` each) cost; nothing for a payload-size function alone."""
  if not isinstance(compressor, Compressor):
    return NO_COST
  _, agreed = _probe(compressor, tuple(shape), jnp.dtype(dtype).name, axis_size)
  return sum((ring_cost("all-reduce", nbytes, axis_size) for nbytes in agreed), NO_COST)


def _with_feedback(compressor: Compressor, feedback: bool) -> Compressor:
  """The compressor as the gather and linear strategies run it: with error feedback when the
  level keeps it."""
  return error_feedback(compressor) if feedback else compressor


def summed_nbytes(compressor: Compressor, shape: Shape, dtype: Any = jnp.float32,
                  axis_size: int = 1) -> int:
  """Bytes a ``psum`` of ``compressor``'s payload carries (:func:`psum_payload`): integer
  leaves widened to 4 bytes unless the payload is ``OVERFLOW_SAFE``, replicated fields not
  sent. Read from the payload's shapes, nothing computed."""
  payload, _ = _probe(compressor, tuple(shape), jnp.dtype(dtype).name, axis_size)
  widen = not getattr(type(payload), "OVERFLOW_SAFE", False)
  keep = replicated_fields(payload)
  summed = (payload if not keep else
            [leaf for field, leaf in zip(payload._fields, payload) if field not in keep])

  def nbytes(leaf) -> int:
    itemsize = jnp.dtype(leaf.dtype).itemsize
    if widen and jnp.issubdtype(leaf.dtype, jnp.integer):
      itemsize = 4
    return int(np.prod(leaf.shape, dtype=np.int64)) * itemsize
  return sum(nbytes(leaf) for leaf in jax.tree.leaves(summed))


class Dense(NamedTuple):
  """Full precision: reduce-scatter on the way in, all-gather on the way out.

  A dense level's shard of ``D = length * itemsize`` bytes (``length`` a multiple of ``n``) is
  reduce-scattered, ``(n-1)/n D``, and all-gathered back, ``(n-1)/n D``: ``2(n-1)/n D`` per
  device, an all-reduce's bytes, in ``dtype`` when given (bf16/fp16). With
  ``implementation='psum'`` the way in is an all-reduce of ``D`` and this device's slice of it,
  ``2(n-1)/n D``, so ``3(n-1)/n D`` in all.

  Attributes:
    dtype: the dtype the data is summed in (``None``: as given).
    implementation: how the way in runs: ``'reduce_scatter'`` (``psum_scatter``), ``'psum'``
      (``psum`` then this device's slice, for backends whose reduce-scatter is much slower
      than their all-reduce) or ``None`` for the measured preference of the backend and
      process count (:data:`PREFERRED_SCATTER`).
  """
  dtype: Any = None
  implementation: str | None = None
  name = "dense"
  shared_key = False
  own_residuals = False

  def check(self, compressor: Compressor | None) -> None:
    if compressor is not None:
      raise ValueError(f"strategy='dense' sends full precision and takes no compressor; got "
                       f"{compressor.name}: use compressor=None for 'dense', or 'linear', "
                       "'gather' or 'two_phase' with a compressor.")
    if self.implementation is not None and self.implementation not in SCATTERS:
      raise ValueError(f"Dense(implementation=...) must be one of {', '.join(SCATTERS)} or "
                       f"None; got {self.implementation!r}.")

  def init(self, compressor, length: int, axis_size: int, feedback: bool, dtype: Any):
    del compressor, length, axis_size, feedback, dtype
    return ()

  def scatter(self, shard: jax.Array, axis: str) -> jax.Array:
    """This device's ``1/n`` of the sum of ``shard`` over ``axis``."""
    summed = shard.astype(self.dtype or shard.dtype)
    if scatter_implementation(self.implementation) == "psum":
      length = summed.shape[0] // jax.lax.axis_size(axis)
      return jax.lax.dynamic_slice_in_dim(jax.lax.psum(summed, axis),
                                          jax.lax.axis_index(axis) * length, length)
    return jax.lax.psum_scatter(summed, axis, scatter_dimension=0, tiled=True)

  def gather(self, shard: jax.Array, axis: str) -> jax.Array:
    """The ``n`` shards of :meth:`scatter` put back together, on every device."""
    return jax.lax.all_gather(shard, axis, tiled=True, to="invarying")

  def apply(self, shard: jax.Array, compressor, state, key, axis: str, feedback: bool):
    """The sum of ``shard`` over ``axis`` (:meth:`scatter` then :meth:`gather`), float32."""
    del compressor, key, feedback
    total = self.gather(self.scatter(shard, axis), axis)
    return total.astype(jnp.float32), state

  def cost(self, compressor, length: int, axis_size: int, dtype: Any = jnp.float32) -> Cost:
    del compressor
    nbytes = length * jnp.dtype(self.dtype or dtype).itemsize
    psum = scatter_implementation(self.implementation) == "psum"
    way_in = "all-reduce" if psum else "all-gather"
    # A reduce-scatter of D bytes sends what the all-gather back to D bytes sends.
    return ring_cost(way_in, nbytes, axis_size) + ring_cost("all-gather", nbytes, axis_size)


class Linear(NamedTuple):
  """Encode with a key shared over the axis, ``psum`` the payloads, decode once.

  Bytes per device: an all-reduce of the summed payload, ``2(n-1)/n c`` for ``c`` bytes
  (:func:`summed_nbytes`: integer codes widened to 4 B, replicated fields not sent).
  """
  name = "linear"
  shared_key = True
  own_residuals = False

  def check(self, compressor: Compressor | None) -> None:
    _needs_compressor(self, compressor)
    if not compressor.linear:
      raise ValueError(f"strategy='linear' needs a linear compressor (summable payloads); "
                       f"{compressor.name} is not linear: use 'gather' or 'two_phase'.")

  def init(self, compressor, length: int, axis_size: int, feedback: bool, dtype: Any):
    del axis_size
    return _with_feedback(compressor, feedback).init((length,), dtype)

  def apply(self, shard, compressor, state, key, axis: str, feedback: bool):
    return linear_sum(shard, _with_feedback(compressor, feedback), state, key, axis)

  def cost(self, compressor, length: int, axis_size: int, dtype: Any = jnp.float32) -> Cost:
    summed = summed_nbytes(compressor, (length,), dtype, axis_size)
    return (_agreement_cost(compressor, (length,), dtype, axis_size)
            + ring_cost("all-reduce", summed, axis_size))


class Gather(NamedTuple):
  """All-gather every device's payload, decode each and sum in float32.

  Bytes per device: ``(n-1) c`` for a ``c``-byte payload (an all-gather to ``n c``), or
  ``2(n-1) c`` with ``implementation='psum'`` (:func:`psum_gather`).

  Attributes:
    implementation: ``'all_gather'``, ``'psum'`` or ``None`` for the backend's measured
      preference (:data:`PREFERRED_GATHER`).
  """
  implementation: str | None = None
  name = "gather"
  shared_key = False
  own_residuals = False

  def check(self, compressor: Compressor | None) -> None:
    _needs_compressor(self, compressor)

  def init(self, compressor, length: int, axis_size: int, feedback: bool, dtype: Any):
    del axis_size
    return _with_feedback(compressor, feedback).init((length,), dtype)

  def apply(self, shard, compressor, state, key, axis: str, feedback: bool):
    return self.apply_many([(shard, compressor, state, key, feedback)], axis)[0]

  def apply_many(self, items, axis: str) -> list:
    """:meth:`apply` of several shards over ``axis`` with one collective (:func:`gather_sums`).

    Args:
      items: ``(shard, compressor, state, key, feedback)`` per shard, as :meth:`apply` takes.

    Returns:
      ``(sum, new state)`` per shard, each equal to what :meth:`apply` returns for it alone.
    """
    return gather_sums([(shard, _with_feedback(compressor, feedback), state, key)
                        for shard, compressor, state, key, feedback in items],
                       axis, self.implementation)

  def cost(self, compressor, length: int, axis_size: int, dtype: Any = jnp.float32) -> Cost:
    return self.cost_many(compressor, (length,), axis_size, dtype)

  def cost_many(self, compressor, lengths, axis_size: int, dtype: Any = jnp.float32) -> Cost:
    """:meth:`apply_many`'s cost for shards of ``lengths``: each encode's agreements, and one
    collective of all payloads, ``(n-1) sum c`` bytes (the per-shard bytes summed) in the
    steps of one all-gather (nothing for no shards)."""
    if not lengths:
      return NO_COST
    agreements = sum((_agreement_cost(compressor, (length,), dtype, axis_size)
                      for length in lengths), NO_COST)
    payload_bytes = sum(compressor.wire_bytes((length,), dtype) for length in lengths)
    return agreements + _gather_cost(self.implementation, payload_bytes, axis_size)


class TwoPhase(NamedTuple):
  """Compressed all-to-all, decode and re-encode of the owned chunk, compressed all-gather.

  Bytes per device for chunks of ``ceil(length/n)`` elements with ``c_n``-byte payloads: an
  all-to-all of ``n c_n`` and an all-gather to ``n c_n``, ``2(n-1) c_n``, about ``2c`` for any
  ``n`` (:func:`two_phase_sum`). Needs a :func:`stateless` compressor; keeps its own worker and
  server residuals (:class:`TwoPhaseState`) when the level keeps feedback.

  Attributes:
    implementation: the all-gather of the second phase, as for :class:`Gather`.
  """
  implementation: str | None = None
  name = "two_phase"
  shared_key = False
  own_residuals = True

  def check(self, compressor: Compressor | None) -> None:
    _needs_compressor(self, compressor)
    if not stateless(compressor):
      raise ValueError(f"strategy='two_phase' needs a stateless compressor; {compressor.name} "
                       "keeps state between calls: use 'gather'.")

  def init(self, compressor, length: int, axis_size: int, feedback: bool, dtype: Any):
    del compressor, dtype
    return two_phase_init(length, axis_size) if feedback else ()

  def apply(self, shard, compressor, state, key, axis: str, feedback: bool):
    return self.apply_many([(shard, compressor, state, key, feedback)], axis)[0]

  def apply_many(self, items, axis: str) -> list:
    """:meth:`apply` of several shards over ``axis`` with one all-to-all and one all-gather
    (:func:`two_phase_sums`).

    Args:
      items: ``(shard, compressor, state, key, feedback)`` per shard, as :meth:`apply` takes.

    Returns:
      ``(sum, new state)`` per shard, what :meth:`apply` computes for it alone.
    """
    summed = two_phase_sums([(shard, compressor, state or None, key)
                             for shard, compressor, state, key, _ in items],
                            axis, self.implementation)
    return [(total, () if state is None else state) for total, state in summed]

  def cost(self, compressor, length: int, axis_size: int, dtype: Any = jnp.float32) -> Cost:
    return self.cost_many(compressor, (length,), axis_size, dtype)

  def cost_many(self, compressor, lengths, axis_size: int, dtype: Any = jnp.float32) -> Cost:
    """:meth:`apply_many`'s cost for shards of ``lengths``: each encode's agreements, one
    all-to-all of every shard's ``n`` chunk payloads and one all-gather of every shard's
    re-encoded chunk, ``2 (n-1) sum c_n`` bytes (nothing for no shards)."""
    if not lengths:
      return NO_COST
    chunks = [(-(-length // axis_size),) for length in lengths]
    chunk_bytes = sum(compressor.wire_bytes(chunk, dtype) for chunk in chunks)
    agreements = sum((_agreement_cost(compressor, chunk, jnp.float32, axis_size)
                      for chunk in chunks), NO_COST)
    # n chunks encoded, then the owned chunk re-encoded: n + 1 encodes per shard.
    return (Cost(*(count * (axis_size + 1) for count in agreements))
            + ring_cost("all-to-all", axis_size * chunk_bytes, axis_size)
            + _gather_cost(self.implementation, chunk_bytes, axis_size))


Strategy = Dense | Linear | Gather | TwoPhase
BY_NAME = {kind.name: kind() for kind in (Dense, Linear, Gather, TwoPhase)}
STRATEGIES = tuple(BY_NAME)


def batches(strategy: Strategy) -> bool:
  """Whether ``strategy`` sums several shards with one set of collectives (``apply_many``,
  ``cost_many``): :class:`Gather` and :class:`TwoPhase`."""
  return isinstance(strategy, (Gather, TwoPhase))


def level_cost(strategy: Strategy, compressor, lengths, axis_size: int,
               dtype: Any = jnp.float32) -> Cost:
  """One level's cost when the engine sums shards of ``lengths`` in one call
  (:func:`~jaxcomm.collectives.hierarchical.hierarchical_allreduce_many`): the payloads of a
  :func:`batches` strategy share its collectives (``cost_many``); other strategies pay per
  shard."""
  if batches(strategy):
    return strategy.cost_many(compressor, lengths, axis_size, dtype)
  return sum((strategy.cost(compressor, length, axis_size, dtype) for length in lengths),
             NO_COST)


def _needs_compressor(strategy: Strategy, compressor: Compressor | None) -> None:
  if compressor is None:
    raise ValueError(f"strategy={strategy.name!r} needs a compressor; with compressor=None use "
                     "'dense'.")


def _gather_cost(implementation: str | None, payload_bytes: int, axis_size: int) -> Cost:
  """An all-gather of one ``c``-byte payload per device: to ``n c`` bytes, or a ``psum`` of
  the ``n c``-byte slot buffer with ``implementation='psum'``."""
  kind = "all-reduce" if _implementation(implementation) == "psum" else "all-gather"
  return ring_cost(kind, axis_size * payload_bytes, axis_size)


def as_strategy(strategy: str | Strategy | None) -> Strategy | None:
  """A strategy value from a name of :data:`STRATEGIES` (or a value, returned as it is)."""
  if strategy is None or isinstance(strategy, Strategy):
    return strategy
  if isinstance(strategy, str) and strategy in BY_NAME:
    return BY_NAME[strategy]
  raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, a strategy value "
                   f"(Dense(), Linear(), Gather(), TwoPhase()) or None; got {strategy!r}.")


def check_strategy(strategy: str | Strategy | None,
                   compressor: Compressor | None) -> Strategy | None:
  """The strategy value, after checking at construction that it can carry ``compressor``.

  Args:
    strategy: a name from :data:`STRATEGIES`, a strategy value, or ``None`` to choose
      automatically.
    compressor: the compressor before any error-feedback wrapping (``None``: full precision).
      Two-phase needs a :func:`stateless` one: it encodes chunks independently and keeps only
      its own residuals. ``'dense'`` sends full precision and so takes no compressor. A
      compressor that needs a matrix (``compressor.needs_matrix``) cannot run on a level's
      flattened 1-D shard at all.

  Raises:
    ValueError: naming the strategy and the compressor, for every combination that would not
      run as asked (rather than silently running another strategy).
  """
  if compressor is not None and compressor.needs_matrix:
    raise ValueError(f"{compressor.name} factorizes each gradient matrix, but a level "
                     "compresses a flattened 1-D shard: pass it alone as "
                     "compressed_allreduce(compressor) (no levels, policy or strategy), which "
                     "runs its two-round matrix collective.")
  strategy = as_strategy(strategy)
  if strategy is not None:
    strategy.check(compressor)
  return strategy


def resolve(strategy: str | Strategy | None, compressor: Compressor | None,
            axis_size: int) -> Strategy:
  """The strategy to run: the requested one, else dense / linear / two-phase / gather.

  Automatic choice, quality first (measurements in docs/quality.md): full precision is
  ``dense``; a linear compressor is ``linear`` (the exact sum of the payloads); an unbiased
  stateless one is ``two_phase`` once the axis has more than 2 devices (about ``2c`` bytes
  against ``(n-1) c`` for ``gather``; int8 on 8 hosts held fp32's accuracy with it); any
  other is ``gather``. A biased compressor never gets ``two_phase`` automatically: its server
  re-compresses the sum, which cost top-1% 1-3 points against ``gather`` on 8 hosts and made
  scaled sign diverge under SGD with momentum.
  """
  strategy = as_strategy(strategy)
  if strategy is not None:
    return strategy
  if compressor is None:
    return Dense()
  if compressor.linear:
    return Linear()
  if axis_size > 2 and compressor.unbiased and stateless(compressor):
    return TwoPhase()
  return Gather()


def linear_sum(shard: jax.Array, compressor: Compressor, state, key: jax.Array, axis: str):
  """Encode with a key shared over ``axis``, ``psum`` the payloads, decode once.

  ``key`` must be identical on every device of ``axis`` (shared indices / hashes / scales).
  """
  with combining(over_axis(axis)):
    payload, state = compressor.encode(shard, state, key)
    return compressor.decode(psum_payload(payload, axis), shard.shape), state


def _to_bytes(leaf: jax.Array) -> jax.Array:
  """The leaf's bytes as a flat uint8 array ``(nbytes,)`` (booleans as one byte each)."""
  if leaf.dtype == jnp.bool_:
    leaf = leaf.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(leaf.reshape(-1), jnp.uint8).reshape(-1)


def _from_bytes(raw: jax.Array, like: jax.Array) -> jax.Array:
  """Inverse of :func:`_to_bytes` for a leaf shaped and typed like ``like``."""
  if like.dtype == jnp.bool_:
    return raw.astype(jnp.bool_).reshape(like.shape)
  if like.dtype.itemsize > 1:
    raw = raw.reshape(-1, like.dtype.itemsize)
  return jax.lax.bitcast_convert_type(raw, like.dtype).reshape(like.shape)


def _pack_bytes(payload) -> tuple[jax.Array, list[jax.Array], Any, np.ndarray]:
  """A payload pytree as one uint8 buffer ``(c,)`` of exactly its ``c`` bytes (no padding),
  with what :func:`_unpack_bytes` needs."""
  leaves, treedef = jax.tree.flatten(payload)
  raw = [_to_bytes(leaf) for leaf in leaves]
  offsets = np.cumsum([0] + [r.shape[0] for r in raw])
  return jnp.concatenate(raw) if len(raw) > 1 else raw[0], leaves, treedef, offsets


def _unpack_bytes(rows: jax.Array, leaves, treedef, offsets):
  """Inverse of :func:`_pack_bytes` for ``rows`` of shape ``(m, c)``: leaves gain axis ``m``."""
  gathered = [jax.vmap(lambda row, leaf=leaf, a=a, b=b: _from_bytes(row[a:b], leaf))(rows)
              for leaf, a, b in zip(leaves, offsets[:-1], offsets[1:])]
  return treedef.unflatten(gathered)


def _single_leaf(payload) -> bool:
  return len(jax.tree.leaves(payload)) == 1


def psum_gather(payload, axis: str):
  """All-gather built from one ``psum``: each device writes its payload's bytes into its own
  slot of a zero uint8 buffer and the buffers are summed (exact: the other slots are zero).

  It sends ``2(n-1) c`` bytes per device against ``(n-1) c`` for ``all_gather``, and is worth
  it only on backends whose all-reduce is much faster than their all-gather (see
  :data:`PREFERRED_GATHER`). The result is replicated, as ``all_gather``'s is.

  Returns:
    The payload with a leading axis of size ``n``: entry ``i`` is device ``i``'s.
  """
  n = jax.lax.axis_size(axis)
  mine, leaves, treedef, offsets = _pack_bytes(payload)
  slots = jax.lax.dynamic_update_slice(
      jnp.zeros((n, mine.shape[0]), jnp.uint8), mine[None], (jax.lax.axis_index(axis), 0))
  return _unpack_bytes(jax.lax.psum(slots, axis), leaves, treedef, offsets)


def all_gather_payload(payload, axis: str):
  """``all_gather`` of a payload pytree as one collective.

  A payload of several leaves (codes and scales, values and indices) is packed into one
  uint8 buffer of exactly its bytes, so the axis pays one collective's latency and one
  rendezvous per call instead of one per leaf (XLA's CPU backend combines all-reduces but not
  all-gathers). Bytes per device: ``(n-1) c`` for a payload of ``c`` bytes.

  Returns:
    The payload with a leading axis of size ``n``: entry ``i`` is device ``i``'s.
  """
  if _single_leaf(payload):
    return jax.lax.all_gather(payload, axis, to="invarying")
  mine, leaves, treedef, offsets = _pack_bytes(payload)
  return _unpack_bytes(jax.lax.all_gather(mine, axis, to="invarying"), leaves, treedef, offsets)


def all_to_all_payload(payloads, axis: str):
  """``all_to_all`` along the leading axis (one entry per device) of a payload pytree, as one
  collective: several leaves are packed into one uint8 buffer of shape ``(n, c)``, exactly
  their bytes. Bytes per device: ``(n-1)/n`` of the buffer."""
  if _single_leaf(payloads):
    return jax.tree.map(lambda leaf: jax.lax.all_to_all(leaf, axis, 0, 0), payloads)
  leaves, treedef = jax.tree.flatten(payloads)
  per_row = [jax.vmap(_to_bytes)(leaf) for leaf in leaves]
  offsets = np.cumsum([0] + [r.shape[1] for r in per_row])
  received = jax.lax.all_to_all(jnp.concatenate(per_row, axis=1), axis, 0, 0)
  return _unpack_bytes(received, [leaf[0] for leaf in leaves], treedef, offsets)


# Which all-gather each backend runs for the gather and two-phase strategies, chosen by
# measurement (python -m benchmarks.gather_impl; tables in docs/collectives.md): on simulated
# CPU devices all_gather won at every size (32 KiB-4 MiB, 1.7-5x); across two gloo processes
# one run favoured the psum-built gather at 3 of 4 sizes and a second run all_gather at all
# 5, by up to 3.5x. all_gather wins on balance; psum stays available per level.
PREFERRED_GATHER = {"cpu": "all_gather", "gpu": "all_gather", "tpu": "all_gather"}


# Which reduce-scatter a dense level runs, by backend and whether the job spans several
# processes. Across processes the CPU backend runs every collective through gloo over TCP, the
# two devices of one process included, and gloo's reduce-scatter alone took 1.5-2x its
# all-reduce of the same data (docs/slow_link.md, session 11); in the whole step the psum
# way in was 0-8% faster, inside the noise, and fp32-hier's step did not move
# (docs/collectives.md, session 12), so the reduce-scatter stays.
PREFERRED_SCATTER = {("cpu", True): "reduce_scatter"}


def scatter_implementation(implementation: str | None) -> str:
  """``implementation``, or for ``None`` the preference of this backend and process count."""
  key = (jax.default_backend(), jax.process_count() > 1)
  return implementation or PREFERRED_SCATTER.get(key, "reduce_scatter")


def _implementation(implementation: str | None) -> str:
  return implementation or PREFERRED_GATHER.get(jax.default_backend(), "all_gather")


def gather_payloads(payload, axis: str, implementation: str | None = None):
  """All-gather of a payload pytree (``implementation`` from :data:`GATHERS`, or by backend)."""
  if _implementation(implementation) == "psum":
    return psum_gather(payload, axis)
  return all_gather_payload(payload, axis)


def gather_sum(shard: jax.Array, compressor: Compressor, state, key: jax.Array, axis: str,
               implementation: str | None = None):
  """All-gather every device's payload, decode each and sum in float32."""
  return gather_sums([(shard, compressor, state, key)], axis, implementation)[0]


def gather_sums(items, axis: str, implementation: str | None = None) -> list:
  """:func:`gather_sum` of several shards with one collective over ``axis``.

  Every shard is encoded, all the payloads are packed into one uint8 buffer of exactly their
  bytes (:func:`gather_payloads`), gathered at once, and each is decoded and summed: the
  axis pays one rendezvous per step instead of one per shard (XLA's CPU backend does not
  combine all-gathers). Bytes per device: ``(n-1) sum c`` for payloads of ``c`` bytes, what
  one :func:`gather_sum` per shard sends.

  Args:
    items: ``(shard, compressor, state, key)`` per shard, ``shard`` 1-D.
    axis: the mesh axis.
    implementation: as for :func:`gather_payloads`.

  Returns:
    ``(float32 sum of the decoded payloads, new state)`` per shard, as :func:`gather_sum`.
  """
  with combining(over_axis(axis)):
    encoded = [compressor.encode(shard, state, key) for shard, compressor, state, key in items]
    gathered = gather_payloads(tuple(payload for payload, _ in encoded), axis, implementation)
    sums = [decode_and_sum(compressor, payloads, shard.shape)
            for (shard, compressor, _, _), payloads in zip(items, gathered)]
  return [(total, state) for total, (_, state) in zip(sums, encoded)]


def two_phase_init(size: int, axis_size: int) -> TwoPhaseState:
  chunk = -(-size // axis_size)
  return TwoPhaseState(worker_residual=jnp.zeros((chunk * axis_size,), jnp.float32),
                       server_residual=jnp.zeros((chunk,), jnp.float32))


def two_phase_sum(shard: jax.Array, compressor: Compressor, state: TwoPhaseState | None,
                  key: jax.Array, axis: str, implementation: str | None = None):
  """Compressed reduce-scatter (all-to-all) then compressed all-gather, two residuals.

  1. worker: ``a = shard + e_w`` split into ``n`` chunks, each encoded; ``e_w = a - sent``;
  2. ``all_to_all``: device ``j`` receives everyone's chunk ``j``, decodes and sums it;
  3. server: ``b = sum + e_s`` re-encoded; ``e_s = b - sent``;
  4. ``all_gather`` of the re-encoded chunks; decode all ``n`` and concatenate.

  With ``state=None`` no residual is kept (an unbiased compressor without error feedback).
  Non-finite input leaves both residuals as they were.
  """
  return two_phase_sums([(shard, compressor, state, key)], axis, implementation)[0]


def two_phase_sums(items, axis: str, implementation: str | None = None) -> list:
  """:func:`two_phase_sum` of several shards with one all-to-all and one all-gather over
  ``axis``.

  Every shard's chunk payloads cross in one all-to-all and every re-encoded chunk in one
  all-gather, each packed into one uint8 buffer of exactly their bytes: the axis pays two
  rendezvous per call instead of two per shard (XLA's CPU backend combines neither). Bytes
  per device: what one :func:`two_phase_sum` per shard sends.

  Args:
    items: ``(shard, compressor, state, key)`` per shard, as :func:`two_phase_sum` takes.
    axis: the mesh axis.
    implementation: the all-gather, as for :func:`gather_payloads`.

  Returns:
    ``(float32 sum, new state or None)`` per shard, as :func:`two_phase_sum`.
  """
  with combining(over_axis(axis)):
    n = jax.lax.axis_size(axis)
    workers = [_worker_encode(shard, compressor, state, key, n)
               for shard, compressor, state, key in items]
    received = all_to_all_payload(tuple(worker.payloads for worker in workers), axis)
    servers = [_server_encode(compressor, state, worker, chunk_payloads)
               for (_, compressor, state, _), worker, chunk_payloads
               in zip(items, workers, received)]
    gathered = gather_payloads(tuple(payload for _, payload in servers), axis, implementation)
    return [_two_phase_result(shard, compressor, state, worker, server, server_payloads)
            for (shard, compressor, state, _), worker, server, server_payloads
            in zip(items, workers, servers, gathered)]


class _WorkerChunks(NamedTuple):
  """One shard's first phase on one device: ``chunks``, float32 ``(n, chunk)`` (the shard
  plus the worker residual, zero-padded), their ``payloads`` (leaves with a leading axis
  ``n``), and the key of the server's re-encode."""
  chunks: jax.Array
  payloads: Any
  server_key: jax.Array


def _worker_encode(shard, compressor, state, key, n: int) -> _WorkerChunks:
  """The first phase of one shard: ``shard`` plus the worker residual, in ``n`` chunks, each
  encoded with its own key."""
  size = shard.shape[0]
  chunk = -(-size // n)
  keys = jax.random.split(key, n + 1)
  corrected = jnp.pad(shard.astype(jnp.float32), (0, chunk * n - size))
  if state is not None:
    corrected = corrected + state.worker_residual
  chunks = corrected.reshape(n, chunk)
  # One encode per chunk, not a vmap: under vmap, a conditional inside the encode (top-k's
  # sampled path for chunks of 2^15 or more) becomes a select that runs both branches, and a
  # batched TopK saved nothing measurable in the char LM's step (docs/collectives.md).
  payloads = jax.tree.map(lambda *leaves: jnp.stack(leaves),
                          *[compressor.encode(chunks[i], (), keys[i])[0] for i in range(n)])
  return _WorkerChunks(chunks, payloads, keys[n])


def _server_encode(compressor, state, worker: _WorkerChunks, received):
  """``(owned, payload)``: this device's chunk summed over the axis (plus the server
  residual) and its re-encoded payload."""
  owned = decode_and_sum(compressor, received, worker.chunks.shape[1:])
  if state is not None:
    owned = owned + state.server_residual
  return owned, compressor.encode(owned, (), worker.server_key)[0]


def _two_phase_result(shard, compressor, state, worker: _WorkerChunks, server, gathered):
  """``(total, new state)`` of one shard from the gathered re-encoded chunks."""
  chunk = worker.chunks.shape[1:]
  total = decode_each(compressor, gathered, chunk).reshape(-1)[:shard.shape[0]]
  if state is None:
    return total, None
  owned, server_payload = server
  # Both residuals without a dense decode where the compressor has its own subtraction
  # (top-k: its values scattered into the input), bit for bit the same.
  worker_residual = jax.vmap(lambda x, p: subtract_decoded(compressor, x, p))(
      worker.chunks, worker.payloads).reshape(-1)
  server_residual = subtract_decoded(compressor, owned, server_payload)
  return total, keep_if(has_nonfinite(shard), state,
                        TwoPhaseState(worker_residual, server_residual))
