"""mesh_scan: bytes on each link, quality and step time of compressed data parallelism.

Trains the same MLP classifier on the same generated data once per method on a
``(host, local)`` mesh and prints, per method, what it measured: inter-host and intra-host
bytes each device sends per step (read from the compiled HLO), the compression ratio against
plain fp32 ``pmean``, the final training and held-out loss and their gap to fp32, and the
median step time.

Run ``python -m benchmarks.mesh_scan --help`` for the flags. With no flags it simulates
8 CPU devices as 2 hosts x 4 local devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

METHODS = ("fp32", "fp32-hier", "sign-ef", "topk-ef", "int8")
METHOD_HELP = {
    "fp32": "plain jax.lax.pmean over both axes at full precision (the reference)",
    "fp32-hier": "jaxcomm hierarchical allreduce with no compression",
    "sign-ef": "scaled 1-bit sign across hosts, with error feedback",
    "topk-ef": "top-k (--topk-fraction) across hosts, with error feedback",
    "int8": "8-bit stochastic quantization across hosts (unbiased, no error feedback)",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.mesh_scan",
      description=__doc__.split("\n\n")[0],
      epilog="Methods: " + "; ".join(f"{k}: {v}" for k, v in METHOD_HELP.items()),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--hosts", type=int, default=2, help="size of the slow (inter-host) axis")
  parser.add_argument("--local", type=int, default=4, help="size of the fast (intra-host) axis")
  parser.add_argument("--simulated-devices", type=int, default=8,
                      help="CPU devices to simulate when running on CPU (must be hosts*local)")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="comma-separated methods to run, from: " + ", ".join(METHODS))
  parser.add_argument("--steps", type=int, default=1000, help="training steps per method")
  parser.add_argument("--batch", type=int, default=32, help="examples per device per step")
  parser.add_argument("--features", type=int, default=64, help="input features")
  parser.add_argument("--hidden", default="256,256", help="comma-separated hidden widths")
  parser.add_argument("--classes", type=int, default=10, help="output classes")
  parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
  parser.add_argument("--topk-fraction", type=float, default=0.01,
                      help="fraction of each shard that topk-ef sends")
  parser.add_argument("--timed-steps", type=int, default=50,
                      help="last steps whose median wall-clock time and mean loss are reported")
  parser.add_argument("--seed", type=int, default=0, help="seed for data and initialization")
  parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
  args = parser.parse_args(argv)
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = [m for m in args.methods if m not in METHODS]
  if unknown:
    parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
  try:
    args.hidden = [int(w) for w in args.hidden.split(",") if w]
  except ValueError:
    parser.error(f"--hidden must be comma-separated integers, got {args.hidden!r}")
  for name in ("hosts", "local", "steps", "batch", "features", "classes", "timed_steps"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if not 0 < args.topk_fraction <= 1:
    parser.error(f"--topk-fraction must be in (0, 1], got {args.topk_fraction}")
  if args.timed_steps >= args.steps:
    parser.error(f"--timed-steps ({args.timed_steps}) must be below --steps ({args.steps})")
  return args


def _configure_devices(count: int) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from jaxcomm import distributed
  if distributed.initialize_from_env():  # started by python -m jaxcomm.launch: one host each
    return
  jax.config.update("jax_num_cpu_devices", count)


def _transformation(method: str, args):
  import jax
  import optax

  import jaxcomm
  axes = ("host", "local")
  if method == "fp32":
    reduce = optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda grads, state, params=None: (jax.lax.pmean(grads, axes), state))
  else:
    compressor = {
        "fp32-hier": None,
        "sign-ef": jaxcomm.sign(),
        "topk-ef": jaxcomm.topk(args.topk_fraction),
        "int8": jaxcomm.quantize(8),
    }[method]
    reduce = jaxcomm.compressed_allreduce(compressor, feedback=method.endswith("-ef"),
                                          seed=args.seed)
  return optax.chain(reduce, optax.adamw(args.lr))


def topk_formula_bytes(params, fraction: float, hosts: int, local: int) -> int:
  """``(H-1) * 8 * sum_leaves k`` with ``k = max(1, floor(fraction * ceil(d/G)))`` per leaf."""
  import jax

  from jaxcomm.compress.topk import topk_count
  total_k = sum(topk_count((-(-leaf.size // local),), fraction, None)
                for leaf in jax.tree.leaves(params))
  return (hosts - 1) * 8 * total_k


def run_method(method: str, args, mesh, data, held_out) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  import jaxcomm
  from models.mlp import classification_loss, init_mlp
  graphdef, params = init_mlp(args.features, args.hidden, args.classes, seed=args.seed)
  loss_fn = classification_loss(graphdef)
  tx = _transformation(method, args)
  opt_state, specs = jaxcomm.sharded_init(tx, params, mesh)
  step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, specs)
  inputs, labels = data
  per_step = args.batch * mesh.size
  batch_sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

  def batch_at(index):
    start = index * per_step
    return jax.device_put((inputs[start:start + per_step], labels[start:start + per_step]),
                          batch_sharding)

  report = jaxcomm.accounting.measure(step, params, opt_state, batch_at(0), mesh=mesh)
  link = report.link_bytes(("host", "local"))
  losses, times = [], []
  for index in range(args.steps):
    batch = batch_at(index)
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch)
    loss = float(loss)
    times.append(time.perf_counter() - start)
    losses.append(loss)
  held_out_loss = float(jax.jit(loss_fn)(params, held_out))
  return {
      "method": method,
      "inter_host_bytes": link["host"],
      "intra_host_bytes": link["local"],
      "final_train_loss": float(np.mean(losses[-args.timed_steps:])),
      "held_out_loss": held_out_loss,
      "median_step_ms": 1e3 * float(np.median(times[-args.timed_steps:])),
      "collectives": report.count(),
      "finite": bool(jnp.isfinite(held_out_loss)),
      "params": params,
  }


def _ratio(reference: dict | None, row: dict) -> str:
  if reference is None:
    return "-"
  if not row["inter_host_bytes"]:
    return "inf"
  return f"{reference['inter_host_bytes'] / row['inter_host_bytes']:.1f}x"


def format_table(rows: list[dict]) -> str:
  """One row per method; ratios and loss gaps relative to the first row (fp32 when run)."""
  reference = next((r for r in rows if r["method"] == "fp32"), rows[0])
  hierarchical = next((r for r in rows if r["method"] == "fp32-hier"), None)
  header = (f"{'method':<10} {'inter-host B/step':>17} {'intra-host B/step':>17} "
            f"{'ratio vs ' + reference['method']:>14} {'vs fp32-hier':>12} "
            f"{'train loss':>10} {'d train':>8} "
            f"{'held-out':>9} {'d held-out':>10} {'step ms':>8}")
  lines = [header, "-" * len(header)]
  for row in rows:
    lines.append(
        f"{row['method']:<10} {row['inter_host_bytes']:>17,.0f} {row['intra_host_bytes']:>17,.0f} "
        f"{_ratio(reference, row):>14} {_ratio(hierarchical, row):>12} "
        f"{row['final_train_loss']:>10.4f} "
        f"{100 * (row['final_train_loss'] / reference['final_train_loss'] - 1):>+7.1f}% "
        f"{row['held_out_loss']:>9.4f} "
        f"{100 * (row['held_out_loss'] / reference['held_out_loss'] - 1):>+9.1f}% "
        f"{row['median_step_ms']:>8.2f}")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.hosts * args.local != args.simulated_devices:
    print(f"error: --hosts * --local ({args.hosts * args.local}) must equal "
          f"--simulated-devices ({args.simulated_devices})", file=sys.stderr)
    return 2
  _configure_devices(args.simulated_devices)
  import jax

  import jaxcomm
  from models.data import teacher_classification
  mesh = jaxcomm.make_mesh(hosts=args.hosts, local=args.local)
  samples = args.batch * mesh.size * args.steps
  data = teacher_classification(args.seed, samples, args.features, args.classes)
  held_out = teacher_classification(args.seed, samples + 4096, args.features, args.classes)
  held_out = jax.tree.map(lambda a: a[samples:], held_out)
  print(f"mesh_scan: {args.hosts} hosts x {args.local} local devices "
        f"({jax.devices()[0].platform}), MLP {args.features}-{'-'.join(map(str, args.hidden))}-"
        f"{args.classes}, {args.steps} steps of {args.batch} examples per device, AdamW lr {args.lr}")
  rows = []
  for method in args.methods:
    started = time.perf_counter()
    rows.append(run_method(method, args, mesh, data, held_out))
    print(f"  {method}: done in {time.perf_counter() - started:.1f} s", flush=True)
  print()
  print(format_table(rows))
  if "topk-ef" in args.methods:
    row = next(r for r in rows if r["method"] == "topk-ef")
    formula = topk_formula_bytes(row["params"], args.topk_fraction, args.hosts, args.local)
    measured = row["inter_host_bytes"]
    print(f"\ntopk-ef inter-host bytes per device per step: measured {measured:,.0f}, "
          f"formula (H-1)*8*sum(k) = {formula:,} ({100 * (measured / formula - 1):+.2f}%)")
  if args.json:
    with open(args.json, "w") as handle:
      json.dump([{k: v for k, v in r.items() if k != "params"} for r in rows], handle, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
