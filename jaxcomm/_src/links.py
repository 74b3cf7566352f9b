"""The implementation of :mod:`jaxcomm.links` (private: import that module)."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple


class _LinkFields(NamedTuple):
  name: str
  bandwidth_bytes_per_s: float
  latency_s: float


class Link(_LinkFields):
  """One device's link on a mesh axis, for the alpha-beta cost model.

  Attributes:
    name: a label, e.g. ``'100gbe'``.
    bandwidth_bytes_per_s: bytes per second one device can send in one direction (> 0).
    latency_s: seconds per message step, the ``alpha`` of the model (>= 0).

  Raises:
    TypeError: if a number is not a real number or the name is not a string.
    ValueError: if the bandwidth is not positive and finite, the latency negative or not
      finite, or the name empty.

  Example:
    >>> Link('my-ib', bandwidth_bytes_per_s=50e9, latency_s=5e-6).beta
    2e-11
  """
  __slots__ = ()

  def __new__(cls, name: str, bandwidth_bytes_per_s: float, latency_s: float) -> Link:
    if not isinstance(name, str) or not name:
      raise ValueError(f"Link name must be a non-empty string, got {name!r}.")
    bandwidth = _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    latency = _real("latency_s", latency_s)
    if not bandwidth > 0:
      raise ValueError(f"Link {name!r}: bandwidth_bytes_per_s must be > 0, got {bandwidth!r}.")
    if not latency >= 0:
      raise ValueError(f"Link {name!r}: latency_s must be >= 0, got {latency!r}.")
    return super().__new__(cls, name, bandwidth, latency)

  @classmethod
  def _make(cls, iterable) -> Link:
    # ``_replace`` builds through ``_make``: route it through the validation too.
    return cls(*iterable)

  @property
  def alpha(self) -> float:
    """Seconds per message step (the latency)."""
    return self.latency_s

  @property
  def beta(self) -> float:
    """Seconds per byte, ``1 / bandwidth``."""
    return 1.0 / self.bandwidth_bytes_per_s

  def shared_by(self, devices: int) -> Link:
    """This link's bandwidth split evenly between ``devices`` devices sending at once.

    Args:
      devices: how many devices share it, e.g. the ``G`` devices of a host behind one NIC.

    Returns:
      A :class:`Link` named ``'<name>/<devices>'`` with ``1/devices`` of the bandwidth and
      the same latency; this link itself when ``devices`` is 1.
    """
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
      raise ValueError(f"shared_by: devices must be an int >= 1, got {devices!r}.")
    if devices == 1:
      return self
    return Link(f"{self.name}/{devices}", self.bandwidth_bytes_per_s / devices, self.latency_s)


def _real(parameter: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"Link: {parameter} must be a real number, got {value!r}.")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"Link: {parameter} must be finite, got {value!r}.")
  return value


NVLINK4 = Link("nvlink4", 450e9, 3.4e-6)
PCIE5 = Link("pcie5", 64e9, 5.7e-6)
IB_HDR = Link("ib-hdr", 25e9, 14e-6)
ETHERNET_100G = Link("100gbe", 12.5e9, 25e-6)
ETHERNET_10G = Link("10gbe", 1.25e9, 30e-6)
ETHERNET_1G = Link("1gbe", 0.125e9, 50e-6)

PRESETS: dict[str, Link] = {
    preset.name: preset
    for preset in (NVLINK4, PCIE5, IB_HDR, ETHERNET_100G, ETHERNET_10G, ETHERNET_1G)
}


def _normalized(name: str) -> str:
  return "".join(ch for ch in name.lower() if ch not in " -_")


def link(name: str) -> Link:
  """The preset :class:`Link` called ``name``, ignoring case, spaces, ``-`` and ``_``.

  Args:
    name: one of ``'nvlink4'``, ``'pcie5'``, ``'ib-hdr'``, ``'100gbe'``, ``'10gbe'``,
      ``'1gbe'`` (so ``'IB_HDR'`` and ``'NVLink-4'`` work too).

  Returns:
    The preset (see the module docstring for the numbers and their sources).

  Raises:
    ValueError: for an unknown name; the message lists the known ones.

  Example:
    >>> link('100GbE').bandwidth_bytes_per_s
    12500000000.0
  """
  if isinstance(name, str):
    for preset in PRESETS.values():
      if _normalized(preset.name) == _normalized(name):
        return preset
  raise ValueError(f"unknown link {name!r}; known links: {', '.join(PRESETS)}. "
                   "For another link build jaxcomm.links.Link(name, bandwidth_bytes_per_s, "
                   "latency_s).")
