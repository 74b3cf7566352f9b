"""PNG plots, three per ``(model, mesh)`` with more than one host:

* ``loss_vs_bytes_<model>_<mesh>.png``: training loss (trailing mean) against cumulative
  inter-host bytes per device, one line per method (the first seed), log x: further left at
  equal height is the same quality for fewer bytes.
* ``pareto_<model>_<mesh>.png``: final held-out loss (mean over the seeds, their spread as
  error bars) against inter-host bytes per device per step, one labelled point per method, log
  x; the Pareto frontier (no method is better on both) joined and fp32's loss +1% shaded.
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

from benchmarks.scan.figures import (CLUSTERS, modeled_seconds, pareto_front,  # noqa: E402
                                     per_step_front, smoothed)
from jaxcomm import links  # noqa: E402

BANDWIDTHS = np.logspace(8, 11.5, 36)  # bytes per second per device: 0.1 to 316 GB/s
SWEEP_LATENCY_S = 25e-6


def _style(index: int) -> dict:
  return {"color": plt.get_cmap("tab10")(index % 10),
          "linestyle": ("-", "--", ":")[index // 10 % 3]}


def _finish(figure, axes, title: str, path: str, ncol: int = 2) -> None:
  """Title, grid and legend; writes ``path`` and closes the figure."""
  axes.set_title(title)
  axes.grid(True, which="both", alpha=0.3)
  axes.legend(fontsize=8, ncol=ncol)
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


def pareto(entries: list[dict], path: str, title: str) -> None:
  """Held-out loss (mean, seed spread as error bars) against inter-host bytes per step."""
  diverged = [e["method"] for e in entries if not np.isfinite(e["held_out_loss"])]
  entries = [e for e in entries if np.isfinite(e["held_out_loss"])]
  if diverged:
    title += f"\nnot shown, held-out loss not finite: {', '.join(diverged)}"
  figure, axes = plt.subplots(figsize=(10, 6))
  points = [(max(e["inter_host_bytes"], 1.0), e["held_out_loss"]) for e in entries]
  front = pareto_front(points)
  step_front = per_step_front(points, [e.get("comm_every", 1) for e in entries])
  fp32 = next((e for e in entries if e["method"] == "fp32"), None)
  if fp32 is not None:
    axes.axhspan(fp32["held_out_loss"], 1.01 * fp32["held_out_loss"], color="tab:green",
                 alpha=0.15, label="fp32's held-out loss to +1%")
  axes.plot(*zip(*(points[i] for i in front)), color="black", linewidth=1.2, zorder=1,
            label="Pareto frontier")
  if step_front != front:
    axes.plot(*zip(*(points[i] for i in step_front)), color="black", linewidth=1.0,
              linestyle="--", zorder=1, label="Pareto frontier of the per-step methods")
  for index, (entry, (x, y)) in enumerate(zip(entries, points)):
    on_front = index in front or index in step_front
    axes.errorbar(x, y, yerr=entry["held_out_std"], fmt="o" if on_front else "s",
                  markersize=7 if on_front else 5, capsize=3, zorder=2,
                  color="black" if on_front else "tab:blue")
    axes.annotate(entry["method"], (x, y), xytext=(6, 8 if index % 2 else -12),
                  textcoords="offset points", fontsize=8,
                  fontweight="bold" if on_front else "normal")
  axes.set_xscale("log")
  axes.set_xlabel("inter-host bytes per device per step (compiled HLO; periodic methods "
                  "amortized)")
  axes.set_ylabel(f"held-out loss after {entries[0]['steps']} steps (mean over seeds "
                  f"{','.join(map(str, entries[0]['seeds']))})")
  _finish(figure, axes, title, path, ncol=1)


def write_plots(out: str, rows: list[dict], quality: list[dict],
                descriptions: dict[str, str]) -> list[str]:
  """The three plots for every ``(model, mesh)`` group with hosts > 1; returns the paths."""
  paths = []
  groups: dict[tuple[str, str], list[dict]] = {}
  for row in rows:
    if "error" not in row and row["hosts"] > 1 and row["seed"] == rows[0]["seed"]:
      groups.setdefault((row["model"], row["mesh"]), []).append(row)
  for (model, mesh), group in groups.items():
    title = f"{model}, {mesh} mesh (hosts x local)\n{descriptions[model].split(' on ')[0]}"
    paths.append(os.path.join(out, f"loss_vs_bytes_{model}_{mesh}.png"))
    loss_vs_bytes(group, paths[-1], title)
    paths.append(os.path.join(out, f"pareto_{model}_{mesh}.png"))
    pareto([e for e in quality if (e["model"], e["mesh"]) == (model, mesh)], paths[-1],
           f"{title}\nheld-out loss against inter-host bytes per step; bold: Pareto-optimal "
           "(dashed: among the per-step methods)")
    paths.append(os.path.join(out, f"step_time_vs_bandwidth_{model}_{mesh}.png"))
    step_time_vs_bandwidth(group, paths[-1], f"{title}\nmeasured compute on this machine + "
                           "modeled communication, NVLink 4 inside hosts")
  return paths
