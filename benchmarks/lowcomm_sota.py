"""The settings behind the defaults of DeMo, SparseLoCo and quantized streaming DiLoCo.

Trains the main job's char LM on the 2x4 mesh with each variant and prints, per variant, the
inter-host bytes per device per step read from the compiled step (periodic methods amortized
over their period), the ratio to ``fp32-hier`` and the held-out loss (mean over seeds):

    python -m benchmarks.lowcomm_sota --steps 300 --seeds 0,1

``--demo-speed`` instead times DeMo's encode pieces on one 1024 x 1024 leaf (64 x 64 blocks).
"""

from __future__ import annotations

import argparse
import json
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm._src.optim.demo import (block_layout, dct, dct_basis, sparse_coefficients,  # noqa: E402
                                     to_blocks)
from benchmarks.scan.methods import REGISTRY, Method, Setting  # noqa: E402
from benchmarks.scan.run import run  # noqa: E402
from benchmarks.scan.tasks import BATCH, charlm  # noqa: E402


def _local(name: str, build, period: int) -> Method:
  return Method(name, name, build, None, make_step=jaxcomm.optim.local_training_step,
                device_local=True, comm_every=period)


def variants() -> dict[str, Method]:
  """Every variant by name: the registry's references and the swept settings."""
  found = {name: REGISTRY[name] for name in ("fp32-hier", "diloco-h8")}
  for topk in (16, 32, 64):
    found[f"demo-k{topk}"] = Method(
        f"demo-k{topk}", "", lambda s, k=topk: jaxcomm.demo(s.lr, topk=k, weight_decay=1e-4),
        None)
  found["demo-k32-nosign"] = Method(
      "demo-k32-nosign", "", lambda s: jaxcomm.demo(s.lr, sign=False, weight_decay=1e-4), None)
  for density, bits in ((1 / 128, 2), (1 / 64, 2), (1 / 32, 2), (1 / 64, 32)):
    name = f"sparseloco-h8-d{round(1 / density)}-b{bits}"
    found[name] = _local(name, lambda s, d=density, b=bits: jaxcomm.sparseloco(
        optax.adamw(s.lr), 8, density=d, bits=b), 8)
  for bits in (32, 4, 2):
    name = f"streaming-diloco-h8-b{bits}"
    found[name] = _local(name, lambda s, b=bits: jaxcomm.streaming_diloco(
        optax.adamw(s.lr), 8, bits=b), 8)
  return found


def demo_speed() -> None:
  """Best of 7 (ms) of the DCT at two precisions, 2-D and vmapped top-k, and the encode."""
  leaf = jax.random.normal(jax.random.PRNGKey(0), (1024, 1024))
  layout = block_layout(leaf.shape, 64, 1)
  blocks = to_blocks(leaf, layout, 1)
  rows = dct(blocks, layout).reshape(blocks.shape[0], -1)
  basis = jnp.asarray(dct_basis(64))
  cases = {
      "2-D DCT, einsum, Precision.HIGHEST": (lambda b: jnp.einsum(
          "kn,cnm,lm->ckl", basis, b, basis, precision=jax.lax.Precision.HIGHEST), blocks),
      "2-D DCT, einsum, default precision": (lambda b: dct(b, layout), blocks),
      "lax.top_k on (256, 4096), k=32": (lambda r: jax.lax.top_k(jnp.abs(r), 32)[1], rows),
      "vmap(lax.top_k) over the 256 rows": (
          jax.vmap(lambda r: jax.lax.top_k(jnp.abs(r), 32)[1]), rows),
      "encode: DCT, top-k, inverse DCT": (
          lambda b: sparse_coefficients(b, layout, 32)[2], blocks),
  }
  for name, (fn, arg) in cases.items():
    compiled = jax.jit(fn)
    jax.block_until_ready(compiled(arg))
    times = []
    for _ in range(7):
      start = time.perf_counter()
      jax.block_until_ready(compiled(arg))
      times.append(time.perf_counter() - start)
    hlo = compiled.lower(arg).compile().as_text()
    print(f"{name:40s} {min(times) * 1e3:7.1f} ms  sort in HLO: {' sort(' in hlo}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--variants", default=None, help="comma-separated names (default all)")
  parser.add_argument("--out", default=None, help="JSON file for the rows")
  parser.add_argument("--demo-speed", action="store_true", help="time DeMo's encode instead")
  args = parser.parse_args(argv)
  if args.demo_speed:
    demo_speed()
    return
  table = variants()
  names = args.variants.split(",") if args.variants else list(table)
  seeds = [int(s) for s in args.seeds.split(",")]
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  rows = {}
  for seed in seeds:
    task = charlm("default", BATCH["charlm"] * 8, args.steps, seed)
    for name in names:
      setting = Setting(lr=task.lr, seed=seed, topk_density=0.01, sketch_density=0.02,
                        hosts=2, local=4, params=task.params, steps=args.steps)
      result = run(task, table[name], mesh, setting, args.steps, min(20, args.steps))
      rows.setdefault(name, []).append(
          {"seed": seed, "inter_host_bytes": result["inter_host_bytes"],
           "held_out_loss": result["held_out_loss"], "median_step_s": result["median_step_s"]})
      print(f"seed {seed} {name:28s} {result['inter_host_bytes']:10,.0f} B/step  held-out "
            f"{result['held_out_loss']:.4f}", flush=True)
  reference = np.mean([r["inter_host_bytes"] for r in rows.get("fp32-hier", [{}])]) \
      if "fp32-hier" in rows else None
  print(f"\n| variant | inter-host B/step | vs fp32-hier | held-out loss (mean of {len(seeds)}) |")
  print("|---|---:|---:|---:|")
  for name, results in rows.items():
    nbytes = np.mean([r["inter_host_bytes"] for r in results])
    ratio = f"{reference / nbytes:,.0f}x" if reference else "-"
    loss = np.mean([r["held_out_loss"] for r in results])
    print(f"| {name} | {nbytes:,.0f} | {ratio} | {loss:.4f} |")
  if args.out:
    with open(args.out, "w") as handle:
      json.dump(rows, handle, indent=1)


if __name__ == "__main__":
  main()
