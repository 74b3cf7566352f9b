"""hsdp_regather: can ``jax.checkpoint`` make HSDP re-gather parameters in the backward pass
(FSDP's "reshard after forward") on XLA's CPU backend? A probe, compile only.

On the GPT of :mod:`benchmarks.hsdp_memory` (``--layers`` blocks of ``--width``) on a
``H x G`` mesh it compiles the forward and backward pass of the sharded loss (each leaf
all-gathered over ``'local'`` inside the loss, :func:`jaxcomm._src.optim.hsdp.gather_params`) and
prints the compiled ``temp`` bytes, the number of all-gathers over the fast axis and the
fast-axis bytes (:mod:`jaxcomm.accounting`) for

* ``plain``: as ``data_parallel(..., shard_over=)`` does it;
* ``remat``: the loss under ``jax.checkpoint`` with a policy that keeps every value except
  the all-gathers and the layout operations on them (so the backward pass must gather again);
* ``remat, no CSE``: the same, compiled with XLA's common-subexpression elimination off.

Then, on a forward pass of ``--layers`` square layers, the temp bytes and the position of
the all-gathers in the compiled schedule with and without a data dependency of each layer's
gather on the previous layer's output.

Run: ``python -m benchmarks.hsdp_regather`` (CPU, 8 simulated devices).
"""

from __future__ import annotations

import argparse
import os

# Outputs the remat policy does not keep: the gathers and the layout operations on them.
RECOMPUTED = frozenset({"all_gather", "all_gather_invariant", "slice", "reshape", "squeeze",
                        "expand_dims", "transpose", "convert_element_type",
                        "broadcast_in_dim", "copy", "copy_p"})


def _gradient_step(params, loss_fn, batch, mesh, remat: bool):
  """The jitted forward + backward of ``loss_fn`` on flat shards of ``params``."""
  import jax
  from jax.sharding import PartitionSpec as P
  from jaxcomm._src.optim import hsdp
  shards, layout = hsdp.shard_params(params, mesh, "local", (None,) * len(
      jax.tree.leaves(params)))

  def loss(shards, batch):
    return loss_fn(hsdp.gather_params(shards, layout), batch)

  if remat:
    loss = jax.checkpoint(loss, policy=lambda prim, *_, **__: prim.name not in RECOMPUTED)
  specs = jax.tree.map(lambda _: P("local"), shards)
  grad = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(specs, P(("host", "local"))),
                       out_specs=jax.tree.map(lambda _: P(("host", "local")), shards),
                       check_vma=False)
  return jax.jit(grad).lower(shards, batch)


def _tied_forward(layers: int, width: int, tie: bool):
  """``(temp bytes, schedule)`` of a forward pass gathering each layer's weight."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((len(jax.devices()),), ("local",),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def forward(shards, x):
    for shard in shards:
      if tie:  # a data dependency on the previous layer's output (0 for finite inputs)
        shard = shard + 0.0 * x[0, 0]
      x = jnp.tanh(x @ jax.lax.all_gather(shard, "local", tiled=True).reshape(width, width))
    return jnp.sum(x)

  shards = [jnp.ones(width * width) for _ in range(layers)]
  compiled = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(P("local"), P()),
                                   out_specs=P(), check_vma=False)).lower(
      shards, jnp.ones((4, width))).compile()
  entry = compiled.as_text().split("ENTRY")[1].splitlines()
  order = ["G" if "all-gather(" in line else "T" for line in entry
           if "all-gather(" in line or "tanh" in line.split("=")[0]]
  return compiled.memory_analysis().temp_size_in_bytes, "".join(order)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--local", type=int, default=4)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import jaxcomm
  from benchmarks.hsdp_memory import MODELS
  mesh = jaxcomm.make_mesh(hosts=8 // args.local, local=args.local)
  params, loss_fn, batch = MODELS["gpt"](args.layers, args.width, args.batch)
  print(f"GPT {args.layers} blocks of width {args.width}, "
        f"{sum(p.size for p in jax.tree.leaves(params))} parameters, "
        f"{8 // args.local} x {args.local}; per device")
  print("| variant | temp KiB | all-gathers over 'local' | fast-axis KiB |")
  print("|---|---|---|---|")
  for name, remat, options in (("plain", False, {}), ("remat", True, {}),
                               ("remat, no CSE", True, {"xla_disable_hlo_passes": "cse"})):
    compiled = _gradient_step(params, loss_fn, batch, mesh, remat).compile(
        compiler_options=options)
    text = compiled.as_text()
    gathers = sum(" all-gather(" in line and "{{0,1" in line for line in text.splitlines())
    fast = jaxcomm.accounting.report_from_hlo(text, mesh).bytes_per_axes().get(("local",), 0)
    print(f"| {name} | {compiled.memory_analysis().temp_size_in_bytes / 1024:.1f} | "
          f"{gathers} | {fast / 1024:.1f} |", flush=True)
  print(f"\nForward pass of {args.layers} layers {4 * args.width}x{4 * args.width} "
        f"(G = 8): G = all-gather, T = tanh, in schedule order")
  for tie in (False, True):
    temp, order = _tied_forward(args.layers, 4 * args.width, tie)
    print(f"{'tied' if tie else 'untied'}: temp {temp / 1024:.1f} KiB, schedule {order}")


if __name__ == "__main__":
  main()
