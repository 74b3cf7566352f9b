"""The user's cluster (``--cluster``) and the modeled step of the scanned model on it.

Syntax: comma-separated ``key=value`` pairs, every key once::

  hosts=16,local=8,intra=nvlink4,inter=100gbe
  hosts=4,local=8,intra=nvlink4,inter=25e9:5e-6,compute_ms=120

* ``hosts``, ``local``: hosts and accelerators per host (integers >= 1);
* ``intra``, ``inter``: the link inside a host and between hosts, either a preset of
  :mod:`jaxcomm.links` (``nvlink4``, ``pcie5``, ``ib-hdr``, ``100gbe``, ``10gbe``, ``1gbe``) or
  ``BANDWIDTH:LATENCY``, bytes per second each device gets and seconds per message
  (``25e9:5e-6`` is 25 GB/s, 5 us);
* ``compute_ms`` (optional, default 0): the forward + backward + update time of one step on
  that cluster, added to the modeled communication (0: communication only).

The modeled communication is each method's ``project`` formula
(:mod:`benchmarks.scan.projection`) on the scanned model's own gradient shapes: alpha-beta
time, no overlap with compute, not measured.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxcomm import links

DEFAULT = "hosts=8,local=8,intra=nvlink4,inter=100gbe"
KEYS = ("hosts", "local", "intra", "inter", "compute_ms")


class Cluster(NamedTuple):
  """Hosts x local devices, the two links and the per-step compute time."""
  hosts: int
  local: int
  intra: links.Link
  inter: links.Link
  compute_ms: float = 0.0

  def describe(self) -> str:
    def one(link):
      return (f"{link.name} ({link.bandwidth_bytes_per_s / 1e9:g} GB/s, "
              f"{1e6 * link.latency_s:g} us)")
    compute = f", compute {self.compute_ms:g} ms/step" if self.compute_ms else ""
    return (f"{self.hosts} hosts x {self.local} devices, {one(self.intra)} inside hosts, "
            f"{one(self.inter)} between them{compute}")


def _link(key: str, text: str) -> links.Link:
  if ":" not in text:
    return links.link(text)
  bandwidth, _, latency = text.partition(":")
  try:
    return links.Link(f"{key}-{text}", float(bandwidth), float(latency))
  except ValueError:
    raise ValueError(f"--cluster {key}={text!r}: BANDWIDTH:LATENCY must be two positive "
                     "numbers, bytes/s and seconds, e.g. 25e9:5e-6") from None


def parse(text: str) -> Cluster:
  """``'hosts=16,local=8,intra=nvlink4,inter=25e9:5e-6'`` -> :class:`Cluster`.

  Raises:
    ValueError: a pair is not ``key=value``, a key is unknown, repeated or missing, a count is
      not an integer >= 1, a link is neither a preset nor ``BANDWIDTH:LATENCY``.
  """
  pairs = {}
  for item in (part.strip() for part in text.split(",")):
    key, sep, value = item.partition("=")
    if not sep or not value or key not in KEYS or key in pairs:
      raise ValueError(f"--cluster {text!r}: {item!r} is not one of " + ", ".join(
          f"{k}=..." for k in KEYS) + " (each once), e.g. " + DEFAULT)
    pairs[key] = value.strip()
  missing = [key for key in KEYS[:4] if key not in pairs]
  if missing:
    raise ValueError(f"--cluster {text!r} lacks {', '.join(missing)}, e.g. {DEFAULT}")
  counts = {}
  for key in ("hosts", "local"):
    if not pairs[key].isdigit() or int(pairs[key]) < 1:
      raise ValueError(f"--cluster {key}={pairs[key]!r} must be an integer >= 1")
    counts[key] = int(pairs[key])
  try:
    compute_ms = float(pairs.get("compute_ms", 0))
  except ValueError:
    compute_ms = -1.0
  if not compute_ms >= 0:
    raise ValueError(f"--cluster compute_ms={pairs['compute_ms']!r} must be a number >= 0")
  try:
    intra, inter = _link("intra", pairs["intra"]), _link("inter", pairs["inter"])
  except ValueError as error:
    raise ValueError("--cluster: " + str(error).split(". For another")[0].replace(
        "known links:", "use BANDWIDTH:LATENCY or one of")) from None
  return Cluster(counts["hosts"], counts["local"], intra, inter, compute_ms)


def model_step(methods, setting, shapes, cluster: Cluster) -> dict[str, dict]:
  """``{method: {'inter_bytes', 'intra_bytes', 'comm_ms', 'step_ms'}}`` on ``cluster``.

  Args:
    methods: :class:`~benchmarks.scan.methods.Method` objects; those without a ``project``
      formula are left out.
    setting: the :class:`~benchmarks.scan.methods.Setting` their formulas read.
    shapes: the gradient (parameter) shapes of the model.
    cluster: where to model it.
  """
  rows = {}
  for method in methods:
    if method.project is None:
      continue
    traffic = method.project(setting, shapes, cluster.hosts, cluster.local)
    comm_ms = 1e3 * traffic.seconds(cluster.intra, cluster.inter)
    rows[method.name] = {"inter_bytes": traffic.slow_bytes, "intra_bytes": traffic.fast_bytes,
                         "comm_ms": comm_ms, "step_ms": cluster.compute_ms + comm_ms}
  return rows


def step_ms_over_bandwidths(method, setting, shapes, cluster: Cluster,
                            bandwidths) -> list[float]:
  """:func:`model_step`'s ``step_ms`` of ``method`` with ``cluster``'s inter-host link at each
  of ``bandwidths`` (bytes per second per device, its latency kept); the traffic is modeled
  once, as it does not depend on the link."""
  traffic = method.project(setting, shapes, cluster.hosts, cluster.local)
  return [cluster.compute_ms + 1e3 * traffic.seconds(cluster.intra, links.Link(
      "sweep", bandwidth, cluster.inter.latency_s)) for bandwidth in bandwidths]
