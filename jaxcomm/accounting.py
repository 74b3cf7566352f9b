"""Bytes on the wire, read from the collectives in a compiled executable.

:func:`measure` compiles a jitted function and reads every collective from the optimized HLO
(what the backend will really run, after XLA's own rewrites, e.g. the CPU backend widening a
bfloat16 all-reduce to float32). Each collective's replica groups are mapped back to the mesh
axes they span. Bytes each device sends per call, for a collective over ``n`` devices, use the
ring-algorithm factors:

==================  =========================  =======================================
collective          ``S`` (from the HLO)       bytes sent per device
==================  =========================  =======================================
all-reduce          result bytes               ``2 (n-1)/n * S``
all-gather          result (gathered) bytes    ``(n-1)/n * S``
reduce-scatter      result (one shard) bytes   ``(n-1) * S``
all-to-all          result bytes               ``(n-1)/n * S``
collective-permute  result bytes               ``S`` times the share of devices that send
==================  =========================  =======================================

A collective that spans several axes is attributed to all of them as a tuple key, e.g.
``('host', 'local')``; :meth:`CommReport.link_bytes` charges it to the slowest axis it
crosses, whose links carry the whole ring traffic. Counts are static: a collective inside a
loop body is counted once per compiled occurrence, not once per iteration.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from itertools import combinations

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
_DTYPE_BYTES = {"pred": 1, "bf16": 2}


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
  """
  kind: str
  axes: tuple[str, ...]
  group_size: int
  result_bytes: int
  bytes_per_device: float
  dtypes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CommReport:
  """The collectives of one compiled function and the bytes they move.

  Attributes:
    collectives: every collective found, in program order.
    mesh_axes: the mesh's axis names, in mesh order.
  """
  collectives: tuple[Collective, ...]
  mesh_axes: tuple[str, ...]

  def bytes_per_axes(self) -> dict[tuple[str, ...], float]:
    """Bytes each device sends per call, keyed by the tuple of axes a collective spans."""
    totals: dict[tuple[str, ...], float] = {}
    for op in self.collectives:
      totals[op.axes] = totals.get(op.axes, 0.0) + op.bytes_per_device
    return totals

  def link_bytes(self, slowest_first: Sequence[str] | None = None) -> dict[str, float]:
    """Bytes each device sends per call over each axis's links.

    A collective spanning several axes is charged to the slowest of them.

    Args:
      slowest_first: axis names from slowest to fastest; defaults to the mesh order, which
        for :func:`jaxcomm.make_mesh` is ``('host', 'local')``.
    """
    order = tuple(slowest_first or self.mesh_axes)
    totals = {axis: 0.0 for axis in order}
    for op in self.collectives:
      slowest = min(op.axes, key=order.index)
      totals[slowest] += op.bytes_per_device
    return totals

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


def _bytes_per_device(kind: str, result_bytes: int, group_size: int) -> float:
  n = group_size
  if kind == "all-reduce":
    return 2.0 * (n - 1) / n * result_bytes
  if kind in ("all-gather", "all-to-all"):
    return (n - 1) / n * result_bytes
  if kind == "reduce-scatter":
    return float((n - 1) * result_bytes)
  raise ValueError(f"unknown collective kind {kind!r}")


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
  device_count = mesh.devices.size
  if kind == "collective-permute":
    pairs_text = _PAIRS.search(line)
    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs_text.group(1))]
    axes = _axes_of_pairs(pairs, mesh)
    senders = len({source for source, target in pairs if source != target})
    return Collective(kind, axes, 2, result_bytes, result_bytes * senders / device_count, dtypes)
  groups = _replica_groups(line, device_count)
  group_size = len(groups[0])
  if group_size <= 1:
    return None
  axes = _axes_of_groups(groups, mesh)
  return Collective(kind, axes, group_size, result_bytes,
                    _bytes_per_device(kind, result_bytes, group_size), dtypes)


def report_from_hlo(hlo_text: str, mesh: Mesh) -> CommReport:
  """Parses the optimized HLO text of a compiled SPMD executable over ``mesh``."""
  found = (_parse_line(line, mesh) for line in hlo_text.splitlines())
  return CommReport(tuple(op for op in found if op is not None), tuple(mesh.axis_names))


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
