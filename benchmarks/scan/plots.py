"""PNG plots, one pair per ``(model, mesh)`` with more than one host:

* ``loss_vs_bytes_<model>_<mesh>.png``: training loss (trailing mean) against cumulative
  inter-host bytes per device, one line per method, log x: further left at equal height is
  the same quality for fewer bytes.
* ``step_time_vs_bandwidth_<model>_<mesh>.png``: modeled step time (measured compute plus
  alpha-beta communication of the compiled step, NVLink 4 inside hosts) against the
  inter-host bandwidth per device, one line per method, log-log.

And one for the large-model projection, ``projection_vs_bandwidth_<model>.png``: its modeled
gradient-allreduce time per step against the inter-host bandwidth, one line per method.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.scan.figures import CLUSTERS, modeled_seconds, smoothed  # noqa: E402
from jaxcomm import links  # noqa: E402

BANDWIDTHS = np.logspace(8, 11.5, 36)  # bytes per second per device: 0.1 to 316 GB/s
SWEEP_LATENCY_S = 25e-6


def _style(index: int) -> dict:
  return {"color": plt.get_cmap("tab10")(index % 10),
          "linestyle": ("-", "--", ":")[index // 10 % 3]}


def _finish(figure, axes, title: str, path: str) -> None:
  """Title, grid and legend; writes ``path`` and closes the figure."""
  axes.set_title(title)
  axes.grid(True, which="both", alpha=0.3)
  axes.legend(fontsize=8, ncol=2)
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def loss_vs_bytes(rows: list[dict], path: str, title: str) -> None:
  """Trailing-mean training loss against cumulative inter-host bytes per device."""
  figure, axes = plt.subplots(figsize=(9, 5.5))
  for index, row in enumerate(rows):
    steps = np.arange(1, len(row["losses"]) + 1)
    axes.plot(steps * max(row["inter_host_bytes"], 1.0), smoothed(row["losses"], row["window"]),
              label=row["method"], linewidth=1.4, **_style(index))
  axes.set_xscale("log")
  axes.set_xlabel("cumulative inter-host bytes sent per device")
  axes.set_ylabel(f"training loss ({rows[0]['window']}-step trailing mean)")
  _finish(figure, axes, title, path)


def _bandwidth_plot(curves: dict[str, list[float]], path: str, title: str, ylabel: str) -> None:
  """Log-log curves of ms against :data:`BANDWIDTHS`, the cluster presets marked."""
  figure, axes = plt.subplots(figsize=(9, 5.5))
  for index, (label, times) in enumerate(curves.items()):
    axes.plot(BANDWIDTHS / 1e9, times, label=label, linewidth=1.4, **_style(index))
  _mark_presets(axes)
  axes.set_xscale("log")
  axes.set_yscale("log")
  axes.set_xlabel(f"inter-host bandwidth per device, GB/s (latency {SWEEP_LATENCY_S * 1e6:g} us)")
  axes.set_ylabel(ylabel)
  _finish(figure, axes, title, path)


def step_time_vs_bandwidth(rows: list[dict], path: str, title: str) -> None:
  """Modeled step time against inter-host bandwidth; the presets marked as vertical lines."""
  curves = {row["method"]: [1e3 * modeled_seconds(row["median_step_s"], row["report"],
                                                  links.Link("sweep", bandwidth, SWEEP_LATENCY_S),
                                                  row.get("branch_weights"))
                            for bandwidth in BANDWIDTHS]
            for row in rows}
  _bandwidth_plot(curves, path, title, "modeled step time, ms")


def _mark_presets(axes) -> None:
  for slow in CLUSTERS.values():
    bandwidth = links.link(slow).bandwidth_bytes_per_s / 1e9
    axes.axvline(bandwidth, color="grey", linewidth=0.8, alpha=0.6)
    axes.annotate(slow, (bandwidth, 1.0), xycoords=("data", "axes fraction"),
                  rotation=90, va="top", ha="right", fontsize=8, color="grey")


def projection_vs_bandwidth(curves: dict[str, list[float]], path: str, title: str) -> None:
  """``curves[method]``: modeled allreduce ms at each of :data:`BANDWIDTHS`."""
  _bandwidth_plot(curves, path, title, "modeled gradient allreduce per step, ms")


def write_plots(out: str, rows: list[dict], descriptions: dict[str, str]) -> list[str]:
  """Both plots for every ``(model, mesh)`` group with hosts > 1; returns the paths."""
  paths = []
  groups: dict[tuple[str, str], list[dict]] = {}
  for row in rows:
    if "error" not in row and row["hosts"] > 1:
      groups.setdefault((row["model"], row["mesh"]), []).append(row)
  for (model, mesh), group in groups.items():
    title = f"{model}, {mesh} mesh (hosts x local)\n{descriptions[model].split(' on ')[0]}"
    paths.append(os.path.join(out, f"loss_vs_bytes_{model}_{mesh}.png"))
    loss_vs_bytes(group, paths[-1], title)
    paths.append(os.path.join(out, f"step_time_vs_bandwidth_{model}_{mesh}.png"))
    step_time_vs_bandwidth(group, paths[-1], f"{title}\nmeasured compute on this machine + "
                           "modeled communication, NVLink 4 inside hosts")
  return paths
