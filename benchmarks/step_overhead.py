"""step_overhead: each method's step time over ``identity``'s, all timed in turn in one process.

mesh_scan times one method after another, so a change in the machine's load between two
methods lands in their ratio. Here every method's step (mesh_scan's task and registry, the
same compiled step as mesh_scan) is compiled first, then the steps run round-robin -- one step
of each method per round -- and each method's median over the rounds is compared with
``identity``'s: load changes hit every method alike. With ``--tree before=PATH`` the same
methods are also compiled from another checkout of the repository (e.g. ``git archive`` of an
older commit) and stepped in the same rounds, so a change is measured before and after in one
process; each tree's overhead is taken against its own ``identity``. Besides the median wall
time it prints the 25th percentile's overhead and the process CPU time per step (all threads,
so the 8 simulated devices' work), which a loaded machine disturbs less. ``--donate`` also
steps every method with its state donated (``jax.jit(step, donate_argnums=(0, 1))``, what
``jaxcomm.data_parallel(..., donate=True)`` does), labelled ``donated:``, against the donated
``identity``. Run ``python -m benchmarks.step_overhead --help`` for the flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from benchmarks.common import host_local_mesh, imported_from, parse_trees

DEFAULT_METHODS = ("identity", "fp32", "fp32-hier", "bf16", "int8", "qsgd", "terngrad",
                   "sign-ef", "sign-ef-2p", "topk-ef", "topk-ef-2p", "randomk-ef", "sketch",
                   "powersgd-r1", "powersgd-r4")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                      help="comma-separated mesh_scan methods; 'identity' is the reference")
  parser.add_argument("--model", default="charlm", help="mesh_scan task")
  parser.add_argument("--hidden", default=None,
                      help="comma-separated hidden widths of the task's model (mesh_scan's "
                      "default when omitted), e.g. 1536,1536,1536 for slow_link's MLP")
  parser.add_argument("--mesh", default="2x4", help="HOSTSxLOCAL simulated devices")
  parser.add_argument("--rounds", type=int, default=60, help="timed rounds")
  parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
  parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                      help="also time the methods as built from the checkout at PATH")
  parser.add_argument("--donate", action="store_true",
                      help="also time every method with its state donated ('donated:')")
  args = parser.parse_args(argv)
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  if "identity" not in args.methods:
    args.methods.insert(0, "identity")
  hosts, _, local = args.mesh.partition("x")
  if not (hosts.isdigit() and local.isdigit() and int(hosts) >= 1 and int(local) >= 1):
    parser.error(f"--mesh must be HOSTSxLOCAL, e.g. 2x4, got {args.mesh!r}")
  args.hosts, args.local = int(hosts), int(local)
  args.tree = parse_trees(parser, args.tree)
  try:
    args.hidden = (None if args.hidden is None
                   else tuple(int(width) for width in args.hidden.split(",")))
  except ValueError:
    parser.error(f"--hidden must be comma-separated integers, got {args.hidden!r}")
  for name in ("rounds", "warmup"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  return args


def compile_steps(args, mesh, donate: bool = False) -> dict:
  """``{method: [compiled step, params, opt_state]}`` and the task's batch function; with
  ``donate`` each step donates its parameters and optimizer state."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  import jaxcomm
  from benchmarks.scan.methods import REGISTRY, Setting
  from benchmarks.scan.tasks import BATCH, TASKS
  steps = args.warmup + args.rounds
  task = TASKS[args.model]("default", BATCH[args.model] * mesh.size, steps, 0, args.hidden)
  setting = Setting(lr=task.lr, seed=0, topk_density=0.01, sketch_density=0.02,
                    hosts=args.hosts, local=args.local, params=task.params, steps=300)
  sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
  batch_at = lambda index: jax.device_put(task.batch(index), sharding)  # noqa: E731
  runs = {}
  for name in args.methods:
    method = REGISTRY[name]
    if method.device_local:
      raise SystemExit(f"{name} is device-local (periodic): compare it with mesh_scan")
    tx = method.build(setting)
    # A copy per method: a donating step deletes its parameters.
    params = jax.device_put(jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), task.params),
                            NamedSharding(mesh, PartitionSpec()))
    try:
      opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
      step = method.make_step(task.loss_fn, tx, mesh, specs)
      if donate:
        step = jax.jit(step, donate_argnums=(0, 1))
      step = step.lower(params, opt_state, batch_at(0)).compile()
    except Exception as error:  # reported and left out; the other methods still run
      print(f"{name}: failed to build: {type(error).__name__}: {str(error).splitlines()[0]}")
      continue
    runs[name] = [step, params, opt_state]
  return runs, batch_at


def compile_from_tree(args, mesh, path: str) -> dict:
  """:func:`compile_steps` with ``jaxcomm``, ``benchmarks`` and ``models`` imported from the
  checkout at ``path``."""
  with imported_from(path, ("jaxcomm", "benchmarks", "models")):
    from benchmarks import step_overhead
    return step_overhead.compile_steps(args, mesh)[0]


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  mesh, _ = host_local_mesh(args.hosts, args.local)
  import jax
  import numpy as np
  from benchmarks.scan.methods import REGISTRY
  unknown = [m for m in args.methods if m not in REGISTRY]
  if unknown:
    print(f"unknown method {unknown[0]!r}", file=sys.stderr)
    return 2
  runs, batch_at = compile_steps(args, mesh)
  if "identity" not in runs:
    return 1
  if args.donate:
    runs.update({f"donated:{name}": run
                 for name, run in compile_steps(args, mesh, donate=True)[0].items()})
  for label, path in args.tree:
    runs.update({f"{label}:{name}": run
                 for name, run in compile_from_tree(args, mesh, path).items()})
  times = {name: ([], []) for name in runs}  # wall and process CPU seconds per step
  for index in range(args.warmup + args.rounds):
    batch = batch_at(index)
    for name, run in runs.items():
      started, cpu_started = time.perf_counter(), time.process_time()
      params, opt_state, loss = run[0](run[1], run[2], batch)
      jax.block_until_ready((params, opt_state, loss))
      if index >= args.warmup:
        times[name][0].append(time.perf_counter() - started)
        times[name][1].append(time.process_time() - cpu_started)
      run[1:] = [params, opt_state]
  print(f"{args.model} {args.mesh}, {args.rounds} rounds (one step of each method per round)")
  print("| method | median step ms | overhead vs identity | IQR ms | q25 overhead | "
        "CPU ms | CPU overhead |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for name, (wall, cpu) in times.items():
    label = name.rpartition(":")[0]
    reference = times[f"{label}:identity" if label else "identity"]
    over = lambda stat, i: 100 * (stat(times[name][i]) / stat(reference[i]) - 1)  # noqa: E731
    q25 = lambda seconds: np.percentile(seconds, 25)  # noqa: E731
    q1, q3 = np.percentile(wall, [25, 75])
    print(f"| {name} | {1e3 * np.median(wall):.1f} | {over(np.median, 0):+.0f}% | "
          f"{1e3 * q1:.1f}-{1e3 * q3:.1f} | {over(q25, 0):+.0f}% | {1e3 * np.median(cpu):.1f} | "
          f"{over(np.median, 1):+.0f}% |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
