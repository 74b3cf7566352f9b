"""``report.html``: the scan in one self-contained page (plots as base64 PNG, no network).

It holds the recommendation on ``--cluster``, the plots the scan wrote (the Pareto plot of
held-out loss against inter-host bytes with its frontier, the measured step time against
bandwidth), the training-loss curves in one small panel per method family, the modeled step
time on the user's cluster against its inter-host bandwidth for the recommended method, the
runner-up and the fp32 references, and the quality and cluster tables.
"""

from __future__ import annotations

import base64
import html
import io
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.scan import cluster as clusters  # noqa: E402
from benchmarks.scan.figures import smoothed  # noqa: E402
from benchmarks.scan.plots import BANDWIDTHS  # noqa: E402

#: Method families, by name prefix: one loss-curve panel each (fp32 drawn in every panel).
FAMILIES = (
    ("references", ("fp32", "identity", "bf16", "accumulate", "stale")),
    ("quantizers", ("int8", "qsgd", "terngrad", "sign")),
    ("sparsifiers and sketches", ("topk", "randomk", "sketch", "dgc")),
    ("low rank", ("powersgd",)),
    ("compressed optimizers", ("onebit", "zero-one", "demo")),
    ("periodic (local steps)", ("local-sgd", "diloco", "streaming", "slowmo", "fedavg",
                                "fedprox", "sparseloco")),
    ("decentralized", ("gossip", "choco")),
)


def family(method: str) -> str:
  """The :data:`FAMILIES` name of ``method`` (``'other'`` when no prefix matches)."""
  # The longest matching prefix wins ("streaming-diloco" is periodic, "sign" a quantizer).
  matches = [(len(prefix), name) for name, prefixes in FAMILIES for prefix in prefixes
             if method.startswith(prefix)]
  return max(matches)[1] if matches else "other"


def _png(figure) -> str:
  buffer = io.BytesIO()
  figure.tight_layout()
  figure.savefig(buffer, format="png", dpi=90)
  plt.close(figure)
  return base64.b64encode(buffer.getvalue()).decode("ascii")


def loss_panels(rows: list[dict]) -> str:
  """Training loss (trailing mean) per step, one panel per family present; base64 PNG."""
  groups: dict[str, list[dict]] = {}
  for row in rows:
    groups.setdefault(family(row["method"]), []).append(row)
  fp32 = next((r for r in rows if r["method"] == "fp32"), None)
  columns = min(3, len(groups))
  lines = -(-len(groups) // columns)
  figure, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.2 * lines),
                              squeeze=False, sharey=True)
  for axis, (name, members) in zip(axes.flat, groups.items()):
    for row in members + ([fp32] if fp32 and fp32 not in members else []):
      axis.plot(smoothed(row["losses"], row["window"]), label=row["method"], linewidth=1.2,
                color="black" if row is fp32 else None)
    axis.set_title(name, fontsize=10)
    axis.set_xlabel("step")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)
  for axis in list(axes.flat)[len(groups):]:
    axis.set_visible(False)
  axes[0][0].set_ylabel("training loss (trailing mean)")
  return _png(figure)


def cluster_sweep(methods, setting, shapes, spec: clusters.Cluster, names: list[str]) -> str:
  """Modeled step time on ``spec`` with its inter-host bandwidth swept; base64 PNG."""
  figure, axis = plt.subplots(figsize=(8, 4.8))
  chosen = [m for m in methods if m.name in names]
  for method in chosen:
    times = clusters.step_ms_over_bandwidths(method, setting, shapes, spec, BANDWIDTHS)
    axis.plot(BANDWIDTHS / 1e9, times, label=method.name, linewidth=1.5)
  axis.axvline(spec.inter.bandwidth_bytes_per_s / 1e9, color="grey", linestyle="--",
               label=f"your inter link ({spec.inter.name})")
  axis.set_xscale("log")
  axis.set_yscale("log")
  axis.set_xlabel(f"inter-host bandwidth per device, GB/s (latency "
                  f"{1e6 * spec.inter.latency_s:g} us)")
  axis.set_ylabel("modeled step time, ms")
  axis.set_title(f"{spec.hosts} hosts x {spec.local} devices, {spec.intra.name} inside hosts "
                 "(modeled)", fontsize=10)
  axis.grid(True, which="both", alpha=0.3)
  axis.legend(fontsize=8)
  return _png(figure)


def _table(header: list[str], body: list[list]) -> str:
  cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
  rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                 for row in body)
  return f"<table><tr>{cells}</tr>{rows}</table>"


def _img(data: str, alt: str) -> str:
  return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></figure>'


def write(path: str, title: str, advice: dict, quality: list[dict], images: list[str],
          panels: dict[str, str]) -> str:
  """Writes the page to ``path`` and returns it.

  Args:
    advice: what :func:`benchmarks.scan.driver._recommend` returned.
    quality: the quality table's entries.
    images: PNG files the scan wrote, embedded in order.
    panels: ``{caption: base64 PNG}`` made here, embedded after the recommendation.
  """
  parts = [f"<h1>{html.escape(title)}</h1>",
           f"<p>Your cluster: {html.escape(advice['cluster'])}</p>"]
  parts += [f"<pre>{html.escape(r['text'])}</pre>" for r in advice["recommendations"]]
  for caption, data in panels.items():
    parts += [f"<h2>{html.escape(caption)}</h2>", _img(data, caption)]
  for image in images:
    with open(image, "rb") as handle:
      data = base64.b64encode(handle.read()).decode("ascii")
    parts += [f"<h2>{html.escape(os.path.basename(image))}</h2>", _img(data, image)]
  parts.append("<h2>Quality (measured)</h2>" + _table(
      ["model", "mesh", "method", "steps", "inter-host B/step", "held-out", "gap to fp32"],
      [[e["model"], e["mesh"], e["method"], e["steps"], f"{e['inter_host_bytes']:,.0f}",
        f"{e['held_out_loss']:.4f}", "-" if e["held_out_gap_pct"] is None
        else f"{e['held_out_gap_pct']:+.2f}%"] for e in quality]))
  for model, modeled in advice["modeled"].items():
    parts.append(f"<h2>{html.escape(model)} on your cluster (modeled)</h2>" + _table(
        ["method", "inter-host B/step", "intra-host B/step", "comm ms", "step ms"],
        [[name, f"{m['inter_bytes']:,.0f}", f"{m['intra_bytes']:,.0f}", f"{m['comm_ms']:.3f}",
          f"{m['step_ms']:.3f}"] for name, m in sorted(modeled.items(),
                                                        key=lambda kv: kv[1]["step_ms"])]))
  style = ("body{font-family:sans-serif;max-width:1250px;margin:auto}table{border-collapse:"
           "collapse;font-size:13px}td,th{border:1px solid #bbb;padding:2px 6px;text-align:"
           "right}img{max-width:100%}pre{background:#f4f4f4;padding:8px;white-space:pre-wrap}")
  page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
          f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>")
  with open(path, "w") as handle:
    handle.write(page)
  return path


def panels(rows: list[dict], advice: dict, methods, settings: dict, shapes: dict,
           spec: clusters.Cluster) -> dict[str, str]:
  """The report's own plots: loss panels per ``(model, mesh)`` (first seed, hosts > 1) and
  the cluster sweep per model of the recommended, runner-up and fp32 methods."""
  out = {}
  seed = rows[0]["seed"] if rows else None
  for model, mesh in dict.fromkeys((r["model"], r["mesh"]) for r in rows):
    group = [r for r in rows if (r["model"], r["mesh"], r["seed"]) == (model, mesh, seed)
             and "error" not in r and np.all(np.isfinite(r["losses"]))]
    if group and group[0]["hosts"] > 1:
      out[f"Training loss by method family: {model} {mesh}"] = loss_panels(group)
  for entry in advice["recommendations"]:
    names = ["fp32", "fp32-hier"] + [e["method"] for e in (entry["choice"], entry["runner_up"])
                                     if e]
    key = f"Modeled step time vs inter-host bandwidth on your cluster: {entry['model']}"
    if key not in out:
      out[key] = cluster_sweep(methods, settings[entry["model"]], shapes[entry["model"]], spec,
                               list(dict.fromkeys(names)))
  return out
