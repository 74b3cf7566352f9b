"""Benchmark: MoE dispatch bytes (flat, hierarchical, dedup, int8) and the MoE LM trained.

Part 1 compiles one MoE layer's forward pass on every mesh of ``--meshes`` for flat,
hierarchical and deduplicated hierarchical dispatch, fp32 and int8, and reads the bytes each
device sends per axis from the optimized HLO (``jaxcomm.accounting``), next to the layer's
formula (``forward_bytes``); for dedup it also measures, on random tokens routed by the
initial router, how many kept slots each row that crosses hosts carries on average (the
saving a transport of variable-size messages would get; static XLA buffers get the
formula's). Part 2 trains the MoE transformer LM (``models.moe_lm``: the GPT
task's default model, ``models.gpt.SIZES['default']``, with its MLPs replaced by 8 experts)
on the GPT task's data (``pydoc_data`` topics, random training windows, every whole held-out
window for evaluation) with hierarchical dispatch in fp32 and in int8 from the same seed, and
prints the training loss, the held-out loss and the dropped-assignment fraction, next to the
dense GPT (the same model with one MLP per block) trained on one device with the same
optimizer and batches; ``--json`` and ``--plot`` write them.

The devices are simulated CPU devices of one process (``jax_num_cpu_devices``) on a shared
machine: wall times are not reported, only bytes and losses.

Usage::

  python -m benchmarks.moe                                  # bytes + 300 steps, ~15 min
  python -m benchmarks.moe --steps 0                        # bytes only, seconds
  python -m benchmarks.moe --json docs/moe_results.json --plot docs/img/moe_loss.png
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm._src.parallel import moe_layer, route  # noqa: E402
from models import gpt, text  # noqa: E402
from models.moe_lm import MoETransformerLM, make_train_step  # noqa: E402

#: The GPT task's default model with each MLP replaced by 8 experts of the same width.
CONFIG = gpt.SIZES["default"]
MOE = dict(num_experts=8, d_model=CONFIG.d_model, hidden=CONFIG.mlp_dim, top_k=2,
           capacity_factor=1.25)


def _parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split(
      "\n")[0])
  parser.add_argument("--meshes", nargs="+", default=["2x4", "4x2"],
                      help="hosts x local meshes for the bytes table")
  parser.add_argument("--tokens", type=int, default=256, help="tokens per device (bytes)")
  parser.add_argument("--top-k", type=int, default=MOE["top_k"], help="k for the bytes table")
  parser.add_argument("--capacity-factor", type=float, default=MOE["capacity_factor"],
                      help="capacity factor for the bytes table")
  parser.add_argument("--steps", type=int, default=300, help="training steps per run (0: none)")
  parser.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
  parser.add_argument("--context", type=int, default=gpt.CONTEXT["default"],
                      help="tokens per sequence")
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--runs", nargs="+", default=["fp32", "int8", "dense"],
                      choices=["fp32", "int8", "dense"],
                      help="MoE LM with fp32 / int8 dispatch; dense: the GPT without experts")
  parser.add_argument("--json", help="write the results here")
  parser.add_argument("--plot", help="write the loss curves (PNG) here")
  return parser.parse_args(argv)


MODES = {"flat": dict(), "hierarchical": dict(hierarchical=True),
         "dedup": dict(hierarchical=True, dedup=True)}


def dispatch_bytes(hosts: int, local: int, tokens: int, **routing) -> list[dict]:
  """Forward bytes per device per axis of one MoE layer, from the HLO and the formula."""
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  config = {**MOE, **routing}
  rows = []
  for mode, options in MODES.items():
    for dispatch_dtype in (None, "int8"):
      layer = moe_layer(mesh, dispatch_dtype=dispatch_dtype, **options, **config)
      spec = P(tuple(mesh.axis_names))
      forward = jax.jit(jax.shard_map(lambda p, x, layer=layer: layer.apply(p, x)[0], mesh=mesh,
                                      in_specs=(layer.param_specs, spec), out_specs=spec))
      x = jax.ShapeDtypeStruct((mesh.devices.size * tokens, MOE["d_model"]), jnp.float32)
      report = jaxcomm.accounting.measure(forward, layer.init(jax.random.key(0)), x, mesh=mesh)
      formula = {"+".join(axes): b for axes, b in layer.forward_bytes(tokens).items()}
      slow = [op for op in report.collectives if "host" in op.axes]
      rows.append(dict(mesh=f"{hosts}x{local}", mode=mode, dispatch=dispatch_dtype or "fp32",
                       top_k=config["top_k"], capacity_factor=config["capacity_factor"],
                       link_bytes=report.link_bytes(),
                       hlo_bytes={"+".join(k): v for k, v in report.bytes_per_axes().items()},
                       formula_bytes=formula,
                       off_host_messages=sum(op.group_size * (hosts - 1) // hosts
                                             for op in slow)))
  return rows


def slots_per_row(hosts: int, tokens: int, **routing) -> float:
  """Kept slots on other hosts per (token, destination host) pair that crosses: on random
  tokens routed by the initial router, one group of ``tokens`` per device."""
  config = {**MOE, **routing}
  layer = moe_layer(jaxcomm.make_mesh(hosts=hosts, local=8 // hosts), **config)
  params = layer.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (8, tokens, config["d_model"]))
  dispatch = jax.vmap(lambda g: route(g, params.router, top_k=config["top_k"],
                                      capacity_factor=config["capacity_factor"]).dispatch)(x)
  per_host = dispatch.reshape(8, tokens, hosts, config["num_experts"] // hosts, -1)
  source = jnp.arange(8) // (8 // hosts)
  remote = (jnp.arange(hosts)[None, :] != source[:, None])[:, None, :]     # (8, 1, H)
  slots = jnp.sum(per_host, (3, 4)) * remote
  return float(jnp.sum(slots) / jnp.sum(slots > 0))


def _held_out(corpus, args) -> list:
  """The held-out windows in training-sized batches (the same for all runs): routing groups,
  and so capacity, are as in training, and the one-hot dispatch stays small."""
  tokens, targets = text.tile_sequences(corpus.held_out, args.context)
  batches = len(tokens) // args.batch
  return [(tokens[i * args.batch:(i + 1) * args.batch],
           targets[i * args.batch:(i + 1) * args.batch]) for i in range(batches)]


def _mean_loss(evaluate, params, batches) -> float:
  return float(np.mean([float(evaluate(params, batch)) for batch in batches]))


def train(dispatch_dtype, args, corpus) -> dict:
  """Trains the MoE LM on the 2x4 mesh with hierarchical dispatch; returns its curves."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  layer = moe_layer(mesh, hierarchical=True, dispatch_dtype=dispatch_dtype, **MOE)
  model = MoETransformerLM(CONFIG, layer, rngs=nnx.Rngs(args.seed))
  step = make_train_step(model, layer, mesh, optax.adam(args.learning_rate))
  params, opt_state = step.init(model)
  held_out = _held_out(corpus, args)
  curves = dict(step=[], loss=[], dropped=[], eval_step=[], held_out=[])
  for index in range(args.steps + 1):
    if index % args.eval_every == 0 or index == args.steps:
      curves["eval_step"].append(index)
      curves["held_out"].append(_mean_loss(step.evaluate, params, held_out))
    if index == args.steps:
      break
    batch = text.sample_sequences(corpus.train, args.batch, args.context,
                                  seed=args.seed * 100_000 + index)
    params, opt_state, (loss, dropped) = step.update(params, opt_state, batch)
    jax.block_until_ready(loss)
    curves["step"].append(index)
    curves["loss"].append(float(loss))
    curves["dropped"].append(float(dropped))
  return curves


def train_dense_gpt(args, corpus) -> dict:
  """The GPT task's dense model (``models.gpt``, same sizes, one MLP per block) on one device,
  same optimizer, batches and held-out set: the baseline the MoE LM replaces MLPs in."""
  graphdef, params = gpt.init_gpt(CONFIG, seed=args.seed)
  loss_fn = gpt.lm_loss(graphdef)
  tx = optax.adam(args.learning_rate)
  opt_state = tx.init(params)

  @jax.jit
  def update(params, opt_state, batch):
    loss, grad = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  held_out = _held_out(corpus, args)
  evaluate = jax.jit(loss_fn)
  curves = dict(step=[], loss=[], eval_step=[], held_out=[])
  for index in range(args.steps + 1):
    if index % args.eval_every == 0 or index == args.steps:
      curves["eval_step"].append(index)
      curves["held_out"].append(_mean_loss(evaluate, params, held_out))
    if index == args.steps:
      break
    batch = text.sample_sequences(corpus.train, args.batch, args.context,
                                  seed=args.seed * 100_000 + index)
    params, opt_state, loss = update(params, opt_state, batch)
    curves["step"].append(index)
    curves["loss"].append(float(loss))
  return curves


def _plot(runs: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(1, 2, figsize=(11, 4))
  for index, (name, curves) in enumerate(runs.items()):
    color = f"C{index}"
    smooth = np.convolve(curves["loss"], np.ones(10) / 10, mode="valid")
    axes[0].plot(np.arange(len(smooth)) + 9, smooth, color=color, alpha=0.6,
                 label=f"{name}: train (10-step mean)")
    axes[0].plot(curves["eval_step"], curves["held_out"], "o--", color=color,
                 label=f"{name}: held-out")
    if "dropped" in curves:
      axes[1].plot(curves["step"], curves["dropped"], color=color, label=name)
  axes[0].set(xlabel="step", ylabel="next-byte loss (nats)", ylim=(1.0, 3.5),
              title="MoE LM (2x4, hierarchical) vs dense GPT")
  axes[1].set(xlabel="step", ylabel="fraction of (token, choice) dropped",
              title="capacity drops (capacity factor 1.25)")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def main(argv=None) -> None:
  args = _parse(argv)
  results = dict(config=vars(args), moe=MOE, bytes=[])
  for shape in args.meshes:
    hosts, local = map(int, shape.split("x"))
    routing = dict(top_k=args.top_k, capacity_factor=args.capacity_factor)
    for row in dispatch_bytes(hosts, local, args.tokens, **routing):
      results["bytes"].append(row)
      print(json.dumps(row))
    results.setdefault("slots_per_row", {})[shape] = slots_per_row(hosts, args.tokens, **routing)
    print(f"{shape}: kept off-host slots per crossing (token, host) row "
          f"{results['slots_per_row'][shape]:.3f}")
  if args.steps:
    corpus = text.load_pydoc_corpus()
    results["runs"] = {}
    for name in args.runs:
      curves = (train_dense_gpt(args, corpus) if name == "dense" else
                train(None if name == "fp32" else name, args, corpus))
      results["runs"][name] = curves
      print(f"{name}: final train loss (last 10 mean) {np.mean(curves['loss'][-10:]):.4f}, "
            f"held-out {curves['held_out']}, dropped "
            f"{np.mean(curves.get('dropped', [0])[-10:]):.3f}")
    if args.plot:
      _plot(results["runs"], args.plot)
  if args.json:
    with open(args.json, "w") as handle:
      json.dump(results, handle, indent=1)


if __name__ == "__main__":
  main()
