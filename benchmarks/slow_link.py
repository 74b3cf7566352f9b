"""slow_link: real wall-clock step time of compressed vs fp32 data parallelism over a slow link.

Two measurements, both with two real JAX processes (gloo) started by :func:`jaxcomm.launch.launch`:

1. Collectives over loopback: psum, all_gather, ppermute and all_to_all of a ``--payload-mb``
   payload per device (float32 and int8) between the two processes: which collective is cheap on
   this backend.
2. Slow link, as a user would train: each process in its own network namespace, joined by a
   veth pair; a hosts file per namespace makes gloo bind the veth address, so every
   inter-process byte crosses it. Each process trains the mesh_scan MLP (``--hidden``) with
   Adam through the public API (:func:`jaxcomm.optim.data_parallel_step`) with each method, once per
   ``--local-devices`` entry. For every method the same compiled step, in the same two
   processes, is timed in rounds of phases: the link without a limit (``compute``: the step
   with the veth at memory speed) and then each ``--rates`` entry, set on both veth ends with a
   ``tc tbf`` qdisc between phases. The table gives the median step time of each phase, the
   inter-host bytes (read from the compiled HLO by :mod:`jaxcomm.accounting`) over the link
   rate, and the ratio ``measured / (compute + bytes / rate)``: 1.0 is a step that costs its
   compute plus its bytes at the link rate, below 1.0 communication overlapped computation.

The slow-link part needs root, ``ip`` and ``tc``; without them it is skipped with a message. The
namespaces, veth pair and hosts files it creates are removed at the end, whatever happens
(also on SIGTERM/SIGINT); traffic flows only between the two veth addresses. Every worker
process exits after ``--timeout`` seconds. Run ``python -m benchmarks.slow_link --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from benchmarks.common import median_seconds

NAMESPACES = ("jaxcomm_host0", "jaxcomm_host1")
VETH = ("jaxcomm_veth0", "jaxcomm_veth1")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
PORT = 29517
COLLECTIVES = ("psum", "all_gather", "ppermute", "all_to_all")
METHODS = ("fp32", "fp32-hier", "int8", "sign-ef", "topk-ef", "powersgd-r4", "demo",
           "sparseloco-h8")
UNLIMITED = "none"
_RATE_POLL_SECONDS = 0.02


def _known_methods() -> tuple[str, ...]:
  """The :data:`METHODS` that mesh_scan's registry has (DeMo / SparseLoCo may be absent)."""
  from benchmarks.scan.methods import REGISTRY
  return tuple(m for m in METHODS if m in REGISTRY)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.slow_link", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--rates", default="1gbit,100mbit",
                      help="comma-separated tc rates of the emulated link, e.g. 1gbit,100mbit")
  parser.add_argument("--local-devices", default="1,2",
                      help="comma-separated CPU devices per process; one training job each")
  parser.add_argument("--methods", default=None,
                      help="mesh_scan methods to time (default: those of " + ", ".join(METHODS)
                      + " that mesh_scan registers)")
  parser.add_argument("--hidden", default="1536,1536,1536",
                      help="hidden widths of the MLP (4,836,874 parameters, 19.3 MB of float32 "
                      "gradients by default)")
  parser.add_argument("--steps", type=int, default=4,
                      help="timed steps per phase and round (one more runs untimed after "
                      "each rate change)")
  parser.add_argument("--rounds", type=int, default=2,
                      help="rounds of (no limit, each rate) phases per method")
  parser.add_argument("--timeout", type=float, default=1800.0,
                      help="seconds after which every training job is stopped")
  parser.add_argument("--payload-mb", type=float, default=16.0,
                      help="payload per device of the collectives measurement, in MB")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed calls per collective (median reported)")
  parser.add_argument("--skip-collectives", action="store_true",
                      help="skip the loopback collectives measurement")
  parser.add_argument("--skip-slow-link", action="store_true",
                      help="skip the network-namespace measurement")
  parser.add_argument("--json", default=None, help="also write the slow-link rows to this file")
  parser.add_argument("--worker", choices=("collectives", "train"), default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--control", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
  known = _known_methods()
  args.methods = ([m.strip() for m in args.methods.split(",") if m.strip()]
                  if args.methods else list(known))
  unknown = [m for m in args.methods if m not in known]
  if unknown:
    parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(known)}")
  try:
    args.local_devices = [int(n) for n in args.local_devices.split(",") if n.strip()]
  except ValueError:
    parser.error(f"--local-devices must be comma-separated ints, got {args.local_devices!r}")
  if not args.local_devices or min(args.local_devices) < 1:
    parser.error(f"--local-devices must be >= 1, got {args.local_devices}")
  for name in ("steps", "rounds", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.payload_mb <= 0:
    parser.error(f"--payload-mb must be > 0, got {args.payload_mb}")
  if args.timeout <= 0:
    parser.error(f"--timeout must be > 0, got {args.timeout}")
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


class RateControl:
  """Process 0's side of the rate handshake: it asks the launcher for a link rate and waits.

  The request is ``<seq> <rate>`` in ``<control>/request``; the launcher sets the qdisc and
  writes ``<seq>`` to ``<control>/done``. The other process needs no handshake: its next
  collective waits for process 0.
  """

  def __init__(self, control: str | None, active: bool):
    self.control, self.active, self.seq = control, active and control is not None, 0

  def set(self, rate: str, timeout: float = 60.0) -> None:
    if not self.active:
      return
    self.seq += 1
    scratch = os.path.join(self.control, "request.tmp")
    with open(scratch, "w") as handle:
      handle.write(f"{self.seq} {rate}")
    os.replace(scratch, os.path.join(self.control, "request"))
    deadline = time.monotonic() + timeout
    done = os.path.join(self.control, "done")
    while time.monotonic() < deadline:
      if os.path.exists(done) and open(done).read().strip() == str(self.seq):
        return
      time.sleep(_RATE_POLL_SECONDS)
    raise TimeoutError(f"the launcher did not set the link rate {rate!r} in {timeout:.0f} s")


def _timed_steps(step, state, batch_at, first: int, count: int) -> tuple[list[float], tuple]:
  """Runs ``count + 1`` steps from ``state = (params, opt_state)``, the first (after a rate
  change) untimed; returns the seconds of the others and the new state."""
  import jax
  times = []
  for index in range(count + 1):
    batch = batch_at(first + index)
    started = time.perf_counter()
    params, opt_state, loss = step(*state, batch)
    jax.block_until_ready((params, opt_state, loss))
    state = (params, opt_state)
    if index:
      times.append(time.perf_counter() - started)
  return times, state


def train_method(task, method, mesh, setting, args, control: RateControl) -> dict:
  """Compiles one method's step, reads its bytes, and times it in every phase and round.

  A periodic method (``comm_every > 1``: SparseLoCo, local SGD) communicates across hosts on
  one step in ``comm_every``: each phase then times whole periods and reports the mean step
  (its bytes are per step, the conditional's weighted by ``1 / comm_every``); every other
  method reports the median step.
  """
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  import jaxcomm
  from benchmarks.scan.run import _branch_weights
  axes = PartitionSpec(tuple(mesh.axis_names))
  tx = method.build(setting)
  if method.device_local:
    params = jaxcomm.optim.to_device_local(task.params, mesh)
    opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, axes)
  else:
    params = jax.device_put(task.params, NamedSharding(mesh, PartitionSpec()))
    opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  sharding = NamedSharding(mesh, axes)
  batch_at = lambda index: jax.device_put(task.batch(index % 64), sharding)  # noqa: E731
  compiled = method.make_step(task.loss_fn, tx, mesh, specs).lower(
      params, opt_state, batch_at(0)).compile()
  report = jaxcomm.accounting.report_from_hlo(compiled.as_text(), mesh)
  weights = _branch_weights(method, setting, report, opt_state)
  link = report.link_bytes(("host", "local"), weights)
  period = method.comm_every
  steps = -(-args.steps // period) * period
  state, times, index = (params, opt_state), {}, 0
  control.set(UNLIMITED)
  _, state = _timed_steps(compiled, state, batch_at, index, period)  # warm-up
  for _ in range(args.rounds):
    for phase in [UNLIMITED] + args.rates:
      control.set(phase)
      index += steps + 1
      seconds, state = _timed_steps(compiled, state, batch_at, index, steps)
      times.setdefault(phase, []).extend(seconds)
  control.set(UNLIMITED)
  statistic = np.mean if period > 1 else np.median
  return {"method": method.name, "inter_host_bytes": link["host"],
          "intra_host_bytes": link["local"],
          "wire_bytes": process_link_bytes(report, mesh.shape["local"], weights),
          "statistic": statistic.__name__,
          "step_ms": {phase: 1e3 * float(statistic(t)) for phase, t in times.items()}}


def train_worker(args) -> list[dict]:
  """Trains the mesh_scan MLP with each method on the launched ``(processes, local)`` mesh."""
  import jax

  import jaxcomm
  from benchmarks.scan.methods import REGISTRY, Setting
  from benchmarks.scan.tasks import BATCH, TASKS
  mesh = jaxcomm.make_mesh()
  hidden = tuple(int(width) for width in args.hidden.split(","))
  task = TASKS["mlp"]("default", BATCH["mlp"] * mesh.size, 64, 0, hidden)
  setting = Setting(lr=task.lr, seed=0, topk_density=0.01, sketch_density=0.01,
                    hosts=mesh.shape["host"], local=mesh.shape["local"], params=task.params)
  control = RateControl(args.control, jax.process_index() == 0)
  rows = []
  for name in args.methods:
    row = train_method(task, REGISTRY[name], mesh, setting, args, control)
    row.update(local=mesh.shape["local"], params=sum(p.size for p in jax.tree.leaves(
        task.params)), model=task.description)
    print(f"{name}: {json.dumps(row['step_ms'])}", flush=True)
    rows.append(row)
  return rows


def _watchdog(seconds: float) -> None:
  """Ends this process after ``seconds`` whatever it is doing (a hung collective included)."""
  def expire():
    print(f"slow_link worker: --timeout {seconds:.0f} s reached, exiting", flush=True)
    os._exit(124)
  timer = threading.Timer(seconds, expire)
  timer.daemon = True
  timer.start()


def _worker_main(args) -> int:
  from jaxcomm import distributed
  if not distributed.initialize_from_env():
    sys.exit("--worker runs only under python -m jaxcomm.launch")
  _watchdog(args.timeout)
  import jax
  rows = collectives_worker(args) if args.worker == "collectives" else train_worker(args)
  if jax.process_index() == 0:
    with open(args.out, "w") as handle:
      json.dump(rows, handle)
  return 0


def _launch_worker(kind: str, args, out: str, local_devices: int, control: str | None = None,
                   **launch_kwargs) -> list[dict]:
  from jaxcomm.launch import launch
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  command = [sys.executable, "-m", "benchmarks.slow_link", "--worker", kind, "--out", out,
             "--methods", ",".join(args.methods), "--hidden", args.hidden, "--steps",
             str(args.steps), "--rounds", str(args.rounds), "--rates", ",".join(args.rates),
             "--timeout", str(args.timeout), "--payload-mb", str(args.payload_mb),
             "--repeats", str(args.repeats)] + (["--control", control] if control else [])
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


@contextlib.contextmanager
def emulated_link():
  """Two namespaces joined by a veth pair, without a rate limit yet (:func:`set_rate`), for
  the ``with`` block; removed at its end, whatever happens (leftovers of an earlier run
  first)."""
  _remove_link()
  try:
    _create_link()
    yield
  finally:
    _remove_link()


def _create_link() -> None:
  """The namespaces, veth pair and hosts files of :func:`emulated_link`."""
  hostname = socket.gethostname()
  for namespace in NAMESPACES:
    _sh("ip", "netns", "add", namespace)
  _sh("ip", "link", "add", VETH[0], "netns", NAMESPACES[0], "type", "veth", "peer", "name",
      VETH[1], "netns", NAMESPACES[1])
  for namespace, device, address in zip(NAMESPACES, VETH, ADDRESSES):
    run = ("ip", "netns", "exec", namespace)
    _sh(*run, "ip", "addr", "add", f"{address}/24", "dev", device)
    _sh(*run, "ip", "link", "set", device, "up")
    _sh(*run, "ip", "link", "set", "lo", "up")
    os.makedirs(f"/etc/netns/{namespace}", exist_ok=True)
    with open(f"/etc/netns/{namespace}/hosts", "w") as hosts:  # gloo binds this address
      hosts.write(f"127.0.0.1 localhost\n{address} {hostname}\n")


def set_rate(rate: str) -> None:
  """Limits both veth ends to ``rate`` with a tbf qdisc, or removes the limit (``'none'``)."""
  for namespace, device in zip(NAMESPACES, VETH):
    run = ("ip", "netns", "exec", namespace, "tc", "qdisc")
    if rate == UNLIMITED:
      subprocess.run([*run, "del", "dev", device, "root"], capture_output=True)
      continue
    # A small bucket (4 ms of traffic, at least 16 KiB), so a step's bytes cannot pass as a burst.
    burst = max(16384, int(_rate_bytes_per_second(rate) / 250))
    _sh(*run, "replace", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst),
        "latency", "100ms")


def _serve_rates(control: str, stop: threading.Event) -> None:
  """Applies the rate requests of :class:`RateControl` until ``stop`` is set."""
  request, done, served = os.path.join(control, "request"), os.path.join(control, "done"), None
  while not stop.is_set():
    if os.path.exists(request):
      seq, rate = open(request).read().split()
      if seq != served:
        set_rate(rate)
        with open(done + ".tmp", "w") as handle:
          handle.write(seq)
        os.replace(done + ".tmp", done)
        served = seq
    time.sleep(_RATE_POLL_SECONDS)


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


def process_link_bytes(report, local: int, branch_weights=None) -> float:
  """Bytes one process sends over its link per step (each direction carries as much).

  A collective over the ``host`` axis alone runs in ``local`` independent groups, one per
  local device, each crossing the link: ``local`` times its bytes per device. One that spans
  ``host`` and ``local`` (the flat psum) is a ring over all devices, host-major, whose only
  edge from one process to the other carries its bytes per device once. ``branch_weights``
  weighs conditional collectives as :meth:`~jaxcomm.accounting.CommReport.link_bytes` does.
  """
  return sum(weight * (1 if len(op.axes) > 1 else local) * op.bytes_per_device
             for op, weight in zip(report.collectives, report.weights(branch_weights))
             if "host" in op.axes)


def link_ms(row: dict, rate: str) -> float:
  """Milliseconds the process's link bytes of one step take at ``rate``."""
  return 1e3 * row["wire_bytes"] / _rate_bytes_per_second(rate)


def slow_link_rows(rows: list[dict], rates: Sequence[str]) -> list[dict]:
  """One flat row per (method, local devices, rate) with the derived figures.

  ``ratio = measured / (compute + link)``; ``speedup`` is fp32's measured step over this one at
  the same rate and local device count (absent without an fp32 row).
  """
  flat = []
  for row in rows:
    fp32 = next((r for r in rows if r["method"] == "fp32" and r["local"] == row["local"]), None)
    compute = row["step_ms"][UNLIMITED]
    for rate in rates:
      measured, link = row["step_ms"][rate], link_ms(row, rate)
      flat.append({"method": row["method"], "local": row["local"], "rate": rate,
                   "inter_host_bytes": row["inter_host_bytes"],
                   "wire_bytes": row["wire_bytes"], "compute_ms": compute,
                   "link_ms": link, "measured_ms": measured,
                   "ratio": measured / (compute + link),
                   "speedup": fp32["step_ms"][rate] / measured if fp32 else None})
  return flat


def format_slow_link(flat: list[dict]) -> str:
  header = (f"| {'method':<12} | local | rate | inter-host B/dev | link B/process | compute ms "
            "| bytes/rate ms | measured ms | ratio | vs fp32 |")
  lines = [header, "| --- " * 10 + "|"]
  for r in flat:
    speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    lines.append(f"| {r['method']:<12} | {r['local']} | {r['rate']} | "
                 f"{r['inter_host_bytes']:,.0f} | {r['wire_bytes']:,.0f} | {r['compute_ms']:.1f} | "
                 f"{r['link_ms']:.1f} | "
                 f"{r['measured_ms']:.1f} | {r['ratio']:.2f} | {speedup} |")
  return "\n".join(lines)


def _run_slow_link(args, scratch: str) -> list[dict]:
  """Every ``--local-devices`` job in the namespaces, the link rate served meanwhile."""
  control = os.path.join(scratch, "control")
  os.makedirs(control)
  rows = []
  with emulated_link():
    for local in args.local_devices:
      stop = threading.Event()
      server = threading.Thread(target=_serve_rates, args=(control, stop), daemon=True)
      server.start()
      try:
        rows += _launch_worker(
            "train", args, os.path.join(scratch, f"train{local}.json"), local, control,
            coordinator_host=ADDRESSES[0], port=PORT,
            wrap=lambda process_id: ["ip", "netns", "exec", NAMESPACES[process_id]])
      finally:
        stop.set()
        server.join()
      print(f"  {local} device(s) per process: done", flush=True)
  return rows


def _exit_on_signal(signum, frame):
  raise SystemExit(128 + signum)  # runs the finally blocks: the namespaces are removed


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.worker:
    return _worker_main(args)
  for rate in args.rates:
    _rate_bytes_per_second(rate)
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _exit_on_signal)
  with tempfile.TemporaryDirectory() as scratch:
    if not args.skip_collectives:
      rows = _launch_worker("collectives", args, os.path.join(scratch, "c.json"), 1)
      print(format_collectives(rows, args.payload_mb), flush=True)
    if args.skip_slow_link:
      return 0
    reason = slow_link_unavailable()
    if reason:
      print(f"\nslow-link emulation skipped: {reason}")
      return 0
    rows = _run_slow_link(args, scratch)
  flat = slow_link_rows(rows, args.rates)
  print(f"\n{rows[0]['model']}, AdamW, 2 processes; step ms: median over {args.rounds} rounds "
        f"x {args.steps} steps per phase (mean over whole periods for periodic methods); "
        "compute = the same step with no link limit; ratio = measured / (compute + link "
        "bytes per process / rate)")
  print(format_slow_link(flat))
  if args.json:
    with open(args.json, "w") as handle:
      json.dump({"rows": rows, "flat": flat}, handle, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
