"""mesh_scan: which mesh, compressor and algorithm reach fp32's quality with the fewest bytes
and the least time, measured on simulated devices and modeled on real links.

For every model x mesh (hosts x local) x method it trains the same model on the same data and
measures the bytes each device sends per step over the inter-host and intra-host links (from
the compiled HLO), the median step time, the loss curve, the final training and held-out
loss and the steps needed to reach fp32's final loss; then it models the step time on
NVLink + InfiniBand HDR / 100 GbE / 10 GbE / 1 GbE clusters (measured compute + alpha-beta
communication), and projects the gradient allreduce of a 7B transformer on 8 x 8 GPUs. It
prints tables and writes JSON, CSV and PNG plots under ``--out``.

Run ``python -m benchmarks.mesh_scan --help`` for the flags, ``--quick`` for a short scan,
``--profile full`` for every method (about twice the default's runs), ``--profile lm`` for
the full-length language-model quality table (every method of :data:`LM_METHODS` on the GPT
of :mod:`models.gpt`, 2x4 mesh, 1,000 steps, seeds 0 and 1; docs/results.md has its 300-step
form), ``--profile lm-large`` for the targets' recipes (:data:`LM_LARGE_METHODS`) on the
GPT's 2.4M-parameter size, 2,000 steps, seeds 0 and 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

from benchmarks.scan.methods import REGISTRY
from benchmarks.scan.tasks import BATCH, TASKS


class Scan(NamedTuple):
  """One block of the plan: the cross product of ``models x meshes x methods``."""
  models: tuple[str, ...]
  meshes: tuple[str, ...]
  methods: tuple[str, ...]
  steps: int | None = None  # None: the profile's steps


class Profile(NamedTuple):
  """Sizes, lengths and the plan of one profile."""
  size: str
  steps: int
  timed_steps: int
  plan: tuple[Scan, ...]
  seeds: tuple[int, ...] = (0,)


ALL_METHODS = tuple(REGISTRY)
#: Steps of the default profile's shortened quality table (the ``lm`` profile runs 1,000).
GPT_DEFAULT_STEPS = 100
#: The language-model quality table: the references, the per-step compressors (top-k with the
#: default strategy too) and the optimizers that communicate less often.
LM_METHODS = ("fp32", "fp32-hier", "int8", "sign-ef", "topk-ef", "topk-ef-default",
              "powersgd-r1", "powersgd-r4", "onebit-adam", "sign-ef-updates", "demo", "diloco-h8",
              "sparseloco-h8", "streaming-diloco-h8-q4", "streaming-diloco-h8-q2",
              "sparseloco-h1-b16", "sparseloco-h16")
#: The methods of ``--profile lm-large``: the references and the recipe for each of issue 12's
#: targets (per step and with local steps) on the 2.4M-parameter GPT.
LM_LARGE_METHODS = ("fp32", "fp32-hier", "sparseloco-h1-b16", "sparseloco-h16")
#: Its shortened form in the default and full profiles.
LM_DEFAULT_METHODS = ("fp32", "fp32-hier", "topk-ef", "demo", "sparseloco-h8")
#: The default profile's methods on the char LM: the references, one of each compressor family
#: and strategy, and the main low-communication optimizers (``--profile full`` runs every
#: method). Each run costs about 7 s on 2 CPU cores, most of it compilation, so the profile
#: keeps 35 runs to finish the README's main job in well under 6 minutes.
DEFAULT_METHODS = ("fp32", "fp32-hier", "identity", "bf16", "int8", "qsgd", "terngrad", "sign-ef",
                   "topk-ef", "topk-ef-2p", "randomk-ef", "sketch", "powersgd-r1", "powersgd-r4",
                   "dgc", "onebit-adam", "zero-one-adam", "local-sgd-h8", "diloco-h8",
                   "gossip-ring", "accumulate-k4", "demo", "sparseloco-h8",
                   "streaming-diloco-h8-q4")
PROFILES = {
    "quick": Profile("quick", 60, 20, (
        Scan(("charlm",), ("2x4",), ("fp32", "fp32-hier", "identity", "int8", "sign-ef",
                                     "topk-ef", "powersgd-r1")),
        Scan(("charlm",), ("4x2",), ("fp32", "topk-ef", "topk-ef-2p")),
    )),
    # The char LM at 2x4 with DEFAULT_METHODS; 4x2 and 8x1 shorter, for the strategies' bytes
    # and step times; the ResNet shorter still; the GPT quality table shortened to
    # GPT_DEFAULT_STEPS steps, one seed.
    "default": Profile("default", 300, 50, (
        Scan(("charlm",), ("2x4",), DEFAULT_METHODS),
        Scan(("charlm",), ("4x2", "8x1"), ("fp32", "topk-ef", "topk-ef-2p"), steps=60),
        Scan(("resnet",), ("2x4",), ("fp32", "powersgd-r4"), steps=30),
        Scan(("gpt",), ("2x4",), ("fp32", "topk-ef", "sparseloco-h8"), steps=GPT_DEFAULT_STEPS),
    )),
    # Every method on the char LM at 2x4; the other meshes and the ResNet shorter, for bytes
    # and step times (one host has no inter-host traffic to compress: fp32 and fp32-hier);
    # the GPT block with LM_DEFAULT_METHODS.
    "full": Profile("default", 300, 50, (
        Scan(("charlm",), ("2x4",), ALL_METHODS),
        Scan(("charlm",), ("1x8",), ("fp32", "fp32-hier"), steps=60),
        Scan(("charlm",), ("4x2", "8x1"), ("fp32", "fp32-hier", "int8", "topk-ef", "topk-ef-2p"),
             steps=60),
        Scan(("resnet",), ("2x4",), ("fp32", "topk-ef", "powersgd-r4"), steps=30),
        Scan(("gpt",), ("2x4",), LM_DEFAULT_METHODS, steps=GPT_DEFAULT_STEPS),
    )),
    # The quality table: the GPT on pydoc's English text, long enough that fp32 is well past
    # its initial drop, two seeds (same tokens for every method of a seed).
    "lm": Profile("default", 1000, 100, (Scan(("gpt",), ("2x4",), LM_METHODS),), seeds=(0, 1)),
    # The targets' recipes on the GPT's large size (models.gpt.SIZES["large"], 2.4M parameters,
    # about 20 times the default's compute per step, AdamW 1e-3: models.gpt.LR), 2,000 steps,
    # two seeds.
    "lm-large": Profile("large", 2000, 100, (Scan(("gpt",), ("2x4",), LM_LARGE_METHODS),),
                        seeds=(0, 1)),
}


class _Parser(argparse.ArgumentParser):
  """Bad input is one line on stderr and exit code 2, without the usage block."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n")


def _names(text: str, known: Sequence[str], what: str, parser) -> tuple[str, ...]:
  names = tuple(name.strip() for name in text.split(",") if name.strip())
  if not names:
    parser.error(f"--{what}s is empty; choose from {', '.join(known)}")
  for name in names:
    if name not in known:
      parser.error(f"unknown {what} {name!r}; choose from {', '.join(known)}")
  return names


def parse_mesh(text: str) -> tuple[int, int]:
  """``'2x4'`` -> ``(2, 4)``: hosts x local devices, both >= 1."""
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
    raise ValueError(f"mesh {text!r} is not HOSTSxLOCAL with positive integers, e.g. 2x4")
  return int(parts[0]), int(parts[1])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = _Parser(
      prog="python -m benchmarks.mesh_scan", description=__doc__.split("\n\n")[0],
      epilog="Methods: " + "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY.values()),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--profile", choices=tuple(PROFILES), default="default",
                      help="the plan: quick (small models, 60 steps, a few methods), default "
                      f"({len(DEFAULT_METHODS)} methods on the char LM, other meshes and models "
                      f"shorter, a {GPT_DEFAULT_STEPS}-step GPT quality table), full (every "
                      "method on the char LM, more meshes and methods elsewhere), lm (the GPT "
                      "quality table, 1000 steps, seeds 0,1), lm-large (the targets' recipes on "
                      "the 2.4M-parameter GPT, 2000 steps, seeds 0,1)")
  parser.add_argument("--quick", action="store_true", help="same as --profile quick")
  parser.add_argument("--models", default=None,
                      help=f"comma-separated models, from {', '.join(TASKS)}; any of --models, "
                      "--meshes, --methods replaces the profile's plan by their cross product "
                      "(defaults: charlm, 2x4, every method)")
  parser.add_argument("--task", default=None, metavar="MODULE:FUNCTION",
                      help="scan your own model instead of --models: FUNCTION(global_batch=, "
                      "seed=) returns a dict of loss_fn, params, batch, held_out (optional lr, "
                      "description); see benchmarks/scan/custom_task.py and "
                      "benchmarks/examples/my_task.py (default --batch 8)")
  parser.add_argument("--meshes", default=None, help="comma-separated HOSTSxLOCAL meshes whose "
                      "product is the device count, e.g. 1x8,2x4,4x2,8x1")
  parser.add_argument("--methods", default=None,
                      help="comma-separated methods, from: " + ", ".join(REGISTRY))
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per run (default: the profile's)")
  parser.add_argument("--timed-steps", type=int, default=None,
                      help="last steps whose median time is the step time and whose mean loss "
                      "is the final training loss (default: the profile's)")
  parser.add_argument("--batch", type=int, default=None,
                      help="examples per device per step (default: " + ", ".join(
                          f"{k} {v}" for k, v in BATCH.items()) + ")")
  parser.add_argument("--hidden", default=None,
                      help="comma-separated hidden widths of the MLP and the char LM")
  parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate "
                      "(default: the model's: charlm 3e-3, mlp and resnet 1e-3)")
  parser.add_argument("--topk-density", "--topk-fraction", type=float, default=0.01,
                      help="fraction of each shard that top-k and random-k send")
  parser.add_argument("--sketch-density", "--sketch-fraction", type=float, default=0.02,
                      help="count-sketch cells as a fraction of the shard's elements")
  parser.add_argument("--projection-model", default="llama-7b",
                      help="transformer whose gradients are projected on 8 hosts x 8 GPUs")
  parser.add_argument("--cluster", default=None,
                      help="your cluster, for the recommendation: hosts=H,local=G,intra=LINK,"
                      "inter=LINK[,compute_ms=MS], LINK a jaxcomm.links preset (nvlink4, pcie5, "
                      "ib-hdr, 100gbe, 10gbe, 1gbe) or BANDWIDTH:LATENCY in bytes/s:s, e.g. "
                      "inter=25e9:5e-6 (default: hosts=8,local=8,intra=nvlink4,inter=100gbe)")
  parser.add_argument("--margin", type=float, default=1.0,
                      help="largest held-out loss gap to fp32, in percent, a recommended method "
                      "may have")
  parser.add_argument("--seeds", "--seed", default=None,
                      help="comma-separated seeds for data and initialization; every run is "
                      "repeated per seed and the quality table averages over them (default: "
                      "the profile's: lm and lm-large 0,1, the others 0)")
  parser.add_argument("--simulated-devices", type=int, default=8,
                      help="CPU devices to simulate (ignored in a launched multi-process job)")
  parser.add_argument("--out", default="mesh_scan_out", help="directory for JSON, CSV and PNGs")
  parser.add_argument("--resume", action="store_true",
                      help="skip the runs an earlier, interrupted or finished scan with the same "
                      "--out and settings saved under OUT/partial/ (every run is saved as it "
                      "finishes)")
  parser.add_argument("--include", action="append", default=[], metavar="RESULTS_JSON",
                      help="results.json of an earlier run with the same steps, batch, widths, "
                      "learning rate and fractions (repeatable): its runs of (model, mesh, "
                      "method, seed) not run now (nor in an earlier --include) join the quality "
                      "table and the Pareto plot: a table grows by new methods without "
                      "rerunning the others")
  args = parser.parse_args(argv)
  profile = PROFILES["quick" if args.quick else args.profile]
  args.size = profile.size
  args.steps_override = args.steps
  args.steps = args.steps or profile.steps
  args.timed_steps = args.timed_steps or profile.timed_steps
  if args.task is not None:
    if args.models is not None:
      parser.error("--task and --models exclude each other")
    from benchmarks.scan import custom_task
    try:
      custom_task.resolve(args.task)
      args.task_name = args.task.partition(":")[0].rsplit(".", 1)[-1]
    except ValueError as error:
      parser.error(str(error))
    args.plan = (Scan((args.task_name,), tuple(args.meshes.split(",")) if args.meshes
                      else ("2x4",), _names(args.methods, ALL_METHODS, "method", parser)
                      if args.methods else ALL_METHODS),)
  elif any(v is not None for v in (args.models, args.meshes, args.methods)):
    args.plan = (Scan(_names(args.models or "charlm", tuple(TASKS), "model", parser),
                      tuple(args.meshes.split(",")) if args.meshes else ("2x4",),
                      _names(args.methods, ALL_METHODS, "method", parser)
                      if args.methods else ALL_METHODS),)
  else:
    args.plan = profile.plan
  for scan in args.plan:
    for mesh in scan.meshes:
      try:
        parse_mesh(mesh)
      except ValueError as error:
        parser.error(str(error))
  if args.hidden is not None:
    try:
      args.hidden = tuple(int(w) for w in args.hidden.split(",") if w)
    except ValueError:
      parser.error(f"--hidden must be comma-separated integers, got {args.hidden!r}")
  try:
    args.seeds = (tuple(dict.fromkeys(int(s) for s in args.seeds.split(",") if s.strip()))
                  if args.seeds is not None else profile.seeds)
  except ValueError:
    parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
  if not args.seeds or min(args.seeds) < 0:
    parser.error(f"--seeds must name at least one seed >= 0, got {args.seeds!r}")
  for name in ("steps", "timed_steps", "batch", "simulated_devices"):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  if args.timed_steps >= args.steps:
    parser.error(f"--timed-steps ({args.timed_steps}) must be below --steps ({args.steps})")
  for name in ("topk_density", "sketch_density"):
    if not 0 < getattr(args, name) <= 1:
      parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(args, name)}")
  from benchmarks.scan import cluster
  try:
    args.cluster_spec = cluster.parse(args.cluster or cluster.DEFAULT)
  except ValueError as error:
    parser.error(str(error))
  if not args.margin >= 0:
    parser.error(f"--margin must be a percentage >= 0, got {args.margin}")
  from jaxcomm.costmodel import TRANSFORMERS
  if args.projection_model not in TRANSFORMERS:
    parser.error(f"unknown projection model {args.projection_model!r}; choose from "
                 f"{', '.join(TRANSFORMERS)}")
  return args


def _configure_devices(count: int) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from jaxcomm import distributed
  if distributed.initialize_from_env():  # started by python -m jaxcomm.launch: one host each
    return
  jax.config.update("jax_num_cpu_devices", count)


def _prepare_out(out: str) -> str | None:
  """Creates ``out`` and checks that a file can be written there; returns an error or None."""
  try:
    os.makedirs(out, exist_ok=True)
    probe = os.path.join(out, f".mesh_scan_write_test.{os.getpid()}")  # processes share out
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as error:
    return f"--out {out!r} is not writable: {error.strerror or error}"
  return None


#: What an ``--include``d run must share with this one for its losses to be comparable.
COMPARABLE = ("size", "steps", "batch", "hidden", "lr", "topk_density", "sketch_density")


def read_included(path: str, args: argparse.Namespace) -> list[dict]:
  """The successful runs of the earlier ``results.json`` at ``path``.

  Raises:
    ValueError: unreadable, or run with other :data:`COMPARABLE` settings than ``args``.
  """
  import json
  try:
    with open(path) as handle:
      results = json.load(handle)
  except (OSError, ValueError) as error:
    raise ValueError(f"--include {path!r} is not a readable results.json: {error}") from None
  earlier = results["meta"]["args"]
  differ = [f"{name} {earlier.get(name)!r} != {getattr(args, name)!r}" for name in COMPARABLE
            if earlier.get(name) != (list(args.hidden) if name == "hidden" and args.hidden
                                     else getattr(args, name))]
  if differ:
    raise ValueError(f"--include {path!r} was run with other settings: {'; '.join(differ)}")
  return [row for row in results["runs"] if "error" not in row]


def _fail(message: str) -> int:
  print(f"python -m benchmarks.mesh_scan: error: {message}", file=sys.stderr)
  return 2


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  meshes = {mesh for scan in args.plan for mesh in scan.meshes}
  for mesh in sorted(meshes):
    hosts, local = parse_mesh(mesh)
    if hosts * local != args.simulated_devices:
      return _fail(f"mesh {mesh} has {hosts * local} devices; it must use all "
                   f"{args.simulated_devices} (--simulated-devices)")
  try:
    args.included = [row for path in args.include for row in read_included(path, args)]
  except ValueError as error:
    return _fail(str(error))
  problem = _prepare_out(args.out)
  if problem:
    return _fail(problem)
  _configure_devices(args.simulated_devices)
  import jax
  if jax.device_count() != args.simulated_devices:
    return _fail(f"this job has {jax.device_count()} devices; pass meshes using all of them "
                 f"and --simulated-devices {jax.device_count()}")
  from benchmarks.scan import driver
  if args.task is not None:
    problem = driver.preload_task(args)
    if problem:
      return _fail(problem)
  started = time.perf_counter()
  status = driver.scan(args)
  print(f"mesh_scan: finished in {time.perf_counter() - started:.0f} s", flush=True)
  return status


if __name__ == "__main__":
  sys.exit(main())
