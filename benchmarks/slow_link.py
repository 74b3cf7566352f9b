"""slow_link: real wall-clock step time of compressed vs fp32 data parallelism over a slow link.

Two measurements, both with two real JAX processes (gloo) started by :func:`jaxcomm.launch.launch`:

1. Collectives over loopback: psum, all_gather, ppermute and all_to_all of a ``--payload-mb``
   payload per device (float32 and int8) between the two processes: which collective is cheap on
   this backend.
2. Slow link: each process in its own network namespace, joined by a veth pair whose both ends
   are rate-limited with ``tc tbf`` (one run per ``--rates`` entry). A hosts file per namespace
   makes gloo bind the veth address, so every inter-process byte crosses the limited link. Each
   process trains the mesh_scan MLP with each method; the table gives the median step time and
   the time the inter-host bytes alone take at the link rate.

The slow-link part needs root, ``ip`` and ``tc``; without them it is skipped with a message. The
namespaces, veth pair and hosts files it creates are removed at the end, whatever happens.
Run ``python -m benchmarks.slow_link --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from benchmarks.common import median_seconds

NAMESPACES = ("jaxcomm_host0", "jaxcomm_host1")
VETH = ("jaxcomm_veth0", "jaxcomm_veth1")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
PORT = 29517
COLLECTIVES = ("psum", "all_gather", "ppermute", "all_to_all")
METHODS = ("fp32", "fp32-hier", "sign-ef", "topk-ef", "int8")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.slow_link", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--rates", default="1gbit,100mbit",
                      help="comma-separated tc rates of the emulated link, e.g. 1gbit,100mbit")
  parser.add_argument("--local-devices", type=int, default=2,
                      help="simulated CPU devices per process in the training runs")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="mesh_scan methods to time, from: " + ", ".join(METHODS))
  parser.add_argument("--hidden", default="1024,1024",
                      help="hidden widths of the MLP (its size sets the bytes per step)")
  parser.add_argument("--steps", type=int, default=12, help="training steps per method")
  parser.add_argument("--timed-steps", type=int, default=8,
                      help="last steps whose median time is reported")
  parser.add_argument("--payload-mb", type=float, default=16.0,
                      help="payload per device of the collectives measurement, in MB")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed calls per collective (median reported)")
  parser.add_argument("--skip-collectives", action="store_true",
                      help="skip the loopback collectives measurement")
  parser.add_argument("--skip-slow-link", action="store_true",
                      help="skip the network-namespace measurement")
  parser.add_argument("--worker", choices=("collectives", "train"), default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = [m for m in args.methods if m not in METHODS]
  if unknown:
    parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
  for name in ("local_devices", "steps", "timed_steps", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.timed_steps >= args.steps:
    parser.error(f"--timed-steps ({args.timed_steps}) must be below --steps ({args.steps})")
  if args.payload_mb <= 0:
    parser.error(f"--payload-mb must be > 0, got {args.payload_mb}")
  return args


def collectives_worker(args) -> list[dict]:
  """Times each collective over the ``host`` axis (one device per process)."""
  import functools

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcomm
  mesh = jaxcomm.make_mesh()
  hosts = mesh.shape["host"]
  spec = P(("host", "local"))
  ops = {
      "psum": lambda x: jax.lax.psum(x.astype(jnp.int32) if x.dtype == jnp.int8 else x, "host"),
      "all_gather": lambda x: jax.lax.all_gather(x, "host", tiled=True),
      "ppermute": lambda x: jax.lax.ppermute(x, "host", [(i, (i + 1) % hosts)
                                                         for i in range(hosts)]),
      "all_to_all": lambda x: jax.lax.all_to_all(x, "host", 0, 0, tiled=True),
  }
  rows = []
  for dtype in (jnp.float32, jnp.int8):
    count = int(args.payload_mb * 2**20) // jnp.dtype(dtype).itemsize
    payload = jax.jit(functools.partial(jnp.ones, (mesh.size * count,), dtype),
                      out_shardings=NamedSharding(mesh, spec))()
    for name in COLLECTIVES:
      run = jax.jit(jax.shard_map(ops[name], mesh=mesh, in_specs=spec, out_specs=spec))
      seconds = median_seconds(lambda run=run: run(payload), args.repeats)
      rows.append({"collective": name, "dtype": jnp.dtype(dtype).name, "ms": 1e3 * seconds,
                   "note": "int8 widened to int32 for the sum" if name == "psum"
                           and dtype == jnp.int8 else ""})
  return rows


def train_worker(args) -> list[dict]:
  """Trains the mesh_scan MLP with each method on the launched ``(processes, local)`` mesh."""
  import jaxcomm
  from benchmarks.scan.methods import REGISTRY, Setting
  from benchmarks.scan.run import run
  from benchmarks.scan.tasks import BATCH, TASKS
  mesh = jaxcomm.make_mesh()
  hidden = tuple(int(width) for width in args.hidden.split(","))
  task = TASKS["mlp"]("default", BATCH["mlp"] * mesh.size, args.steps, 0, hidden)
  setting = Setting(lr=task.lr, seed=0, topk_fraction=0.01, sketch_fraction=0.01,
                    hosts=mesh.shape["host"], local=mesh.shape["local"], params=task.params)
  rows = []
  for method in args.methods:
    row = run(task, REGISTRY[method], mesh, setting, args.steps, args.timed_steps)
    rows.append({"method": method, "inter_host_bytes": row["inter_host_bytes"],
                 "median_step_ms": 1e3 * row["median_step_s"]})
  return rows


def _worker_main(args) -> int:
  from jaxcomm import distributed
  if not distributed.initialize_from_env():
    sys.exit("--worker runs only under python -m jaxcomm.launch")
  import jax
  rows = collectives_worker(args) if args.worker == "collectives" else train_worker(args)
  if jax.process_index() == 0:
    with open(args.out, "w") as handle:
      json.dump(rows, handle)
  return 0


def _launch_worker(kind: str, args, out: str, local_devices: int, **launch_kwargs) -> list[dict]:
  from jaxcomm.launch import launch
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  command = [sys.executable, "-m", "benchmarks.slow_link", "--worker", kind, "--out", out,
             "--methods", ",".join(args.methods), "--hidden", args.hidden, "--steps",
             str(args.steps), "--timed-steps", str(args.timed_steps), "--payload-mb",
             str(args.payload_mb), "--repeats", str(args.repeats)]
  status = launch(command, 2, local_devices=local_devices, env=env, **launch_kwargs)
  if status:
    raise RuntimeError(f"the {kind} job failed with status {status}")
  with open(out) as handle:
    return json.load(handle)


def _sh(*command: str) -> None:
  subprocess.run(command, check=True, capture_output=True, text=True)


def _remove_link() -> None:
  for namespace in NAMESPACES:
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


def _create_link(rate: str) -> None:
  """Two namespaces joined by a veth pair, each end limited to ``rate`` by a tbf qdisc."""
  hostname = socket.gethostname()
  # A small bucket (4 ms of traffic, at least 16 KiB), so a step's bytes cannot pass as a burst.
  burst = max(16384, int(_rate_bytes_per_second(rate) / 250))
  for namespace in NAMESPACES:
    _sh("ip", "netns", "add", namespace)
  _sh("ip", "link", "add", VETH[0], "netns", NAMESPACES[0], "type", "veth", "peer", "name",
      VETH[1], "netns", NAMESPACES[1])
  for namespace, device, address in zip(NAMESPACES, VETH, ADDRESSES):
    run = ("ip", "netns", "exec", namespace)
    _sh(*run, "ip", "addr", "add", f"{address}/24", "dev", device)
    _sh(*run, "ip", "link", "set", device, "up")
    _sh(*run, "ip", "link", "set", "lo", "up")
    _sh(*run, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst",
        str(burst), "latency", "100ms")
    os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
    with open(f"/etc/netns/{namespace}/hosts", "w") as hosts:  # gloo binds this address
      hosts.write(f"127.0.0.1 localhost\n{address} {hostname}\n")


def slow_link_unavailable() -> str | None:
  """Why the slow-link emulation cannot run here, or None."""
  if os.geteuid() != 0:
    return "needs root (network namespaces)"
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    return f"needs iproute2 ({', '.join(missing)} not found)"
  return None


def _rate_bytes_per_second(rate: str) -> float:
  units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}
  for unit, factor in units.items():
    if rate.lower().endswith(unit):
      return float(rate[:-len(unit)]) * factor
  raise ValueError(f"rate must end with one of {', '.join(units)}, got {rate!r}")


def format_collectives(rows: list[dict], payload_mb: float) -> str:
  lines = [f"{'collective':<12} {'dtype':<8} {'ms':>9}   ({payload_mb:g} MB per device, "
           f"2 processes, gloo over loopback)"]
  lines += [f"{r['collective']:<12} {r['dtype']:<8} {r['ms']:>9.1f}   {r['note']}" for r in rows]
  return "\n".join(lines)


def format_slow_link(results: dict[str, list[dict]], local_devices: int) -> str:
  """One row per method; per emulated link, measured and modeled median step ms.

  Modeled = the loopback run's measured step (compute and everything but the slow link) plus
  the cost model's bandwidth term for the inter-host bytes: the ``local_devices`` devices of a
  process share one veth link, so ``local_devices * bytes / rate`` (one direction).
  """
  links = list(results)
  header = f"{'method':<10} {'inter-host B/dev':>16} {'loopback ms':>12} " + " ".join(
      f"{link + ' measured':>18} {'modeled':>8}" for link in links if link != "loopback")
  lines = [header, "-" * len(header)]
  methods = [row["method"] for row in results[links[0]]]
  for index, method in enumerate(methods):
    inter_host = results[links[0]][index]["inter_host_bytes"]
    base = results["loopback"][index]["median_step_ms"]
    cells = []
    for link in links:
      if link == "loopback":
        continue
      modeled = base + 1e3 * local_devices * inter_host / _rate_bytes_per_second(link)
      cells.append(f"{results[link][index]['median_step_ms']:>18.1f} {modeled:>8.1f}")
    lines.append(f"{method:<10} {inter_host:>16,.0f} {base:>12.1f} " + " ".join(cells))
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.worker:
    return _worker_main(args)
  for rate in args.rates:
    _rate_bytes_per_second(rate)
  with tempfile.TemporaryDirectory() as scratch:
    out = os.path.join(scratch, "rows.json")
    if not args.skip_collectives:
      rows = _launch_worker("collectives", args, out, local_devices=1)
      print(format_collectives(rows, args.payload_mb), flush=True)
    if args.skip_slow_link:
      return 0
    reason = slow_link_unavailable()
    if reason:
      print(f"\nslow-link emulation skipped: {reason}")
      return 0
    results = {"loopback": _launch_worker("train", args, out, args.local_devices)}
    for rate in args.rates:
      _remove_link()
      try:
        _create_link(rate)
        results[rate] = _launch_worker(
            "train", args, out, args.local_devices, coordinator_host=ADDRESSES[0], port=PORT,
            wrap=lambda process_id: ["ip", "netns", "exec", NAMESPACES[process_id]])
      finally:
        _remove_link()
      print(f"  {rate}: done", flush=True)
  print(f"\nMedian step ms, MLP {args.hidden}, 2 processes x {args.local_devices} devices; "
        f"modeled = loopback ms + {args.local_devices} devices x inter-host bytes / rate")
  print(format_slow_link(results, args.local_devices))
  return 0


if __name__ == "__main__":
  sys.exit(main())
