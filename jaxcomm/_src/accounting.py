"""The implementation of :mod:`jaxcomm.accounting` (private: import that module)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(COLLECTIVE_KINDS)
    + r")(?P<start>-start)?\(")
_ARRAY_TYPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(.*\{\s*$")
_CONDITIONAL = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>\S+)\s*=.*\sconditional\(")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"true_computation=%([^\s,]+),\s*false_computation=%([^\s,]+)")
_CALLEES = re.compile(r"(?:calls|to_apply|body|condition|called_computations)=\{?%([^\s,}]+)")
_DTYPE_BYTES = {"pred": 1, "bf16": 2}
_OP_NAME = re.compile(r'op_name="([^"]*)"')
WARMUP_SCOPE = "jaxcomm_warmup"


class Cost(NamedTuple):
  """What one device pays for a collective: ring steps and bytes sent.

  Attributes:
    steps: message steps, each paying the link's latency ``alpha``.
    nbytes: bytes this device sends, each paying the link's ``beta`` (seconds per byte).
  """
  steps: int
  nbytes: float

  def __add__(self, other: Cost) -> Cost:
    return Cost(self.steps + other.steps, self.nbytes + other.nbytes)

  def seconds(self, link) -> float:
    """``steps alpha + nbytes beta`` on ``link`` (a :class:`jaxcomm.links.Link`)."""
    return self.steps * link.alpha + self.nbytes * link.beta


NO_COST = Cost(0, 0.0)


def ring_cost(kind: str, result_bytes: float, group_size: int) -> Cost:
  """Steps and bytes per device of one collective over ``n = group_size`` devices whose
  result holds ``S = result_bytes`` on each device (the table in the module docstring).

  This is the one place the ring factors are written: the HLO accounting, the alpha-beta
  cost model (:mod:`jaxcomm.costmodel`) and every strategy's ``cost``
  (:mod:`jaxcomm.collectives.strategies`) call it.

  ==================  ==================  ==========================
  ``kind``            steps               bytes
  ==================  ==================  ==========================
  all-reduce          ``2 (n-1)``         ``2 (n-1)/n * S``
  all-gather          ``n-1``             ``(n-1)/n * S``
  all-to-all          ``n-1``             ``(n-1)/n * S``
  reduce-scatter      ``n-1``             ``(n-1) * S``
  collective-permute  ``1``               ``S``
  ==================  ==================  ==========================
  """
  n = group_size
  if kind == "all-reduce":
    return Cost(2 * (n - 1), 2.0 * (n - 1) / n * result_bytes)
  if kind in ("all-gather", "all-to-all"):
    return Cost(n - 1, (n - 1) / n * result_bytes)
  if kind == "reduce-scatter":
    return Cost(n - 1, float((n - 1) * result_bytes))
  if kind == "collective-permute":
    return Cost(1, float(result_bytes))
  raise ValueError(f"unknown collective kind {kind!r}; known: {', '.join(COLLECTIVE_KINDS)}.")


def warmup(branch: Callable) -> Callable:
  """Marks a ``lax.cond``/``lax.switch`` branch as a warm-up phase, not the steady state.

  The branch's collectives carry the name scope ``jaxcomm_warmup`` into the compiled HLO, and
  :meth:`CommReport.weights` gives them weight 0 unless ``branch_weights`` says otherwise.

  Example:
    >>> jax.lax.cond(count < start_step, warmup(dense), compressed, operands)  # doctest: +SKIP
  """
  def marked(*args, **kwargs):
    with jax.named_scope(WARMUP_SCOPE):
      return branch(*args, **kwargs)
  return marked


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective in a compiled executable.

  Attributes:
    kind: ``'all-reduce'``, ``'all-gather'``, ``'reduce-scatter'``, ``'all-to-all'`` or
      ``'collective-permute'``.
    axes: the mesh axes its groups span, in mesh order.
    group_size: devices per group ``n``.
    result_bytes: bytes of its result on one device ``S``.
    bytes_per_device: bytes each device sends per execution (ring factors, module docstring).
    dtypes: element types of its result, as the HLO names them (``'f32'``, ``'u8'`` ...).
    branch: the conditional branches it sits in, outermost first, as ``(conditional, index)``
      pairs (the HLO instruction's name and the branch index: the ``lax.switch`` index, or
      ``1`` for ``lax.cond``'s true branch and ``0`` for its false one); ``()`` when it runs
      on every call.
    warmup: whether it was traced inside a :func:`warmup` branch.
    axis_sizes: the mesh sizes of ``axes``, in the same order.
  """
  kind: str
  axes: tuple[str, ...]
  group_size: int
  result_bytes: int
  bytes_per_device: float
  dtypes: tuple[str, ...]
  branch: tuple[tuple[str, int], ...] = ()
  warmup: bool = False
  axis_sizes: tuple[int, ...] = ()

  def split(self, slowest_first: Sequence[str]) -> dict[str, float]:
    """``bytes_per_device`` by the axis whose links carry it (rules: module docstring)."""
    return {axis: cost.nbytes for axis, cost in self.split_cost(slowest_first).items()}

  def split_cost(self, slowest_first: Sequence[str]) -> dict[str, Cost]:
    """Steps and bytes per device by the axis whose links carry them.

    An all-to-all over axes of sizes ``n_1`` (slowest) ... ``n_m``, ``n = prod n_i``: axis
    ``i`` reaches ``p_i = (n_i - 1) prod_{j>i} n_j`` peers, one step and ``S/n`` bytes each,
    so it gets ``Cost(p_i, p_i / n * S)``; the ``p_i`` sum to ``n-1`` and the bytes to
    ``(n-1)/n * S``. Any other collective: its whole :func:`ring_cost` to its slowest axis
    (a collective-permute's bytes scaled to the share of devices that send).
    """
    order = sorted(self.axes, key=tuple(slowest_first).index)
    if not order:
      return {}
    if self.kind != "all-to-all" or len(order) < 2:
      steps = ring_cost(self.kind, self.result_bytes, self.group_size).steps
      return {order[0]: Cost(steps if self.bytes_per_device else 0, self.bytes_per_device)}
    sizes = dict(zip(self.axes, self.axis_sizes))
    split, inner = {}, self.group_size
    for axis in order:
      inner //= sizes[axis]
      peers = (sizes[axis] - 1) * inner
      split[axis] = Cost(peers, peers / self.group_size * self.result_bytes)
    return split


@dataclasses.dataclass(frozen=True)
class CommReport:
  """The collectives of one compiled function and the bytes they move.

  Attributes:
    collectives: every collective found, in program order.
    mesh_axes: the mesh's axis names, in mesh order.
    branch_counts: ``(name, branches)`` of every conditional, outermost or nested, that
      holds collectives.
  """
  collectives: tuple[Collective, ...]
  mesh_axes: tuple[str, ...]
  branch_counts: tuple[tuple[str, int], ...] = ()

  def bytes_per_axes(self) -> dict[tuple[str, ...], float]:
    """Bytes each device sends per call, keyed by the tuple of axes a collective spans; every
    collective counts once, whichever branch it sits in (see :meth:`link_bytes`)."""
    totals: dict[tuple[str, ...], float] = {}
    for op in self.collectives:
      totals[op.axes] = totals.get(op.axes, 0.0) + op.bytes_per_device
    return totals

  def link_bytes(self, slowest_first: Sequence[str] | None = None,
                 branch_weights: Mapping[str, Sequence[float]] | None = None
                 ) -> dict[str, float]:
    """Bytes each device sends per call over each axis's links, in the steady state.

    A collective spanning several axes is split over them by :meth:`Collective.split`
    (an all-to-all by the peers each axis reaches; a ring wholly to the slowest). Each collective
    counts :meth:`weights` times: mutually exclusive branches are never added up; a warm-up
    schedule reports its steady state (the module docstring gives the rules).

    Args:
      slowest_first: axis names from slowest to fastest; defaults to the mesh order, which
        for :func:`jaxcomm.make_mesh` is ``('host', 'local')``.
      branch_weights: for conditionals (names from :meth:`conditionals`, or nested ones
        from :attr:`branch_counts`), the fraction of calls that take each branch: a
        collective in branch ``b`` counts ``weights[b]`` times.

    Raises:
      ValueError: a weighted conditional is unknown or its weights do not match its
        branches, or a conditional has collectives in several branches none of which is
        marked as a warm-up and no weights were given for it.
    """
    order = tuple(slowest_first or self.mesh_axes)
    totals = {axis: 0.0 for axis in order}
    for op, weight in zip(self.collectives, self.weights(branch_weights)):
      for axis, nbytes in op.split(order).items():
        totals[axis] += weight * nbytes
    return totals

  def branch_bytes(self, slowest_first: Sequence[str] | None = None,
                   branch_weights: Mapping[str, Sequence[float]] | None = None
                   ) -> dict[tuple[str, int, str], dict[str, float]]:
    """Bytes per axis of each branch of each conditional holding collectives, when taken.

    Keys are ``(conditional, branch index, label)`` with label ``'warmup'`` for a branch
    marked with :func:`warmup` and ``'branch'`` otherwise. A branch's bytes include those
    of conditionals nested in it, weighted as :meth:`link_bytes` weighs them
    (``branch_weights`` as there).
    """
    order = tuple(slowest_first or self.mesh_axes)
    rows: dict[tuple[str, int, str], dict[str, float]] = {}
    for name, branches in self.branch_counts:
      for index in range(branches):
        inside = [op for op in self.collectives if (name, index) in op.branch]
        if inside:
          label = "warmup" if all(op.warmup for op in inside) else "branch"
          rows[name, index, label] = self._branch_link_bytes(name, index, order, branch_weights)
    return rows

  def _branch_link_bytes(self, name: str, index: int, order: tuple[str, ...],
                         branch_weights) -> dict:
    totals = {axis: 0.0 for axis in order}
    path = next(op.branch for op in self.collectives if (name, index) in op.branch)
    taken = dict(path[:path.index((name, index)) + 1])  # and the branches enclosing it
    for op, weight in zip(self.collectives, self.weights(branch_weights, taken=taken)):
      if (name, index) in op.branch:
        for axis, nbytes in op.split(order).items():
          totals[axis] += weight * nbytes
    return totals

  def weights(self, branch_weights: Mapping[str, Sequence[float]] | None = None, *,
              taken: Mapping[str, int] | None = None) -> list[float]:
    """Executions per call of each collective: the product of its branches' weights.

    Args:
      branch_weights: as for :meth:`link_bytes`.
      taken: conditionals assumed to take one branch (weight 1 for it), for
        :meth:`branch_bytes`.
    """
    counts = dict(self.branch_counts)
    given = {name: [float(w) for w in values] for name, values in (branch_weights or {}).items()}
    for name, values in given.items():
      if name not in counts or len(values) != counts[name]:
        raise ValueError(f"branch_weights[{name!r}] must give one weight for each of the "
                         f"{counts.get(name, 0)} branches of a conditional with collectives "
                         f"(known: {counts}); got {values}.")
    for name, index in (taken or {}).items():
      given[name] = [float(i == index) for i in range(counts[name])]
    resolved = {name: given.get(name) or self._steady_weights(name) for name in counts}
    return [float(np.prod([resolved[name][index] for name, index in op.branch]))
            for op in self.collectives]

  def _steady_weights(self, name: str) -> list[float]:
    """One conditional's branch weights when none are given: 1 for the one branch holding
    collectives that is not a warm-up (or for every branch when only one holds any)."""
    branches = dict(self.branch_counts)[name]
    holding: dict[int, list[Collective]] = {}
    for op in self.collectives:
      for conditional, index in op.branch:
        if conditional == name:
          holding.setdefault(index, []).append(op)
    if len(holding) <= 1:
      return [1.0] * branches
    steady = [index for index, ops in holding.items() if not all(op.warmup for op in ops)]
    if len(steady) != 1:
      raise ValueError(
          f"conditional {name!r} has collectives in branches {sorted(holding)}, which never "
          f"run in the same call, and {len(steady)} of them are not marked as a warm-up: "
          f"pass branch_weights={{{name!r}: [...]}} with how often each of its {branches} "
          "branches runs (branch_bytes() lists each one's bytes).")
    return [float(index == steady[0]) for index in range(branches)]

  def conditionals(self) -> dict[str, int]:
    """Outermost conditionals that hold collectives: HLO name -> number of branches."""
    outermost = {op.branch[0][0] for op in self.collectives if op.branch}
    return {name: branches for name, branches in self.branch_counts if name in outermost}

  def count(self, kind: str | None = None) -> int:
    """Number of collectives, of one kind or of all kinds."""
    return sum(1 for op in self.collectives if kind is None or op.kind == kind)


def _array_bytes(type_text: str) -> list[tuple[str, int]]:
  arrays = []
  for dtype, dims in _ARRAY_TYPE.findall(type_text):
    count = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    itemsize = _DTYPE_BYTES.get(dtype) or max(1, int(re.sub(r"\D", "", dtype.split("e")[0])) // 8)
    arrays.append((dtype, count * itemsize))
  return arrays


def _replica_groups(line: str, device_count: int) -> list[list[int]]:
  iota = _IOTA_GROUPS.search(line)
  if iota:
    group_shape = [int(v) for v in iota.group(1).split(",")]
    dims = [int(v) for v in iota.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
    return ids.reshape(group_shape).tolist()
  explicit = _EXPLICIT_GROUPS.search(line)
  if explicit and explicit.group(1):
    return [[int(v) for v in group.split(",") if v]
            for group in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
  return [list(range(device_count))]


def _axes_of_groups(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
  """The set of mesh axes whose device groups equal ``groups`` (ids are mesh positions)."""
  names = tuple(mesh.axis_names)
  positions = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  wanted = {frozenset(group) for group in groups}
  for size in range(1, len(names) + 1):
    for axes in combinations(range(len(names)), size):
      rest = [i for i in range(len(names)) if i not in axes]
      moved = np.moveaxis(positions, rest + list(axes), range(len(names)))
      candidate = {frozenset(row.tolist())
                   for row in moved.reshape(-1, int(np.prod([mesh.devices.shape[i] for i in axes])))}
      if candidate == wanted:
        return tuple(names[i] for i in axes)
  raise ValueError(f"replica groups {groups} do not match any set of axes of mesh {dict(mesh.shape)}.")


def _axes_of_pairs(pairs: list[tuple[int, int]], mesh: Mesh) -> tuple[str, ...]:
  coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), axis=1)
  differs = set()
  for source, target in pairs:
    differs.update(np.nonzero(coords[source] != coords[target])[0].tolist())
  return tuple(name for i, name in enumerate(mesh.axis_names) if i in differs)


def _branch_paths(lines: Sequence[str]) -> tuple[dict[str, tuple], dict[str, int]]:
  """The conditional branches each computation runs in, and each conditional's branch count.

  Returns:
    ``(paths, branches)``: computation name -> ``((conditional, index), ...)`` outermost
    first, for every computation reachable from the entry; conditional name -> branches.
  """
  callees: dict[str, list[tuple[str, tuple]]] = {}
  branches: dict[str, int] = {}
  entry, current = None, None
  for line in lines:
    header = _COMPUTATION.match(line)
    if header:
      current = header.group("name")
      callees[current] = []
      entry = current if header.group("entry") else entry
      continue
    if current is None:
      continue
    conditional = _CONDITIONAL.match(line)
    if conditional:
      listed = _BRANCHES.search(line)
      names = ([name.strip().lstrip("%") for name in listed.group(1).split(",")] if listed
               else list(reversed(_TRUE_FALSE.search(line).groups())))  # [false, true]
      branches[conditional.group("name")] = len(names)
      callees[current].extend((name, ((conditional.group("name"), index),))
                              for index, name in enumerate(names))
    callees[current].extend((name, ()) for name in _CALLEES.findall(line))
  paths: dict[str, tuple] = {}
  stack = [(entry, ())] if entry else []
  while stack:
    name, path = stack.pop()
    if name in paths:
      continue
    paths[name] = path
    stack.extend((callee, path + branch) for callee, branch in callees.get(name, []))
  return paths, branches


def _parse_line(line: str, mesh: Mesh) -> Collective | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  kind = match.group("kind")
  arrays = _array_bytes(match.group("type"))
  if match.group("start") and kind in ("all-gather", "collective-permute"):
    arrays = arrays[len(arrays) // 2:] if kind == "all-gather" else arrays[1:2]
  result_bytes = sum(nbytes for _, nbytes in arrays)
  dtypes = tuple(sorted({dtype for dtype, _ in arrays}))
  op_name = _OP_NAME.search(line)
  warmup = bool(op_name) and f"/{WARMUP_SCOPE}/" in f"/{op_name.group(1)}/"
  device_count = mesh.devices.size
  if kind == "collective-permute":
    pairs_text = _PAIRS.search(line)
    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs_text.group(1))]
    axes = _axes_of_pairs(pairs, mesh)
    senders = len({source for source, target in pairs if source != target})
    return Collective(kind, axes, 2, result_bytes, result_bytes * senders / device_count, dtypes,
                      warmup=warmup, axis_sizes=tuple(mesh.shape[axis] for axis in axes))
  groups = _replica_groups(line, device_count)
  group_size = len(groups[0])
  if group_size <= 1:
    return None
  axes = _axes_of_groups(groups, mesh)
  return Collective(kind, axes, group_size, result_bytes,
                    ring_cost(kind, result_bytes, group_size).nbytes, dtypes, warmup=warmup,
                    axis_sizes=tuple(mesh.shape[axis] for axis in axes))


def report_from_hlo(hlo_text: str, mesh: Mesh) -> CommReport:
  """Parses the optimized HLO text of a compiled SPMD executable over ``mesh``."""
  lines = hlo_text.splitlines()
  paths, branches = _branch_paths(lines)
  found, current = [], None
  for line in lines:
    header = _COMPUTATION.match(line)
    if header:
      current = header.group("name")
      continue
    op = _parse_line(line, mesh)
    if op is not None:
      found.append(dataclasses.replace(op, branch=paths.get(current, ())))
  holding = sorted({name for op in found for name, _ in op.branch})
  return CommReport(tuple(found), tuple(mesh.axis_names),
                    tuple((name, branches[name]) for name in holding))


def measure(fn: Callable, *args, mesh: Mesh, **kwargs) -> CommReport:
  """Compiles ``fn(*args, **kwargs)`` and reports the bytes its collectives send.

  Args:
    fn: a function over ``mesh`` (typically ``jax.jit(jax.shard_map(...))``); wrapped in
      ``jax.jit`` when it is not jitted yet.
    *args: arguments (arrays or ``jax.ShapeDtypeStruct``).
    mesh: the mesh the function runs on; replica groups are mapped to its axes.
    **kwargs: keyword arguments.

  Returns:
    A :class:`CommReport`. ``report.link_bytes()['host']`` is the inter-host bytes each device
    sends per call on a :func:`jaxcomm.make_mesh` mesh.

  Example:
    >>> report = jaxcomm.accounting.measure(train_step, params, state, batch, mesh=mesh)  # doctest: +SKIP
    >>> report.link_bytes()  # doctest: +SKIP
    {'host': 2048.0, 'local': 24576.0}
  """
  if not hasattr(fn, "lower"):
    fn = jax.jit(fn)
  return report_from_hlo(fn.lower(*args, **kwargs).compile().as_text(), mesh)
