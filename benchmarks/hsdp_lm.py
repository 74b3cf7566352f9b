"""hsdp_lm: the byte-level GPT (models/gpt.py) trained replicated and with HSDP, same seeds.

Default: both runs use ``jaxcomm.data_parallel`` on a ``--hosts x --local`` simulated mesh with
``compressed_allreduce(topk(--density))`` (error feedback) + AdamW and the same batches; the
HSDP run adds ``shard_over='local'``. Prints the training loss every ``--log-every`` steps and
the held-out loss (pydoc topics held out by topic) of both, and their largest parameter
difference.

``--methods a,b,...`` (names of :data:`benchmarks.scan.methods.REGISTRY`) instead trains the
mesh scan's GPT task (``--size``, the scan's batches and held-out windows) once per method as
the scan runs it (:func:`benchmarks.scan.run.run`: replicated parameters, or for the
device-local methods one model per device) and once with ``shard_over='local'`` (for the
periodic methods one model per *host*, docs/hsdp.md section 4), and prints one table row per
method: both held-out losses and HSDP minus replicated, or why HSDP refused the method.
``--seed`` sets the task (initial parameters, batches) and the methods' seeds;
``--compressor-seeds 0,1,2`` keeps the task and prints one row per method seed;
``--ulp-control`` adds the replicated run from parameters moved one ulp (a rounding-size
perturbation of the same algorithm, to compare HSDP's difference with); ``--bytes`` adds each
run's inter-host bytes per device and step (compiled HLO, as the scan reports them).

Run: ``python -m benchmarks.hsdp_lm`` (CPU), or
``python -m benchmarks.hsdp_lm --methods fp32-hier,topk-ef,diloco-h8 --size quick --steps 150``.
"""

from __future__ import annotations

import argparse
import os


def _one_pair(args) -> None:
  """The default mode: top-k + EF + AdamW replicated and under HSDP, with the loss curves."""
  import jax
  import jax.numpy as jnp
  import optax
  import jaxcomm
  from models import gpt, text
  corpus = text.load_pydoc_corpus()
  graphdef, params = gpt.init_gpt(gpt.SIZES[args.size], seed=0)
  loss_fn = gpt.lm_loss(graphdef)
  context = gpt.CONTEXT[args.size]
  held = tuple(jnp.asarray(a) for a in text.sample_sequences(corpus.held_out, 256, context, 1))
  mesh = jaxcomm.make_mesh(hosts=args.hosts, local=args.local)
  print(f"GPT {args.size} ({sum(p.size for p in jax.tree.leaves(params))} parameters), "
        f"{args.hosts}x{args.local} mesh, topk({args.density})+EF + AdamW({args.lr}), "
        f"batch {args.batch}, {args.steps} steps")
  trained = {}
  for mode, shard_over in (("replicated", None), ("hsdp", "local")):
    tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(args.density)),
                     optax.adamw(args.lr))
    trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over=shard_over)
    state = trainer.init(params)
    for step in range(args.steps):
      batch = tuple(jnp.asarray(a) for a in text.sample_sequences(
          corpus.train, args.batch, context, seed=100 + step))
      state, loss = trainer.step(state, batch)
      if (step + 1) % args.log_every == 0:
        print(f"{mode} step {step + 1}: train loss {float(loss):.4f}", flush=True)
    trained[mode] = trainer.model(state)
    print(f"{mode}: held-out loss {float(loss_fn(trained[mode], held)):.4f} nats/byte",
          flush=True)
  gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(trained["replicated"]), jax.tree.leaves(trained["hsdp"])))
  print(f"largest |replicated - hsdp| parameter difference: {gap:.2e}")


def _hsdp_held_out(task, method, setting, mesh, steps: int) -> tuple[float, float]:
  """``(held-out loss, inter-host bytes per device and step)`` of ``method`` trained ``steps``
  steps with ``shard_over='local'``; the bytes from the step's compiled HLO."""
  import jax
  import jaxcomm
  trainer = jaxcomm.data_parallel(task.loss_fn, method.build(setting), mesh, shard_over="local")
  state = trainer.init(task.params)
  hlo = trainer.step.lower(state, task.batch(0)).compile().as_text()
  inter_host = jaxcomm.accounting.report_from_hlo(hlo, mesh).link_bytes(("host", "local"))["host"]
  for index in range(steps):
    state, _ = trainer.step(state, task.batch(index))
  return float(jax.jit(task.loss_fn)(trainer.model(state), task.held_out)), inter_host


def _per_method(args) -> None:
  """One row per method: held-out loss replicated (as the scan runs it) and under HSDP."""
  import jax
  import jax.numpy as jnp
  import jaxcomm
  from benchmarks.scan import methods as registry
  from benchmarks.scan.run import run
  from benchmarks.scan.tasks import BATCH, TASKS
  names = [name for name in args.methods.split(",") if name]
  unknown = [name for name in names if name not in registry.REGISTRY]
  if unknown:
    raise SystemExit(f"--methods: unknown {unknown}; known: {sorted(registry.REGISTRY)}")
  devices = args.hosts * args.local
  mesh = jaxcomm.make_mesh(hosts=args.hosts, local=args.local)
  task = TASKS["gpt"](args.size, BATCH["gpt"] * devices, args.steps, args.seed)
  seeds = ([int(seed) for seed in args.compressor_seeds.split(",")] if args.compressor_seeds
           else [args.seed])
  print(f"{task.description}; {args.hosts}x{args.local} mesh, global batch "
        f"{BATCH['gpt'] * devices}, {args.steps} steps, seed {args.seed}; held-out loss "
        "(nats/byte)")
  nudged = task._replace(params=jax.tree.map(lambda p: jnp.nextafter(p, -jnp.inf), task.params))
  control = " replicated from params - 1 ulp |" if args.ulp_control else ""
  control += " inter-host B/step replicated | HSDP |" if args.bytes else ""
  print("| method | replicated | HSDP | HSDP - replicated |" + control)
  print("|---|---|---|---|" + "---|" * control.count("|"))
  for name, seed in [(name, seed) for name in names for seed in seeds]:
    method = registry.REGISTRY[name]
    setting = registry.Setting(lr=task.lr, seed=seed, topk_density=args.topk_density,
                               sketch_density=args.sketch_density, hosts=args.hosts,
                               local=args.local, params=task.params, steps=args.steps)
    label = name if not args.compressor_seeds else f"{name} (compressor seed {seed})"
    result = run(task, method, mesh, setting, args.steps, 1)
    replicated = result["held_out_loss"]
    try:
      sharded, sharded_bytes = _hsdp_held_out(task, method, setting, mesh, args.steps)
    except ValueError as error:
      print(f"| {label} | {replicated:.4f} | refused: {str(error).splitlines()[0][:160]} | |",
            flush=True)
      continue
    cell = (f" {run(nudged, method, mesh, setting, args.steps, 1)['held_out_loss']:.4f} |"
            if args.ulp_control else "")
    cell += (f" {result['inter_host_bytes']:,.0f} | {sharded_bytes:,.0f} |" if args.bytes
             else "")
    print(f"| {label} | {replicated:.4f} | {sharded:.4f} | {sharded - replicated:+.4f} |{cell}",
          flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hosts", type=int, default=2)
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--size", default="default", choices=("quick", "default"))
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--density", type=float, default=0.1)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--log-every", type=int, default=25)
  parser.add_argument("--methods", default="",
                      help="comma-separated mesh-scan method names: per-method mode")
  parser.add_argument("--seed", type=int, default=0,
                      help="per-method mode: the task's seed (initial parameters, batches), "
                      "also the methods' seed unless --compressor-seeds")
  parser.add_argument("--compressor-seeds", default="",
                      help="per-method mode: comma-separated seeds of the methods (hashes, "
                      "PowerSGD's Q, random-k), one row each, on the same task")
  parser.add_argument("--topk-density", type=float, default=0.01,
                      help="per-method mode: as mesh_scan's")
  parser.add_argument("--sketch-density", type=float, default=0.02,
                      help="per-method mode: as mesh_scan's")
  parser.add_argument("--ulp-control", action="store_true",
                      help="per-method mode: also the replicated run from every initial "
                      "parameter moved one ulp down (rounding-size perturbation)")
  parser.add_argument("--bytes", action="store_true",
                      help="per-method mode: also each run's inter-host bytes per device and "
                      "step (compiled HLO)")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", args.hosts * args.local)
  if args.methods:
    _per_method(args)
  else:
    _one_pair(args)


if __name__ == "__main__":
  main()
