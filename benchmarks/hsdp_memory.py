"""hsdp_memory: per-device memory of replicated vs sharded (HSDP) data parallelism.

For each mesh ``H x G`` with ``H * G`` devices (default 8: 8x1, 4x2, 2x4, 1x8) it builds
``jaxcomm.data_parallel`` on an MLP of ``--layers`` square ``--width`` layers with
``compressed_allreduce(sign())`` + AdamW, replicated and with ``shard_over='local'``, and
reports per device:

* the state it holds, from the arrays' own shards: parameters, AdamW moments, error-feedback
  state (residuals, and EF21's mean estimates where the compressor's feedback is
  ``'estimate'``) (bytes one device stores);
* the compiled step's ``memory_analysis()``: argument bytes (the state and the batch),
  output bytes (the new state), temp bytes (XLA's scratch: gathered parameters,
  activations, gradients), alias bytes (outputs written into donated arguments: 0 unless
  ``--donate``, ``data_parallel(..., donate=True)``), and
  ``peak = argument + output + temp - alias``, what the step needs live at once.

and the bytes each device sends per step and axis, read from the compiled HLO by
:mod:`jaxcomm.accounting`, next to the fast-axis formula ``2 (G-1)/G * 4 sum_leaves
G ceil(d/G)`` (replicated: gradient reduce-scatter + mean all-gather; HSDP: parameter
all-gather + gradient reduce-scatter).

``--reshard`` adds a third mode, ``hsdp+reshard``: ``shard_over='local'`` with
``reshard_after_forward=True`` (each leaf gathered where an operation reads it and gathered
again for its backward pass; docs/hsdp.md, "Reshard after forward"), whose fast-axis formula
is not printed (it depends on which leaves the backward pass reads).

``--model gpt`` measures the byte-level GPT of ``models/gpt.py`` instead (``--layers``
blocks of ``--width``, 32-byte windows, tied embedding).

``--device-budget-mib B`` instead compiles ``replicated`` and ``hsdp+reshard`` on one mesh
(``H x G``, ``G`` the single value of ``--groups``, default 4) and prints each peak against
``B`` MiB, the simulated device's share of memory (what one accelerator of a host would
have; the simulated CPU devices share the host's RAM and enforce no limit, so the budget is
checked against the compiled peak; both steps donate their state, as a training loop does).
``--train-steps N`` then runs ``N`` steps of every mode
whose peak fits, on random windows of the pydoc training text (``models.text``, as
``benchmarks.hsdp_lm``; ``--model gpt`` only), printing the loss per step; a mode over the
budget is refused (:func:`train_within`).

Run: ``python -m benchmarks.hsdp_memory`` (CPU, simulated devices; compile only, no step), or
``python -m benchmarks.hsdp_memory --model gpt --device-budget-mib 64 --train-steps 5``.
"""

from __future__ import annotations

import argparse
import os


def _device_bytes(tree) -> int:
  """Bytes device 0 holds of ``tree``'s global arrays."""
  import jax
  total = 0
  for leaf in jax.tree.leaves(tree):
    total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device.id == 0)
  return total


def _mlp(layers: int, width: int, batch_size: int):
  """``(params, loss_fn, batch)`` of an MLP of ``layers`` square ``width`` layers."""
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.key(0), layers)
  params = [{"w": jax.random.normal(k, (width, width)) / width ** 0.5, "b": jnp.zeros(width)}
            for k in keys]

  def loss_fn(params, batch):
    x = batch
    for layer in params:
      x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean(x ** 2)

  return params, loss_fn, jnp.ones((batch_size, width))


def _gpt(layers: int, width: int, batch_size: int):
  """``(params, loss_fn, batch)`` of the byte-level GPT (models/gpt.py) with ``layers``
  blocks of ``width`` (4 heads, MLP ``4 width``, tied embedding) on 32-byte windows."""
  import jax.numpy as jnp
  from models import gpt
  from models.text import VOCAB
  from models.transformer import TransformerConfig
  config = TransformerConfig(vocab_size=VOCAB, d_model=width, num_heads=4, num_kv_heads=4,
                             num_layers=layers, mlp_dim=4 * width)
  graphdef, params = gpt.init_gpt(config, seed=0)
  tokens = jnp.zeros((batch_size, 32), jnp.int32)
  return params, gpt.lm_loss(graphdef), (tokens, tokens)


MODELS = {"mlp": _mlp, "gpt": _gpt}


def compile_step(mesh, model: str, layers: int, width: int, batch_size: int, shard_over,
                 reshard: bool = False, donate: bool = False):
  """``(params, state, compiled)``: ``model``'s sign+EF + AdamW step on ``mesh``, compiled
  for a batch of ``batch_size``; ``compiled(state, batch)`` returns ``(state, loss)``. With
  ``donate`` the state's buffers are donated to the new state
  (``jaxcomm.data_parallel(..., donate=True)``; ``memory_analysis()`` then counts them as
  aliased)."""
  import optax
  import jaxcomm
  params, loss_fn, batch = MODELS[model](layers, width, batch_size)
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.sign()), optax.adamw(1e-3))
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over=shard_over,
                                  reshard_after_forward=reshard, donate=donate)
  state = trainer.init(params)
  return params, state, trainer.step.lower(state, batch).compile()


def peak_bytes(compiled) -> int:
  """``argument + output + temp - alias`` bytes of ``compiled.memory_analysis()`` (per
  device): what the step needs live at once."""
  stats = compiled.memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def train_within(compiled, state, batches, budget_bytes: int) -> list[float]:
  """Runs ``compiled`` on each of ``batches`` from ``state`` if its peak fits the budget.

  Args:
    compiled: a step from :func:`compile_step`.
    state: its initial state.
    batches: batches of the shape it was compiled for.
    budget_bytes: the simulated device's share of memory, bytes.

  Returns:
    The loss of each step.

  Raises:
    ValueError: if :func:`peak_bytes` of ``compiled`` exceeds ``budget_bytes`` (the step
      would not fit the device, so it is not run).
  """
  peak = peak_bytes(compiled)
  if peak > budget_bytes:
    raise ValueError(f"the step's peak, {peak / 2**20:.1f} MiB per device, exceeds "
                     f"budget_bytes={budget_bytes} ({budget_bytes / 2**20:.1f} MiB): not run")
  losses = []
  for batch in batches:
    state, loss = compiled(state, batch)
    losses.append(float(loss))  # waits for the step (simulated devices: docs/reliability.md)
  return losses


def _measure(mesh, model: str, layers: int, width: int, batch_size: int, shard_over,
             reshard: bool = False, donate: bool = False):
  import jax
  import jaxcomm
  params, state, compiled = compile_step(mesh, model, layers, width, batch_size, shard_over,
                                         reshard, donate)
  stats = compiled.memory_analysis()
  sent = jaxcomm.accounting.report_from_hlo(compiled.as_text(), mesh).bytes_per_axes()
  group = mesh.shape["local"]
  fast = sum(2 * (group - 1) / group * 4 * -(-leaf.size // group) * group
             for leaf in jax.tree.leaves(params))
  return {"fast": sent.get(("local",), 0.0), "slow": sent.get(("host",), 0.0),
          "both": sent.get(("host", "local"), 0.0), "fast_formula": fast,
          "params": _device_bytes(state.params),
          "moments": _device_bytes(state.opt_state[1]),
          "residuals": _device_bytes((state.opt_state[0].level_states,
                                      state.opt_state[0].estimates)),
          "argument": stats.argument_size_in_bytes, "temp": stats.temp_size_in_bytes,
          "output": stats.output_size_in_bytes, "alias": stats.alias_size_in_bytes}


def _budget(args, group: int) -> None:
  """``--device-budget-mib``: both peaks on ``H x group`` against the budget, then
  ``--train-steps``."""
  import jax.numpy as jnp
  import jaxcomm
  from models import text
  mesh = jaxcomm.make_mesh(hosts=args.devices // group, local=group)
  budget = int(args.device_budget_mib * 2**20)
  print(f"{args.devices // group} x {group} mesh, device budget {args.device_budget_mib} MiB "
        "(the simulated device's share of memory)")
  print("| mode | state (MiB) | peak (MiB) | peak / budget | fits |\n|---|---|---|---|---|")
  steps = {}
  for mode, shard_over, reshard in (("replicated", None, False),
                                    ("hsdp+reshard", "local", True)):
    _, state, compiled = compile_step(mesh, args.model, args.layers, args.width, args.batch,
                                      shard_over, reshard, donate=True)
    peak = peak_bytes(compiled)
    held = _device_bytes((state.params, state.opt_state))
    print(f"| {mode} | {held / 2**20:.1f} | {peak / 2**20:.1f} | {peak / budget:.2f} | "
          f"{'yes' if peak <= budget else 'no'} |", flush=True)
    steps[mode] = (state, compiled)
  if not args.train_steps:
    return
  corpus = text.load_pydoc_corpus()
  for mode, (state, compiled) in steps.items():
    batches = (tuple(jnp.asarray(a) for a in text.sample_sequences(
        corpus.train, args.batch, 32, seed=100 + step)) for step in range(args.train_steps))
    try:
      losses = train_within(compiled, state, batches, budget)
    except ValueError as refused:
      print(f"{mode}: refused to train: {refused}")
      continue
    print(f"{mode}: training loss per step (nats/byte): "
          + ", ".join(f"{loss:.4f}" for loss in losses))


def _check_budget_args(parser, args) -> None:
  """Exits with a usage error for a budget option that cannot be honoured."""
  budget = args.device_budget_mib
  if budget is not None and budget <= 0:
    parser.error(f"--device-budget-mib={budget}: must be positive")
  if args.train_steps < 0 or (args.train_steps and (budget is None or args.model != "gpt")):
    parser.error(f"--train-steps={args.train_steps}: a count >= 0, and > 0 only with "
                 "--device-budget-mib and --model gpt (the LM data)")
  if budget is not None and args.groups and not args.groups.isdigit():
    parser.error(f"--groups={args.groups!r}: one fast-axis size with --device-budget-mib")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--batch", type=int, default=64, help="global batch size")
  parser.add_argument("--reshard", action="store_true",
                      help="also measure shard_over='local' with reshard_after_forward=True")
  parser.add_argument("--donate", action="store_true",
                      help="the steps donate their state (data_parallel(..., donate=True))")
  parser.add_argument("--groups", default="",
                      help="comma-separated fast-axis sizes G to measure (default: all)")
  parser.add_argument("--device-budget-mib", type=float, default=None,
                      help="the simulated device's share of memory (MiB): compile replicated "
                      "and hsdp+reshard on one mesh (G: --groups, default 4) and compare "
                      "their peaks with it")
  parser.add_argument("--train-steps", type=int, default=0,
                      help="with --device-budget-mib and --model gpt: train this many steps "
                      "of every mode whose peak fits")
  args = parser.parse_args()
  _check_budget_args(parser, args)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import jaxcomm
  shape = (f"MLP {args.layers} x ({args.width}x{args.width} + bias)" if args.model == "mlp"
           else f"GPT {args.layers} blocks of width {args.width}, 32-byte windows")
  if args.device_budget_mib is not None:
    print(f"{shape}, fp32, sign+EF + AdamW, global batch {args.batch}")
    _budget(args, int(args.groups or 4))
    return
  donated = ", state donated" if args.donate else ""
  print(f"{shape}, fp32, sign+EF + AdamW, global batch {args.batch}{donated}; KiB per device")
  print("| H x G | mode | params | AdamW moments | EF state | state | argument | output "
        "| temp | alias | peak |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  groups = [g for g in (1, 2, 4, 8, 16) if args.devices % g == 0 and g <= args.devices]
  if args.groups:
    groups = [int(g) for g in args.groups.split(",")]
  modes = [("replicated", None, False), ("hsdp", "local", False)]
  if args.reshard:
    modes.append(("hsdp+reshard", "local", True))
  for group in groups:
    mesh = jaxcomm.make_mesh(hosts=args.devices // group, local=group)
    for mode, shard_over, reshard in modes:
      m = _measure(mesh, args.model, args.layers, args.width, args.batch, shard_over, reshard,
                   args.donate)
      state = m["params"] + m["moments"] + m["residuals"]
      peak = m["argument"] + m["output"] + m["temp"] - m["alias"]
      kib = lambda b: f"{b / 1024:.1f}"
      print(f"| {args.devices // group} x {group} | {mode} | {kib(m['params'])} | "
            f"{kib(m['moments'])} | {kib(m['residuals'])} | {kib(state)} | "
            f"{kib(m['argument'])} | {kib(m['output'])} | {kib(m['temp'])} | "
            f"{kib(m['alias'])} | {kib(peak)} |",
            flush=True)
      rows.append((f"{args.devices // group} x {group}", mode, m))
  print("\nBytes each device sends per step (KiB), from the compiled HLO")
  print("| H x G | mode | fast axis | formula | slow axis | both (loss pmean, non-finite flag) |")
  print("|---|---|---|---|---|---|")
  for shape, mode, m in rows:
    formula = "" if mode == "hsdp+reshard" else f"{m['fast_formula'] / 1024:.2f}"
    print(f"| {shape} | {mode} | {m['fast'] / 1024:.2f} | {formula} | "
          f"{m['slow'] / 1024:.2f} | {m['both']:.0f} B |")


if __name__ == "__main__":
  main()
