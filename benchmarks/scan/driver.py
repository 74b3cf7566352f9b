"""Runs the plan of :mod:`benchmarks.mesh_scan` and writes everything it measured."""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import jaxcomm
from benchmarks.scan import cluster, custom_task, figures, output, plots, recommend, report_html, resume
from benchmarks.mesh_scan import COMPARABLE
from benchmarks.scan.methods import REGISTRY, Setting
from benchmarks.scan.run import run
from benchmarks.scan.tasks import BATCH, TASKS

PROJECTION_HOSTS, PROJECTION_LOCAL = 8, 8


def _runs(args: argparse.Namespace) -> list[tuple[str, str, str, int, int]]:
  """``(model, mesh, method, steps, seed)`` for every run of the plan and every seed, without
  repeats."""
  runs = []
  for seed in args.seeds:
    for scan in args.plan:
      steps = args.steps_override or scan.steps or args.steps
      for model in scan.models:
        for mesh in scan.meshes:
          runs += [(model, mesh, method, steps, seed) for method in scan.methods]
  return list(dict.fromkeys(runs))


#: Examples per device per step of a ``--task`` task without ``--batch``.
CUSTOM_BATCH = 8


def preload_task(args: argparse.Namespace) -> str | None:
  """Loads the ``--task`` task of every seed into ``args.preloaded``; returns an error or None."""
  args.preloaded = {}
  steps = args.steps_override or args.steps
  try:
    for seed in args.seeds:
      _task(args, args.task_name, steps, seed, args.preloaded)
  except (ValueError, TypeError) as error:
    return str(error).splitlines()[0]
  return None


def _task(args, model: str, steps: int, seed: int, cache: dict):
  key = (model, steps, seed)
  if key not in cache and getattr(args, "task", None) and model == args.task_name:
    cache[key] = custom_task.load(args.task, (args.batch or CUSTOM_BATCH) * jax.device_count(),
                                  seed, model)
  if key not in cache:
    batch = args.batch or BATCH[model]
    cache[key] = TASKS[model](args.size, batch * jax.device_count(), steps, seed, args.hidden)
  return cache[key]


def _setting(args, task, hosts: int, local: int, steps: int = 1000, seed: int = 0) -> Setting:
  return Setting(lr=args.lr or task.lr, seed=seed, topk_density=args.topk_density,
                 sketch_density=args.sketch_density, hosts=hosts, local=local,
                 params=task.params, steps=steps)


def _traffic(args, methods: list[str], setting: Setting) -> dict[str, jaxcomm.costmodel.Traffic]:
  """The large model's modeled allreduce (steps and bytes on each link) per method that has a
  formula; each method is projected once, then timed on any link."""
  shapes = list(jaxcomm.costmodel.transformer_gradient_shapes(args.projection_model).values())
  return {name: REGISTRY[name].project(setting, shapes, PROJECTION_HOSTS, PROJECTION_LOCAL)
          for name in methods if REGISTRY[name].project is not None}


def _project(args, traffic: dict[str, jaxcomm.costmodel.Traffic]) -> list[dict]:
  """Rows of :func:`_traffic`'s projections timed on each cluster, with the speedup over fp32."""
  rows = [{"model": args.projection_model, "hosts": PROJECTION_HOSTS,
           "local": PROJECTION_LOCAL, "method": name, "slow_bytes": modeled.slow_bytes,
           "fast_bytes": modeled.fast_bytes,
           "comm_ms": {cluster: 1e3 * modeled.seconds(figures.FAST_LINK, slow)
                       for cluster, slow in figures.CLUSTERS.items()}}
          for name, modeled in traffic.items()]
  reference = next((r for r in rows if r["method"] == "fp32"), None)
  for row in rows:
    row["speedup"] = {c: (reference["comm_ms"][c] / ms if reference else None)
                      for c, ms in row["comm_ms"].items()}
  return rows


def _projection_curves(traffic: dict[str, jaxcomm.costmodel.Traffic]) -> dict[str, list[float]]:
  """Modeled allreduce ms of :func:`_traffic`'s projections at each bandwidth of
  :data:`plots.BANDWIDTHS` (latency :data:`plots.SWEEP_LATENCY_S`)."""
  return {name: [1e3 * modeled.seconds(figures.FAST_LINK, jaxcomm.links.Link(
      "sweep", bandwidth, plots.SWEEP_LATENCY_S)) for bandwidth in plots.BANDWIDTHS]
      for name, modeled in traffic.items()}


def _recommend(args, console, tasks: dict, quality: list[dict], methods: list[str]):
  """Prints the recommendation of every ``(model, mesh)`` on ``--cluster``; returns it, and
  the settings and gradient shapes of each model on that cluster."""
  spec, per_model, out, settings, shapes = args.cluster_spec, {}, [], {}, {}
  for (model, *_), task in tasks.items():
    if model not in per_model:
      shapes[model] = [leaf.shape for leaf in jax.tree.leaves(task.params)]
      settings[model] = _setting(args, task, spec.hosts, spec.local, seed=args.seeds[0])
      per_model[model] = cluster.model_step([REGISTRY[m] for m in methods], settings[model],
                                            shapes[model], spec)
  console.print(f"Your cluster (--cluster): {spec.describe()}", highlight=False)
  for model, mesh in dict.fromkeys((e["model"], e["mesh"]) for e in quality):
    if model not in per_model:
      continue
    group = [e for e in quality if (e["model"], e["mesh"]) == (model, mesh)]
    choice = recommend.recommend(group, per_model[model], args.margin,
                                 f"{model} (quality measured on mesh {mesh})")
    console.print(choice.text, highlight=False)
    out.append({"model": model, "mesh": mesh, "text": choice.text, "choice": choice.choice,
                "runner_up": choice.runner_up, "compressed_holds": choice.compressed_holds})
  return {"cluster": spec.describe(), "margin_pct": args.margin, "modeled": per_model,
          "recommendations": out}, settings, shapes


def _line(row: dict) -> str:
  """The one-line record of a finished run (also what a launched job's log shows)."""
  if "error" in row:
    return (f"{row['method']:<20} failed: {row['error']} ({row['model']} {row['mesh']} "
            f"seed {row['seed']})")
  return (f"{row['method']:<20} {row['inter_host_bytes']:>12,.0f} inter-host B/step "
          f"{row['intra_host_bytes']:>12,.0f} intra-host  {1e3 * row['median_step_s']:7.1f} ms/step"
          f"  held-out {row['held_out_loss']:.4f}  ({row['model']} {row['mesh']} "
          f"seed {row['seed']})")


def scan(args: argparse.Namespace) -> int:
  """Trains every run, derives the figures, prints the tables and writes the files."""
  console = Console(width=220)
  runs, tasks, rows = _runs(args), dict(getattr(args, "preloaded", {})), []
  settings = {name: getattr(args, name) for name in COMPARABLE + ("task",)}
  resumed, skipped = resume.load(args.out, runs, settings) if args.resume else ({}, 0)
  if args.resume:
    console.print(f"--resume: {len(resumed)} of {len(runs)} runs found in {args.out}"
                  + (f", {skipped} saved with other settings rerun" if skipped else ""))
  devices = jax.devices()
  console.print(f"mesh_scan on {len(devices)} {devices[0].platform} devices "
                f"({jax.process_count()} process(es)), {platform.processor() or platform.machine()}"
                f", {len(runs)} runs, out {args.out}")
  with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=console) as progress:
    bar = progress.add_task("steps", total=sum(steps for *_, steps, _ in runs))
    runs_bar = progress.add_task("runs", total=len(runs))
    for model, mesh_name, method, steps, seed in runs:
      hosts, local = (int(v) for v in mesh_name.split("x"))
      task = _task(args, model, steps, seed, tasks)
      if (model, mesh_name, method, steps, seed) in resumed:
        rows.append(resumed[model, mesh_name, method, steps, seed])
        progress.advance(bar, steps)
        progress.advance(runs_bar)
        progress.console.print(_line(rows[-1]) + " resumed", highlight=False)
        continue
      if (model, mesh_name, seed) not in {(r["model"], r["mesh"], r["seed"]) for r in rows}:
        progress.console.print(f"{model}: {task.description}; mesh {mesh_name}: {hosts} hosts "
                               f"x {local} local devices; {steps} steps; seed {seed}")
      progress.update(bar, description=f"{model} {mesh_name} {method}")
      # Shorter runs of the plan time (and average the loss over) their last half at most.
      window = min(args.timed_steps, max(1, steps // 2))
      row = {"model": model, "mesh": mesh_name, "hosts": hosts, "local": local,
             "method": method, "steps": steps, "seed": seed, "window": window}
      mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
      try:
        row |= run(task, REGISTRY[method], mesh, _setting(args, task, hosts, local, steps, seed),
                   steps, window, lambda: progress.advance(bar))
      except (ValueError, TypeError, NotImplementedError) as error:
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
      rows.append(row)
      if jax.process_index() == 0:
        resume.save(args.out, (model, mesh_name, method, steps, seed), row, settings)
      progress.advance(runs_bar)
      progress.console.print(_line(row), highlight=False)
  figures.derive(rows)
  done, included = {(r["model"], r["mesh"], r["method"], r["seed"]) for r in rows}, []
  for row in args.included:  # the first of each (model, mesh, method, seed) counts
    if (row["model"], row["mesh"], row["method"], row["seed"]) not in done:
      done.add((row["model"], row["mesh"], row["method"], row["seed"]))
      included.append(row)
  if included:
    console.print(f"included from {', '.join(args.include)}: {len(included)} runs of "
                  f"{', '.join(dict.fromkeys(r['method'] for r in included))}", highlight=False)
  quality = figures.quality(rows + included)
  first = next(iter(tasks.values()))
  methods = list(dict.fromkeys(m for _, _, m, _, _ in runs))
  big_setting = _setting(args, first, PROJECTION_HOSTS, PROJECTION_LOCAL, seed=args.seeds[0])
  traffic = _traffic(args, methods, big_setting)
  projected = _project(args, traffic)
  projection_title = (f"Modeled (not measured) gradient allreduce of {args.projection_model} "
                      f"per step on {PROJECTION_HOSTS} hosts x {PROJECTION_LOCAL} GPUs, "
                      "NVLink 4 inside hosts; x fp32: speedup of the allreduce time")
  output.print_tables(console, rows, quality, projected, projection_title)
  for row in rows:
    if row["method"] == "topk-ef" and "report" in row and row["seed"] == args.seeds[0]:
      measured, formula = figures.topk_payload_check(
          row, tasks[(row["model"], row["steps"], row["seed"])], args.topk_density)
      console.print(f"{row['model']} {row['mesh']} topk-ef: top-k payload all-gathers over the "
                    f"host axis send {measured:,.0f} B per device per step; formula "
                    f"(H-1)*8*sum(k) = {formula:,} ({100 * (measured / formula - 1):+.2f}%)",
                    highlight=False)
  for model, mesh in dict.fromkeys((r["model"], r["mesh"]) for r in rows):
    best = figures.best_within(quality, model, mesh, 1.0)
    if best is None:
      continue
    console.print(f"{model} {mesh}: most compressed within 1% of fp32's held-out loss: "
                  + (f"{best['method']}, {best['ratio_vs_fp32']:.1f}x fewer inter-host bytes "
                     f"than fp32 ({best['held_out_gap_pct']:+.2f}%)" if best["method"] != "fp32"
                     else "none but fp32 itself"), highlight=False)
  recommendations, settings, shapes = _recommend(args, console, tasks, quality, methods)
  meta = {"command": "python -m benchmarks.mesh_scan", "args": {
      k: v for k, v in vars(args).items()
      if k not in ("plan", "included", "preloaded", "cluster_spec")},
      "plan": [s._asdict() for s in args.plan],
      "included": {"paths": args.include, "runs": len(included)},
      "devices": len(devices), "platform": devices[0].platform,
      "jax": jax.__version__, "machine": platform.machine(),
      "models": {name: task.description for (name, *_), task in tasks.items()},
      "clusters": figures.CLUSTERS, "fast_link": figures.FAST_LINK}
  if jax.process_index() != 0:  # in a launched job, the first process writes the files
    return 0
  written = output.write_files(args.out, meta, rows, quality, projected, projection_title)
  written.append(os.path.join(args.out, "recommendation.json"))
  with open(written[-1], "w") as handle:
    json.dump(recommendations, handle, indent=1)
  written += plots.write_plots(args.out, rows, quality,
                               {name: task.description for (name, *_), task in tasks.items()})
  written.append(os.path.join(args.out, f"projection_vs_bandwidth_{args.projection_model}.png"))
  plots.projection_vs_bandwidth(
      _projection_curves(traffic), written[-1],
      f"{args.projection_model} gradients on {PROJECTION_HOSTS} hosts x {PROJECTION_LOCAL} GPUs "
      "(modeled), NVLink 4 inside hosts")
  written.append(report_html.write(
      os.path.join(args.out, "report.html"), "mesh_scan: " + ", ".join(meta["models"]),
      recommendations, quality, [p for p in written if p.endswith(".png")],
      report_html.panels(rows, recommendations, [REGISTRY[m] for m in methods], settings,
                         shapes, args.cluster_spec)))
  console.print("wrote " + ", ".join(written), highlight=False)
  return 0
