"""Device meshes that name the fast (intra-host) and slow (inter-host) links.

A jaxcomm mesh orders its axes from slowest to fastest in the mesh shape (``('host', 'local')``):
devices that share a host are adjacent along the last axis, as ``jax.make_mesh`` lays them out,
so the fast axis maps onto NVLink/ICI and the slow axis onto the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

HOST_AXIS = "host"
LOCAL_AXIS = "local"


def _check_positive(name: str, value: int | None) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int or None, got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}.")


def _devices_by_process(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
  by_process: dict[int, list[jax.Device]] = {}
  for device in devices:
    by_process.setdefault(device.process_index, []).append(device)
  return [sorted(group, key=lambda d: d.id) for _, group in sorted(by_process.items())]


def make_mesh(
    hosts: int | None = None,
    local: int | None = None,
    *,
    axis_names: tuple[str, str] = (HOST_AXIS, LOCAL_AXIS),
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType = AxisType.Auto,
) -> Mesh:
  """Builds the two-level ``(slow, fast)`` mesh, by default ``('host', 'local')``.

  With several processes (``jax.distributed``), each process is a host: the slow axis has one
  entry per process and the fast axis holds that process's local devices, so a collective over
  the fast axis never leaves a process. In one process, hosts are simulated by splitting the
  local devices into ``hosts`` contiguous groups of ``local`` devices.

  Args:
    hosts: size of the slow axis. Defaults to ``jax.process_count()`` with several processes,
      else to ``len(devices) // local`` (or 1 when ``local`` is not given either).
    local: size of the fast axis. Defaults to ``len(devices) // hosts``.
    axis_names: the (slow, fast) axis names.
    devices: devices to use; defaults to ``jax.devices()``.
    axis_types: the mesh's axis type for both axes. ``AxisType.Auto`` (default) lets
      ``jax.shard_map`` reshard inputs to its ``in_specs``; pass ``AxisType.Explicit`` for
      sharding-in-types, where inputs must already carry the matching sharding.

  Returns:
    A ``jax.sharding.Mesh`` of shape ``(hosts, local)``.

  Raises:
    ValueError: if ``hosts * local`` does not equal the number of devices, if the sizes are not
      positive, if ``axis_names`` is not two distinct strings, or if with several processes
      a simulated host would straddle two processes.

  Example:
    >>> mesh = jaxcomm.make_mesh(hosts=2, local=4)  # doctest: +SKIP
    >>> mesh.shape
    OrderedDict([('host', 2), ('local', 4)])
  """
  _check_positive("hosts", hosts)
  _check_positive("local", local)
  if (len(axis_names) != 2 or len(set(axis_names)) != 2
      or not all(isinstance(n, str) and n for n in axis_names)):
    raise ValueError(f"axis_names must be two distinct non-empty strings, got {axis_names!r}.")
  if not isinstance(axis_types, AxisType):
    raise TypeError(f"axis_types must be a jax.sharding.AxisType, got {axis_types!r}.")
  devices = list(jax.devices() if devices is None else devices)
  count = len(devices)
  processes = _devices_by_process(devices)
  if hosts is None:
    if len(processes) > 1:
      hosts = len(processes)
    else:
      hosts = count // local if local else 1
  if local is None:
    local = count // hosts
  if hosts * local != count:
    raise ValueError(
        f"hosts * local must equal the number of devices ({count}); got hosts={hosts}, "
        f"local={local}.")
  ordered = [d for group in processes for d in group]
  grid = np.array(ordered, dtype=object).reshape(hosts, local)
  if len(processes) > 1:
    for row in grid:
      if len({d.process_index for d in row}) != 1:
        raise ValueError(
            f"local={local} puts devices of several processes on one host row; with "
            f"{len(processes)} processes use local <= {len(processes[0])} dividing it.")
  return Mesh(grid, axis_names, axis_types=(axis_types, axis_types))
