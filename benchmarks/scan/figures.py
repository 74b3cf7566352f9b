"""Figures derived from the measured runs: ratios, gaps, overhead, iso-quality, modeled time.

Within one ``(model, mesh, seed)`` group every run saw the same data for the same number of
steps, so the figures compare methods against that group's ``fp32`` (ratios, loss gaps,
iso-quality, speedups) and ``identity`` (compression overhead) runs; a figure whose
reference was not run is ``None``. :func:`quality` then averages each method over the seeds.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxcomm import costmodel, links

FAST_LINK = "nvlink4"
#: Modeled clusters: ``{label: slow (inter-host) link preset}``, NVLink 4 inside each host.
#: Iso-quality target: fp32's final training loss plus this fraction of it.
ISO_TOLERANCE = 0.01
CLUSTERS = {"nvlink+ib-hdr": "ib-hdr", "nvlink+100gbe": "100gbe", "nvlink+10gbe": "10gbe",
            "nvlink+1gbe": "1gbe"}


def smoothed(losses: list[float], window: int) -> np.ndarray:
  """Trailing mean over ``window`` steps (fewer at the start): entry ``t`` averages
  ``losses[max(0, t - window + 1) : t + 1]``."""
  values = np.asarray(losses, dtype=np.float64)
  sums = np.cumsum(values)
  starts = np.maximum(np.arange(len(values)) - window + 1, 0)
  return (sums - np.concatenate([[0.0], sums])[starts]) / (np.arange(len(values)) - starts + 1)


def iso_quality_steps(losses: list[float], target: float, window: int) -> int | None:
  """Steps until the ``window``-step trailing mean loss first reaches ``target``, else ``None``.

  Only full windows count, so a lucky first batch cannot reach it.
  """
  curve = smoothed(losses, window)
  reached = np.nonzero(curve[window - 1:] <= target)[0]
  return int(reached[0]) + window if reached.size else None


def modeled_seconds(compute_s: float, report, slow: links.Link | str,
                    branch_weights: dict | None = None) -> float:
  """``compute_s`` plus the modeled communication of the compiled step on NVLink + ``slow``,
  each branch of its conditionals weighted by how often it ran (``branch_weights``)."""
  return costmodel.step_time(compute_s, report, {"host": slow, "local": FAST_LINK},
                             branch_weights=branch_weights)


def _ratio(reference: float | None, value: float) -> float | None:
  if reference is None or reference == value == 0:
    return None
  return float("inf") if value == 0 else reference / value


def derive(rows: list[dict]) -> None:
  """Adds the derived figures to every successful row, in place.

  Adds ``final_train_loss`` (mean of the last ``row['window']`` losses), ``median_step_ms``,
  ``ratio_vs_fp32``,
  ``ratio_vs_fp32_hier`` (inter-host bytes), ``held_out_gap_pct``, ``train_gap_pct``,
  ``overhead_pct`` (median step time against ``identity``), ``iso_quality_steps`` (to within
  :data:`ISO_TOLERANCE` of fp32's final train loss; ``None``: not reached), ``modeled_ms``
  and ``speedup`` per cluster.
  """
  ok = [row for row in rows if "error" not in row]
  for row in ok:
    row["final_train_loss"] = float(np.mean(row["losses"][-row["window"]:]))
    row["median_step_ms"] = 1e3 * row["median_step_s"]
    row["modeled_ms"] = {name: 1e3 * modeled_seconds(row["median_step_s"], row["report"], slow,
                                                     row.get("branch_weights"))
                         for name, slow in CLUSTERS.items()}
  for row in ok:
    group = {r["method"]: r for r in ok
             if (r["model"], r["mesh"], r["seed"]) == (row["model"], row["mesh"], row["seed"])}
    fp32, hier, identity = group.get("fp32"), group.get("fp32-hier"), group.get("identity")
    row["ratio_vs_fp32"] = _ratio(fp32 and fp32["inter_host_bytes"], row["inter_host_bytes"])
    row["ratio_vs_fp32_hier"] = _ratio(hier and hier["inter_host_bytes"],
                                       row["inter_host_bytes"])
    row["held_out_gap_pct"] = (100 * (row["held_out_loss"] / fp32["held_out_loss"] - 1)
                               if fp32 else None)
    row["train_gap_pct"] = (100 * (row["final_train_loss"] / fp32["final_train_loss"] - 1)
                            if fp32 else None)
    row["overhead_pct"] = (100 * (row["median_step_s"] / identity["median_step_s"] - 1)
                           if identity else None)
    row["iso_quality_steps"] = (iso_quality_steps(
        row["losses"], (1 + ISO_TOLERANCE) * fp32["final_train_loss"], row["window"])
                                if fp32 else None)
    row["speedup"] = ({name: fp32["modeled_ms"][name] / ms
                       for name, ms in row["modeled_ms"].items()} if fp32 else None)


def quality(rows: list[dict]) -> list[dict]:
  """The quality table: one entry per ``(model, mesh, method)``, averaged over its seeds.

  Every entry has ``model``, ``mesh``, ``hosts``, ``method``, ``steps``, ``seeds`` (those run),
  ``inter_host_bytes`` (mean over the seeds: per device per step, periodic methods amortized),
  ``ratio_vs_fp32`` and ``ratio_vs_fp32_hier`` (of those means), ``held_out_loss`` and
  ``held_out_std`` (mean and sample standard deviation over the seeds, 0 for one seed),
  ``held_out_gap_pct`` (the mean of the per-seed gaps to fp32 of the same seed) and
  ``gap_range_pct`` (their ``(min, max)``) and ``comm_every`` (1 for a method that
  communicates every step, its period for one that synchronizes periodically). Failed runs
  are left out. A row needs only ``model, mesh, hosts, method, steps, seed, held_out_loss,
  inter_host_bytes`` (``comm_every`` defaults to 1), so runs read back from an earlier
  ``results.json`` (``--include``) enter as they are.
  """
  groups: dict[tuple, list[dict]] = {}
  fp32 = {}
  for row in rows:
    if "error" not in row:
      groups.setdefault((row["model"], row["mesh"], row["method"]), []).append(row)
      if row["method"] == "fp32":
        fp32[row["model"], row["mesh"], row["seed"]] = row["held_out_loss"]
  table = []
  for (model, mesh, method), runs in groups.items():
    losses = [r["held_out_loss"] for r in runs]
    gaps = [100 * (r["held_out_loss"] / fp32[model, mesh, r["seed"]] - 1) for r in runs
            if (model, mesh, r["seed"]) in fp32]
    table.append({
        "model": model, "mesh": mesh, "hosts": runs[0]["hosts"], "method": method,
        "steps": runs[0]["steps"], "seeds": [r["seed"] for r in runs],
        "inter_host_bytes": float(np.mean([r["inter_host_bytes"] for r in runs])),
        "held_out_loss": float(np.mean(losses)),
        "held_out_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else 0.0,
        "held_out_gap_pct": float(np.mean(gaps)) if gaps else None,
        "gap_range_pct": (min(gaps), max(gaps)) if gaps else None,
        "comm_every": runs[0].get("comm_every", 1)})
  for entry in table:
    same = {e["method"]: e for e in table if (e["model"], e["mesh"]) == (entry["model"],
                                                                         entry["mesh"])}
    entry["ratio_vs_fp32"] = _ratio(same["fp32"]["inter_host_bytes"] if "fp32" in same else None,
                                    entry["inter_host_bytes"])
    entry["ratio_vs_fp32_hier"] = _ratio(
        same["fp32-hier"]["inter_host_bytes"] if "fp32-hier" in same else None,
        entry["inter_host_bytes"])
  return table


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
  """Indices of the Pareto-optimal ``(bytes, loss)`` points, by increasing bytes: no other
  point has at most their bytes and at most their loss with one of the two strictly lower."""
  order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
  front, best = [], float("inf")
  for index in order:
    if points[index][1] < best:
      front.append(index)
      best = points[index][1]
  return front


def per_step_front(points: list[tuple[float, float]], comm_every: list[int]) -> list[int]:
  """:func:`pareto_front` among the methods that communicate every step (``comm_every`` 1):
  the frontier a run without local steps chooses from, which a periodic method that sends
  the fewest bytes and reaches the lowest loss would otherwise reduce to one point."""
  every_step = [i for i, period in enumerate(comm_every) if period == 1]
  return [every_step[i] for i in pareto_front([points[i] for i in every_step])]


def best_within(rows: list[dict], model: str, mesh: str, tolerance_pct: float) -> dict | None:
  """The row (or :func:`quality` entry) with the highest ``ratio_vs_fp32`` whose held-out loss
  is within ``tolerance_pct`` of fp32's (``None`` when fp32 was not run, no inter-host bytes
  were sent or no row qualifies)."""
  eligible = [r for r in rows if "error" not in r and (r["model"], r["mesh"]) == (model, mesh)
              and r["ratio_vs_fp32"] is not None and r["held_out_gap_pct"] is not None
              and r["held_out_gap_pct"] <= tolerance_pct]
  return max(eligible, key=lambda r: r["ratio_vs_fp32"], default=None)


def topk_payload_check(row: dict, task, fraction: float) -> tuple[float, int]:
  """Measured bytes of the top-k payload all-gathers over the host axis against the formula.

  Per leaf, each device's shard of ``ceil(d/G)`` elements keeps
  ``k = max(1, floor(fraction ceil(d/G)))`` float32 values with int32 indices, and the
  all-gather sends them to ``H-1`` peers: ``(H-1) * 8 * sum(k)`` bytes per device per step.

  Returns:
    ``(measured, formula)``.
  """
  from jaxcomm._src.compress.topk import topk_count
  hosts, local = row["hosts"], row["local"]
  measured = sum(op.bytes_per_device for op in row["report"].collectives
                 if op.kind == "all-gather" and op.axes == ("host",))
  total_k = sum(topk_count((-(-leaf.size // local),), fraction, None)
                for leaf in jax.tree.leaves(task.params))
  return measured, (hosts - 1) * 8 * total_k
