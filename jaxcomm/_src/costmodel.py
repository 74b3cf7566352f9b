"""The implementation of :mod:`jaxcomm.costmodel` (private: import that module)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxcomm._src.accounting import NO_COST, Collective, CommReport, Cost, ring_cost
from jaxcomm._src.collectives import strategies
from jaxcomm._src.compress.base import Compressor
from jaxcomm._src.links import Link, link

LinkLike = Link | str
Shape = tuple[int, ...]


def _as_link(spec: LinkLike) -> Link:
  if isinstance(spec, Link):
    return spec
  if isinstance(spec, str):
    return link(spec)
  raise TypeError(f"expected a jaxcomm.links.Link or a preset name, got {spec!r}.")


def _check_nbytes(nbytes: float) -> float:
  if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not nbytes >= 0:
    raise ValueError(f"nbytes must be a real number >= 0, got {nbytes!r}.")
  return float(nbytes)


def _check_devices(name: str, devices: int) -> int:
  if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
    raise ValueError(f"{name} must be an int >= 1, got {devices!r}.")
  return int(devices)


def _cost(kind: str, result_bytes: float, devices: int) -> Cost:
  """:func:`~jaxcomm.accounting.ring_cost` with its arguments checked."""
  return ring_cost(kind, _check_nbytes(result_bytes), _check_devices("devices", devices))


def all_reduce_time(nbytes: float, devices: int, spec: LinkLike) -> float:
  """Ring all-reduce of ``D = nbytes`` on each device: ``2(n-1) alpha + 2(n-1)/n D beta``."""
  return _cost("all-reduce", nbytes, devices).seconds(_as_link(spec))


def all_gather_time(nbytes: float, devices: int, spec: LinkLike) -> float:
  """Ring all-gather whose *gathered* result is ``D = nbytes``: ``(n-1) alpha + (n-1)/n D beta``.

  Each device contributes a ``D/n`` shard, so with ``c``-byte payloads ``D = n c`` and the
  time is ``(n-1) alpha + (n-1) c beta``.
  """
  return _cost("all-gather", nbytes, devices).seconds(_as_link(spec))


def reduce_scatter_time(nbytes: float, devices: int, spec: LinkLike) -> float:
  """Ring reduce-scatter of a ``D = nbytes`` input into ``n`` shards.

  Time ``(n-1) alpha + (n-1)/n D beta``; ``D`` is the full input, ``n`` times the result.
  """
  devices = _check_devices("devices", devices)
  return _cost("reduce-scatter", nbytes / devices, devices).seconds(_as_link(spec))


def all_to_all_time(nbytes: float, devices: int, spec: LinkLike) -> float:
  """All-to-all of a ``D = nbytes`` buffer per device: ``(n-1) alpha + (n-1)/n D beta``.

  Each device keeps one of its ``n`` chunks and sends the other ``n-1``, one per step.
  """
  return _cost("all-to-all", nbytes, devices).seconds(_as_link(spec))


def ppermute_time(nbytes: float, spec: LinkLike) -> float:
  """One ``ppermute`` (collective-permute) step sending ``D = nbytes``: ``alpha + D beta``."""
  return _cost("collective-permute", nbytes, 2).seconds(_as_link(spec))


def _collective_cost(op: Collective) -> Cost:
  if op.kind == "collective-permute" and op.bytes_per_device == 0:
    return NO_COST  # no device sends: nothing to wait for.
  # A permute's time is set by a device that sends: its whole result.
  return ring_cost(op.kind, op.result_bytes, op.group_size)


def collective_time(collective: Collective, spec: LinkLike) -> float:
  """Modeled seconds of one collective read from compiled HLO, on one link.

  Uses the collective's ``result_bytes`` ``S`` and ``group_size`` ``n`` from the HLO: an
  all-reduce, all-gather or all-to-all moves ``D = S``, a reduce-scatter ``D = n S`` (its
  result is one shard), a collective-permute ``S`` from each sending device. For the ring
  collectives the bytes term equals ``collective.bytes_per_device * beta``.

  Args:
    collective: one entry of ``CommReport.collectives``.
    spec: the link it runs on (a :class:`~jaxcomm.links.Link` or a preset name).

  Returns:
    Seconds per execution.
  """
  return _collective_cost(collective).seconds(_as_link(spec))


class CommTime(NamedTuple):
  """Modeled communication time of one call of a compiled function.

  Attributes:
    per_axis: seconds charged to each mesh axis (a collective spanning several axes is
      charged to the one of their links on which it takes longest).
    total: seconds in all, ``sum(per_axis.values())``: collectives run one after another.
    per_collective: seconds of each collective, in ``report.collectives`` order.
  """
  per_axis: dict[str, float]
  total: float
  per_collective: tuple[float, ...]


def slowest_first(links: Mapping[str, LinkLike]) -> tuple[str, ...]:
  """Axis names ordered from the slowest link to the fastest.

  Slowest means lowest bandwidth, then highest latency. Pass the result to
  ``CommReport.link_bytes(slowest_first=...)`` to get bytes charged the way :func:`predict`
  charges time.
  """
  resolved = {axis: _as_link(spec) for axis, spec in links.items()}
  return tuple(sorted(resolved, key=lambda axis: (resolved[axis].bandwidth_bytes_per_s,
                                                  -resolved[axis].latency_s)))


def _check_links(report: CommReport, links: Mapping[str, LinkLike]) -> dict[str, Link]:
  unknown = [axis for axis in links if axis not in report.mesh_axes]
  if unknown:
    raise ValueError(f"links given for {unknown[0]!r}, which is not a mesh axis; the mesh "
                     f"axes are {report.mesh_axes}.")
  used = {axis for op in report.collectives for axis in op.axes}
  missing = [axis for axis in report.mesh_axes if axis in used and axis not in links]
  if missing:
    raise ValueError(f"no link for mesh axis {missing[0]!r}, which the collectives use; "
                     f"links were given for {tuple(links)}.")
  return {axis: _as_link(spec) for axis, spec in links.items()}


def _charge(op: Collective, links: Mapping[str, Link], order: Sequence[str]) -> dict[str, float]:
  """Seconds of one execution of ``op`` charged to each of its axes.

  An all-to-all over several axes sends each peer its block over the slowest axis on which
  the peer differs (:meth:`~jaxcomm.accounting.Collective.split_cost`, the split
  ``CommReport.link_bytes`` uses): each axis is charged its own peers and bytes on its own link,
  one step after another. Any other collective over several axes is one ring whose every step
  waits for the slowest hop: timed on, and charged to, the link on which it takes longest.
  """
  if op.kind == "all-to-all" and len(op.axes) > 1:
    return {axis: cost.seconds(links[axis]) for axis, cost in op.split_cost(order).items()}
  on_each = {axis: collective_time(op, links[axis]) for axis in op.axes}
  slowest = max(sorted(op.axes, key=list(order).index), key=on_each.__getitem__)
  return {slowest: on_each[slowest]}


def predict(report: CommReport, links: Mapping[str, LinkLike],
            branch_weights: Mapping[str, Sequence[float]] | None = None) -> CommTime:
  """Modeled communication seconds per call of a compiled function, per mesh axis.

  Each collective of ``report`` is timed with :func:`collective_time` on the link of the
  axis it spans. A ring collective over several axes (e.g. a flat ``psum`` over
  ``('host', 'local')``) is one ring over all ``n`` devices: every step moves a chunk across
  each kind of hop at once and waits for the slowest, so it is timed on, and charged to, the
  link among its axes on which it takes longest. When lower bandwidth comes with higher
  latency (all the presets) that is the first axis of :func:`slowest_first`, the axis
  ``CommReport.link_bytes(slowest_first(links))`` charges its bytes to. An all-to-all over
  several axes is split over them as ``link_bytes`` splits its bytes: each axis pays, on its own
  link, the steps and bytes to the peers it reaches.

  Args:
    report: from :func:`jaxcomm.accounting.measure`.
    links: a link (or preset name) for every mesh axis the collectives use, e.g.
      ``{'host': '100gbe', 'local': 'nvlink4'}``.
    branch_weights: how often each branch of an outermost ``lax.cond``/``lax.switch`` runs
      per call (see :meth:`~jaxcomm.accounting.CommReport.link_bytes`); a collective's time
      is multiplied by its branch's weight. ``None``: every collective once per call.

  Returns:
    A :class:`CommTime`.

  Raises:
    ValueError: if an axis used by a collective has no link, or ``links`` names an axis
      that is not in the mesh.

  Example:
    >>> report = jaxcomm.accounting.measure(train_step, params, state, batch, mesh=mesh)  # doctest: +SKIP
    >>> predict(report, {'host': '100gbe', 'local': 'nvlink4'}).per_axis  # doctest: +SKIP
    {'host': 0.00021, 'local': 1.1e-05}
  """
  resolved = _check_links(report, links)
  order = slowest_first(resolved)
  per_axis = {axis: 0.0 for axis in order}
  per_collective = []
  for op, weight in zip(report.collectives, report.weights(branch_weights)):
    if not op.axes:  # a permute whose every pair is a self-pair crosses no link.
      per_collective.append(0.0)
      continue
    charged = _charge(op, resolved, order)
    for axis, seconds in charged.items():
      per_axis[axis] += weight * seconds
    per_collective.append(weight * math.fsum(charged.values()))
  return CommTime(per_axis, math.fsum(per_collective), tuple(per_collective))


def step_time(compute_seconds: float, report: CommReport, links: Mapping[str, LinkLike],
              overlap: float = 0.0,
              branch_weights: Mapping[str, Sequence[float]] | None = None) -> float:
  """Modeled seconds of one training step: compute plus the communication not hidden by it.

  ``time = compute + comm - min(overlap * comm, compute)`` with ``comm = predict(...).total``:
  a fraction ``overlap`` of the communication runs concurrently with compute (e.g. gradient
  buckets reduced while the backward pass goes on) and can hide at most the compute time.
  ``overlap=0`` (default) is fully serial, ``compute + comm``; ``overlap=1`` gives
  ``max(compute, comm)``. Nothing in jaxcomm overlaps yet: a compiled step's collectives
  come after its backward pass, so 0 is what it runs today.

  Args:
    compute_seconds: measured or estimated forward + backward + update time (>= 0).
    report: the step's :class:`~jaxcomm.accounting.CommReport`.
    links: as for :func:`predict`.
    overlap: fraction of communication overlapped with compute, in ``[0, 1]``.
    branch_weights: as for :func:`predict`.

  Returns:
    Seconds per step.
  """
  if isinstance(compute_seconds, bool) or not isinstance(compute_seconds, numbers.Real) \
      or not compute_seconds >= 0:
    raise ValueError(f"compute_seconds must be a real number >= 0, got {compute_seconds!r}.")
  if isinstance(overlap, bool) or not isinstance(overlap, numbers.Real) or not 0 <= overlap <= 1:
    raise ValueError(f"overlap must be a fraction in [0, 1], got {overlap!r}.")
  comm = predict(report, links, branch_weights).total
  return compute_seconds + comm - min(overlap * comm, compute_seconds)


class TransformerConfig(NamedTuple):
  """A decoder-only (LLaMA-style) transformer's sizes: all its gradient shapes follow.

  Attributes:
    layers: transformer blocks.
    d_model: hidden width.
    ffn: width of the gated (SwiGLU) MLP.
    vocab: vocabulary size; the output head is not tied to the embedding.
    heads: attention heads.
    kv_heads: key/value heads (``heads`` without grouped-query attention).
  """
  layers: int
  d_model: int
  ffn: int
  vocab: int
  heads: int
  kv_heads: int


TRANSFORMERS: dict[str, TransformerConfig] = {
    # Touvron et al. 2023, "LLaMA" Table 2 and "Llama 2" (70B uses 8 key/value heads).
    "llama-7b": TransformerConfig(32, 4096, 11008, 32000, 32, 32),
    "llama-13b": TransformerConfig(40, 5120, 13824, 32000, 40, 40),
    "llama2-70b": TransformerConfig(80, 8192, 28672, 32000, 64, 8),
}


def transformer_gradient_shapes(model: str | TransformerConfig) -> dict[str, Shape]:
  """Gradient leaf shapes of a LLaMA-style transformer, from its config alone (no weights).

  Per block: ``wq``, ``wo`` ``(d, d)``; ``wk``, ``wv`` ``(d, d kv_heads / heads)``; ``w1``,
  ``w3`` ``(d, ffn)``; ``w2`` ``(ffn, d)``; two RMSNorm scales ``(d,)``. Plus the embedding
  ``(vocab, d)``, a final norm ``(d,)`` and the output head ``(d, vocab)``. ``'llama-7b'``
  has 6,738,415,616 parameters in 291 leaves.

  Args:
    model: a name from :data:`TRANSFORMERS` or a :class:`TransformerConfig`.

  Returns:
    ``{leaf name: shape}`` in parameter order.
  """
  if isinstance(model, str):
    if model not in TRANSFORMERS:
      raise ValueError(f"unknown model {model!r}; known models: {', '.join(TRANSFORMERS)}.")
    model = TRANSFORMERS[model]
  d, kv = model.d_model, model.d_model * model.kv_heads // model.heads
  block = {"attention.wq": (d, d), "attention.wk": (d, kv), "attention.wv": (d, kv),
           "attention.wo": (d, d), "mlp.w1": (d, model.ffn), "mlp.w3": (d, model.ffn),
           "mlp.w2": (model.ffn, d), "attention_norm": (d,), "mlp_norm": (d,)}
  shapes = {"embedding": (model.vocab, d)}
  for layer in range(model.layers):
    shapes |= {f"layers.{layer}.{name}": shape for name, shape in block.items()}
  return shapes | {"final_norm": (d,), "output": (d, model.vocab)}


class Projection(NamedTuple):
  """Modeled communication of one hierarchical allreduce of a whole model, per device.

  Attributes:
    fast_bytes: bytes each device sends over the fast (intra-host) link per step.
    slow_bytes: bytes each device sends over the slow (inter-host) link per step.
    fast_steps: message steps on the fast link; each pays its latency.
    slow_steps: message steps on the slow link.
    fast_seconds: modeled seconds on the fast link.
    slow_seconds: modeled seconds on the slow link.
  """
  fast_bytes: float
  slow_bytes: float
  fast_steps: int
  slow_steps: int
  fast_seconds: float
  slow_seconds: float

  @property
  def total_seconds(self) -> float:
    """Fast plus slow seconds: the phases of the scheme run one after another."""
    return self.fast_seconds + self.slow_seconds


WireBytesFn = Callable[[Shape, Any], int]


class _WireBytes(NamedTuple):
  """A payload-size function where a strategy's ``cost`` reads ``compressor.wire_bytes``."""
  wire_bytes: WireBytesFn


def _slow_strategy(wire_bytes: Compressor | WireBytesFn | None, strategy, hosts: int):
  """``(strategy value, compressor)`` of the slow axis: dense without ``wire_bytes``."""
  strategy = strategies.as_strategy(strategy)
  if wire_bytes is None:
    return strategies.Dense(), None
  if isinstance(wire_bytes, Compressor):
    return strategies.check_strategy(strategies.resolve(strategy, wire_bytes, hosts),
                                     wire_bytes), wire_bytes
  if not isinstance(strategy, (strategies.Gather, strategies.TwoPhase)):
    raise ValueError(f"strategy must be 'gather' or 'two_phase' with a wire_bytes function; "
                     f"got {strategy!r} (pass the Compressor itself for 'linear' or None).")
  return strategy, _WireBytes(wire_bytes)


class Traffic(NamedTuple):
  """What each device sends per step over each link: link-independent, so one :func:`traffic`
  gives the modeled time on any pair of links (:meth:`seconds`).

  Attributes:
    fast: steps and bytes over the fast (intra-host) link.
    slow: steps and bytes over the slow (inter-host) link.
  """
  fast: Cost
  slow: Cost

  @property
  def fast_bytes(self) -> float:
    """Bytes each device sends over the fast link."""
    return self.fast.nbytes

  @property
  def slow_bytes(self) -> float:
    """Bytes each device sends over the slow link."""
    return self.slow.nbytes

  def __add__(self, other: Traffic) -> Traffic:
    return Traffic(self.fast + other.fast, self.slow + other.slow)

  def scaled(self, factor: float) -> Traffic:
    """The traffic of a collective run once every ``1/factor`` steps (steps and bytes times
    ``factor``)."""
    return Traffic(*(Cost(cost.steps * factor, cost.nbytes * factor) for cost in self))

  def seconds(self, fast_link: LinkLike, slow_link: LinkLike) -> float:
    """Modeled seconds, the phases one after another: ``fast.seconds(fast_link) +
    slow.seconds(slow_link)``."""
    return self.fast.seconds(_as_link(fast_link)) + self.slow.seconds(_as_link(slow_link))


NO_TRAFFIC = Traffic(NO_COST, NO_COST)


def traffic(shapes: Iterable[Shape], hosts: int, local: int,
            wire_bytes: Compressor | WireBytesFn | None = None, *,
            strategy: str | strategies.Strategy | None = "gather",
            dtype: Any = np.float32) -> Traffic:
  """The steps and bytes of one hierarchical allreduce of a model's gradients on each link,
  without links: :func:`project`'s figures before they are timed (arguments as there).

  Returns:
    A :class:`Traffic`; ``traffic(...).seconds(fast_link, slow_link)`` equals
    :func:`project`'s ``total_seconds``.
  """
  hosts, local = _check_devices("hosts", hosts), _check_devices("local", local)
  slow_strategy, compressor = _slow_strategy(wire_bytes, strategy, hosts)
  dtype = np.dtype(dtype)
  shard_lens = [-(-math.prod(shape) // local) for shape in shapes]
  fast = strategies.level_cost(strategies.Dense(), None, [local * n for n in shard_lens], local,
                               dtype)
  slow = strategies.level_cost(slow_strategy, compressor, shard_lens, hosts, dtype)
  return Traffic(fast, slow)


def project(shapes: Iterable[Shape], hosts: int, local: int, fast_link: LinkLike,
            slow_link: LinkLike, wire_bytes: Compressor | WireBytesFn | None = None, *,
            strategy: str | strategies.Strategy | None = "gather",
            dtype: Any = np.float32) -> Projection:
  """Models one step of the hierarchical allreduce of a model's gradients, without compiling.

  For each gradient leaf of ``d`` elements, on ``H = hosts`` hosts of ``G = local`` devices,
  with ``s = ceil(d/G)`` elements per shard of ``b`` bytes each (``dtype``):

  * fast link: reduce-scatter and all-gather of the ``G s b`` padded leaf, each
    ``(G-1) alpha_f + (G-1) s b beta_f``;
  * slow link, by ``wire_bytes`` and ``strategy`` (each strategy value's ``cost``,
    :mod:`jaxcomm.collectives.strategies`, the formulas the tests check against compiled HLO):

    - ``wire_bytes=None`` (full precision): reduce-scatter and all-gather of the shard,
      ``2(H-1) alpha_s + 2(H-1)/H s b beta_s``;
    - ``'linear'`` (a :class:`~jaxcomm.Compressor` with linear payloads): all-reduce of the
      summed payload ``c``, ``2(H-1) alpha_s + 2(H-1)/H c beta_s``;
    - ``'gather'``: all-gather of each device's ``c = wire_bytes((s,))`` payload,
      ``(H-1) c beta_s``, every leaf's payload in one all-gather per step, so ``(H-1)
      alpha_s`` once (what :func:`jaxcomm.compressed_allreduce` runs);
    - ``'two_phase'``: the shard in ``H`` chunks of ``ceil(s/H)`` elements with
      ``c_H = wire_bytes((ceil(s/H),))`` bytes each; all-to-all then all-gather of the
      re-encoded chunk, ``2(H-1) c_H beta_s``, about ``2c`` for any ``H``, every leaf's chunks
      in one all-to-all and one all-gather per step, so ``2(H-1) alpha_s`` once.

  Every device of a host works its own shard at once, each on its own slow link: give
  ``slow_link.shared_by(G)`` when a host's devices share one NIC. One collective per leaf
  and phase (no bucketing), so small leaves pay the ``alpha`` terms in full, except the
  gather and two-phase strategies' collectives, one of each kind per step for all leaves.

  Args:
    shapes: gradient leaf shapes, e.g. ``transformer_gradient_shapes('llama-7b').values()``.
    hosts: ``H``, devices on the slow axis.
    local: ``G``, devices per host on the fast axis.
    fast_link: the fast axis's link (a :class:`~jaxcomm.links.Link` or a preset name).
    slow_link: the slow axis's link.
    wire_bytes: the slow-axis compressor (a :class:`~jaxcomm.Compressor`), or only its payload
      bytes ``wire_bytes(shape, dtype)``, e.g. ``jaxcomm.topk(0.01).wire_bytes``; ``None`` for
      full precision.
    strategy: how compressed payloads cross the slow axis: a strategy value or name
      (``'gather'``, ``'two_phase'``; ``'linear'`` or ``None``, the choice
      :func:`jaxcomm.compressed_allreduce` makes, need a Compressor). Full precision is always
      dense.
    dtype: gradient dtype; sets ``b`` for the full-precision phases.

  Returns:
    A :class:`Projection`.

  Example:
    >>> shapes = transformer_gradient_shapes('llama-7b').values()
    >>> project(shapes, 8, 8, 'nvlink4', '100gbe', jaxcomm.topk(0.01).wire_bytes)  # doctest: +SKIP
  """
  fast_link, slow_link = _as_link(fast_link), _as_link(slow_link)
  fast, slow = traffic(shapes, hosts, local, wire_bytes, strategy=strategy, dtype=dtype)
  return Projection(fast.nbytes, slow.nbytes, fast.steps, slow.steps, fast.seconds(fast_link),
                    slow.seconds(slow_link))
