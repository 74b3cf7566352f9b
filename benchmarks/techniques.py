"""GradZip against PowerSGD, BMUF against local SGD, delta-compressed gossip, adaptive compression.

Usage::

    python -m benchmarks.techniques [--sections lowrank,bmuf,gossip,adaptive] [--task charlm]
        [--steps 300] [--seeds 0]

* ``lowrank``: on real gradient matrices of the task (every leaf with a compressible matrix
  view, at initialization and after ``--steps`` AdamW steps), for ranks 1, 2, 4, 8: bytes,
  relative error ``||M - C(M)|| / ||M||`` of the best rank-r approximation (SVD), of PowerSGD's
  power iteration from a random start and after 10 warm-started steps, and of GradZip; and the
  encode + decode time of each (median of 7, jitted).
* ``bmuf``: synchronous AdamW (fp32, hierarchical), local AdamW averaged every 8 steps, and
  BMUF on the same inner optimizer (paper defaults), 2x4 mesh: held-out loss, inter-host bytes.
* ``gossip``: ring gossip with exact parameters against CHOCO delta compression of the
  parameters (int8, top-10% and scaled sign): bytes per device per step, held-out loss of the
  device mean and the final consensus distance.
* ``adaptive``: top-k at fixed densities 10%, 3%, 1% against :func:`ratio_schedule` over the
  same ladder, :func:`loss_controller` and :func:`bandwidth_controller` on modeled 1 Gbit/s
  and 10 Mbit/s links (the simulated devices share no real link: the step time the controller
  reads is the measured compute time plus the level's inter-host bytes at the link's rate): the share of steps
  at each level, the inter-host bytes per step weighted by those shares, held-out loss.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm._src.optim.adaptive import AdaptiveState

AXES = ("host", "local")
LINKS = {"1 Gbit/s": 125e6, "10 Mbit/s": 1.25e6}  # bytes per second


def _mesh():
  import jaxcomm
  return jaxcomm.make_mesh(hosts=2, local=4)


def _replicated_step(loss_fn, tx, mesh, specs, signals: Sequence[str]):
  """``step(params, state, batch, *signal_values)`` for replicated params; the loss is passed
  to ``tx`` as ``value`` when it reads it."""
  import jaxcomm

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(P(), specs, P(AXES)) + (P(),) * len(signals),
                     out_specs=(P(), specs, P()))
  def step(params, state, batch, *values):
    loss, grads = jaxcomm.optim.local_value_and_grad(loss_fn)(params, batch)
    extra = dict(zip(signals, values))
    if "value" in extra:
      extra["value"] = loss
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXES)

  return step


def train(task, tx, mesh, steps: int, *, local: bool = False, signals: Sequence[str] = (),
          signal_fn=None) -> dict:
  """Trains ``steps`` steps; returns losses, held-out loss, inter-host bytes per step, the
  final state and the median step time. ``signal_fn(state, step_time) -> values`` supplies the
  controller's signals other than the loss."""
  import jaxcomm
  if local:
    params = jaxcomm.optim.to_device_local(task.params, mesh)
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, P(AXES))
    step = jaxcomm.optim.local_training_step(task.loss_fn, tx, mesh, specs)
  else:
    params = jax.device_put(task.params, NamedSharding(mesh, P()))
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
    step = _replicated_step(task.loss_fn, tx, mesh, specs, signals)
  sharding = NamedSharding(mesh, P(AXES))
  batch = lambda i: jax.device_put(task.batch(i), sharding)  # noqa: E731
  values = lambda st, t: tuple(jnp.float32(v) for v in (signal_fn(st, t) if signal_fn else
                                                        [0.0] * len(signals)))
  compiled = step.lower(params, state, batch(0), *values(state, 0.0)).compile()
  report = jaxcomm.accounting.report_from_hlo(compiled.as_text(), mesh)
  losses, times, levels, last = [], [], [], 0.0
  for i in range(steps):
    started = time.perf_counter()
    params, state, loss = compiled(params, state, batch(i), *values(state, last))
    losses.append(float(loss))
    last = time.perf_counter() - started
    times.append(last)
    if isinstance(state, tuple) and isinstance(state[0], AdaptiveState):
      levels.append(int(state[0].level))
  if local:
    mean = jaxcomm.optim.device_mean(params, mesh)
    distance = sum(float(np.sum((np.asarray(leaf).reshape(mesh.size, *m.shape)
                                 - np.asarray(m)) ** 2)) / mesh.size
                   for leaf, m in zip(jax.tree.leaves(params), jax.tree.leaves(mean)))
    params = mean
  else:
    distance = 0.0
  return {"losses": losses, "levels": levels,
          "held_out": float(jax.jit(task.loss_fn)(params, task.held_out)),
          "report": report, "state": state, "step_s": float(np.median(times[-20:])),
          "consensus_distance": distance}


def _task(name: str, steps: int, seed: int):
  from benchmarks.scan.tasks import BATCH, TASKS
  return TASKS[name]("default", 8 * BATCH[name], steps, seed)


def lowrank(args) -> None:
  import jaxcomm
  from jaxcomm._src.compress.gradzip import gradzip
  from jaxcomm._src.compress.powersgd import to_matrix
  task = _task(args.task, args.steps, args.seeds[0])
  grad = jax.jit(jax.grad(task.loss_fn))
  params, opt = task.params, optax.adamw(task.lr)
  opt_state = opt.init(params)
  snapshots = {"init": grad(params, task.batch(0))}
  history = []
  for i in range(args.steps):
    g = grad(params, task.batch(i))
    history = (history + [g])[-10:]
    updates, opt_state = opt.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  snapshots[f"step {args.steps}"] = history[-1]
  print(f"\n## GradZip vs PowerSGD on {task.description}\n")
  print("| gradients | leaf (m x n) | rank | bytes fp32 | bytes PowerSGD | bytes GradZip | "
        "err SVD | err PowerSGD cold | err PowerSGD warm (10 steps) | err GradZip | "
        "us PowerSGD | us GradZip |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for when, grads in snapshots.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
      if leaf.ndim < 2 or min(to_matrix(leaf).shape) < 16:
        continue
      matrix = np.asarray(to_matrix(leaf))
      singular = np.linalg.svd(matrix, compute_uv=False)
      for rank in (1, 2, 4, 8):
        best = np.sqrt(np.sum(singular[rank:] ** 2) / np.sum(singular ** 2))
        row = [when, f"{jax.tree_util.keystr(path)} {matrix.shape[0]}x{matrix.shape[1]}", rank,
               4 * matrix.size]
        errors, timings = [], []
        for compressor in (jaxcomm.powersgd(rank, min_compression_rate=1.0),
                           gradzip(rank, min_compression_rate=1.0)):
          row.append(compressor.wire_bytes(leaf.shape, jnp.float32))
          state = compressor.init(leaf.shape, jnp.float32)
          run = jax.jit(lambda x, s, c=compressor: (
              c.decode(c.encode(x, s, None)[0], leaf.shape), c.encode(x, s, None)[1]))
          out, _ = run(leaf, state)
          errors.append(float(jnp.linalg.norm(out - leaf) / jnp.linalg.norm(leaf)))
          if "powersgd" in compressor.name:
            warm = state
            for past in [h for h in _leaf_history(history, path)]:
              _, warm = run(past, warm)
            out, _ = run(leaf, warm)
            errors.append(float(jnp.linalg.norm(out - leaf) / jnp.linalg.norm(leaf)))
          timings.append(_median_us(lambda: run(leaf, state)))
        print("| " + " | ".join(str(x) for x in row) + f" | {best:.3f} | {errors[0]:.3f} | "
              f"{errors[1]:.3f} | {errors[2]:.3f} | {timings[0]:.0f} | {timings[1]:.0f} |")


def _leaf_history(history, path):
  return [dict(jax.tree_util.tree_leaves_with_path(h))[path] for h in history]


def _median_us(fn) -> float:
  jax.block_until_ready(fn())
  samples = []
  for _ in range(7):
    started = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - started)
  return 1e6 * float(np.median(samples))


def _inter_host(result) -> float:
  return result["report"].link_bytes(AXES)["host"]


def bmuf(args) -> None:
  import jaxcomm
  from jaxcomm.optim import bmuf as make_bmuf, local_sgd
  print(f"\n## BMUF vs local SGD ({args.steps} steps, 2x4 mesh, period 8, inner AdamW)\n")
  print("| method | seed | held-out loss | inter-host bytes/step (amortized) |")
  print("|---|---|---|---|")
  for seed in args.seeds:
    task = _task(args.task, args.steps, seed)
    mesh, inner = _mesh(), optax.adamw(task.lr)
    runs = {
        "sync AdamW (fp32-hier)": (optax.chain(jaxcomm.compressed_allreduce(),
                                               optax.adamw(task.lr)), False, 1),
        "local AdamW, H=8": (local_sgd(inner, 8), True, 8),
        "BMUF-NBM, H=8 (momentum 1-1/8)": (make_bmuf(inner, 8), True, 8),
        "BMUF-CBM, H=8 (momentum 1-1/8)": (make_bmuf(inner, 8, nesterov=False), True, 8),
    }
    for name, (tx, local, period) in runs.items():
      result = train(task, tx, mesh, args.steps, local=local)
      conditionals = result["report"].conditionals()
      weights = {key: [1 / period] * count for key, count in conditionals.items()}
      inter = result["report"].link_bytes(AXES, weights or None)["host"]
      print(f"| {name} | {seed} | {result['held_out']:.4f} | {inter:,.0f} |")


def gossip(args) -> None:
  import jaxcomm
  from jaxcomm.optim import gossip as make_gossip
  print(f"\n## Delta compression on ring gossip ({args.steps} steps, 8 devices, inner AdamW)\n")
  print("| parameters sent | seed | bytes/device/step (all links) | held-out loss (mean model) "
        "| consensus distance |")
  print("|---|---|---|---|---|")
  for seed in args.seeds:
    task = _task(args.task, args.steps, seed)
    mesh = _mesh()
    for name, compressor in (("exact float32", None), ("delta int8", jaxcomm.quantize(8)),
                             ("delta top-10%", jaxcomm.topk(0.1)),
                             ("delta scaled sign", jaxcomm.sign())):
      tx = make_gossip(optax.adamw(task.lr), "ring", compressor=compressor,
                       consensus_step=1.0 if compressor is None else 0.5)
      result = train(task, tx, mesh, args.steps, local=True)
      total = sum(result["report"].link_bytes(AXES).values())
      print(f"| {name} | {seed} | {total:,.0f} | {result['held_out']:.4f} | "
            f"{result['consensus_distance']:.3g} |")


def adaptive(args) -> None:
  import jaxcomm
  from jaxcomm._src.optim import adaptive as ad
  densities = (0.1, 0.03, 0.01)
  ladder = tuple(jaxcomm.topk(d) for d in densities)
  print(f"\n## Adaptive compression ({args.steps} steps, 2x4 mesh, AdamW, top-k ladder "
        f"{', '.join(f'{d:g}' for d in densities)}, gather, error feedback)\n")
  print("| method | seed | steps per level | inter-host bytes/step | held-out loss |")
  print("|---|---|---|---|---|")
  traces = {}
  for seed in args.seeds:
    task = _task(args.task, args.steps, seed)
    mesh = _mesh()
    fixed = {}
    for density, compressor in zip(densities, ladder):
      tx = optax.chain(jaxcomm.compressed_allreduce(compressor, strategy="gather"),
                       optax.adamw(task.lr))
      fixed[density] = train(task, tx, mesh, args.steps)
      print(f"| fixed top-{density:g} | {seed} | - | {_inter_host(fixed[density]):,.0f} | "
            f"{fixed[density]['held_out']:.4f} |")
    level_bytes = [_inter_host(fixed[d]) for d in densities]
    compute = min(result["step_s"] for result in fixed.values())
    third = args.steps // 3
    controllers = {
        f"schedule (levels at steps {third}, {2 * third})":
            (ad.ratio_schedule([third, 2 * third]), (), None),
        "loss controller (patience 20)": (ad.loss_controller(patience=20), ("value",), None),
    }
    for label, rate in LINKS.items():
      controllers[f"bandwidth controller (modeled {label})"] = (
          ad.bandwidth_controller(level_bytes, budget=1.0), ("step_time", "compute_time"),
          lambda state, _, rate=rate: (compute + level_bytes[int(state[0].level)] / rate,
                                       compute))
    for name, (controller, signals, signal_fn) in controllers.items():
      tx = optax.chain(ad.adaptive_allreduce(ladder, controller), optax.adamw(task.lr))
      result = train(task, tx, mesh, args.steps, signals=signals, signal_fn=signal_fn)
      shares = np.asarray(result["state"][0].level_steps) / args.steps
      if seed == args.seeds[0]:
        traces[name] = result["levels"]
      weighted = float(np.dot(shares, level_bytes))
      print(f"| {name} | {seed} | {' / '.join(f'{s:.2f}' for s in shares)} | "
            f"{weighted:,.0f} | {result['held_out']:.4f} |")
  if args.plot:
    _plot_levels(traces, densities, args.plot)
  for label, rate in LINKS.items():
    print(f"\nModeled {label} link for the bandwidth controller: compute time "
          f"{compute * 1e3:.1f} ms (fastest fixed step here), level link times "
          f"{', '.join(f'{b / rate * 1e3:.2f} ms' for b in level_bytes)}.")


def _plot_levels(traces, densities, path) -> None:
  """The top-k density each controller ran at, step by step (first seed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(len(traces), 1, figsize=(8, 1.6 * len(traces)), sharex=True)
  for ax, (name, levels) in zip(np.atleast_1d(axes), traces.items()):
    ax.step(range(len(levels)), [densities[level] for level in levels], where="post")
    ax.set_yscale("log")
    ax.set_ylim(min(densities) / 1.5, max(densities) * 1.5)
    ax.set_yticks(densities, [f"{d:g}" for d in densities])
    ax.minorticks_off()
    ax.set_title(name, fontsize=9)
  np.atleast_1d(axes)[-1].set_xlabel("step")
  figure.supylabel("top-k density sent")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  print(f"\nwrote {path}")


SECTIONS = {"lowrank": lowrank, "bmuf": bmuf, "gossip": gossip, "adaptive": adaptive}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sections", default=",".join(SECTIONS))
  parser.add_argument("--task", default="charlm")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--plot", default=None, help="adaptive: PNG of each controller's level "
                      "over the steps of the first seed")
  args = parser.parse_args(argv)
  args.seeds = [int(s) for s in args.seeds.split(",")]
  sections = args.sections.split(",")
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    parser.error(f"unknown --sections {unknown}; choose from {', '.join(SECTIONS)}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  jax.config.update("jax_num_cpu_devices", 8)
  shown = sys.argv[1:] if argv is None else list(argv)
  print(f"# python -m benchmarks.techniques {' '.join(shown)}".rstrip())
  for section in sections:
    SECTIONS[section](args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
