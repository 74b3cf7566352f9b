"""strategies: bytes per mesh axis, wall-clock and modeled time of every strategy x compressor.

For one gradient of ``--elements`` float32 values, each (strategy, compressor) pair runs
``jaxcomm.compressed_allreduce`` on a ``(host, local)`` mesh. Printed per pair: the bytes each
device sends over each axis (from the compiled HLO), the median wall-clock time of one
allreduce on this machine, and the cost model's communication time on two link pairs.

In one process it simulates ``--hosts x --local`` CPU devices. Under the launcher
(``python -m jaxcomm.launch -n 2 --local-devices 4 -- python -m benchmarks.strategies``) the
host axis crosses real processes (gloo), and process 0 prints the table.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

from benchmarks.common import host_local_mesh, median_seconds

PAIRS = (
    ("dense", "fp32"), ("dense", "bf16"),
    ("linear", "int8-shared"), ("linear", "randomk-1%"), ("linear", "sketch"),
    ("gather", "int8"), ("gather", "sign"), ("gather", "topk-1%"),
    ("two_phase", "int8"), ("two_phase", "sign"), ("two_phase", "topk-1%"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.strategies",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--hosts", type=int, default=2, help="slow-axis size (one process)")
  parser.add_argument("--local", type=int, default=4, help="fast-axis size (one process)")
  parser.add_argument("--elements", type=int, default=1 << 20, help="gradient elements")
  parser.add_argument("--repeats", type=int, default=10, help="timed calls (median reported)")
  args = parser.parse_args(argv)
  for name in ("hosts", "local", "elements", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  return args


def _compressor(name: str):
  import jax.numpy as jnp

  import jaxcomm
  return {
      "fp32": None,
      "bf16": None,
      "int8-shared": jaxcomm.compress.shared_quantize(),
      "randomk-1%": jaxcomm.randomk(0.01, shared=True),
      "sketch": jaxcomm.compress.count_sketch(4096, 3),
      "int8": jaxcomm.quantize(8),
      "sign": jaxcomm.sign(),
      "topk-1%": jaxcomm.topk(0.01),
  }[name] if name != "bf16" else jnp.bfloat16


def _allreduce(strategy: str, name: str):
  import jax.numpy as jnp

  import jaxcomm
  from jaxcomm.collectives import level
  choice = _compressor(name)
  if strategy == "dense":
    dtype = jnp.bfloat16 if name == "bf16" else None
    return jaxcomm.compressed_allreduce(levels=[level("local", dtype=dtype),
                                                level("host", dtype=dtype)])
  return jaxcomm.compressed_allreduce(choice, strategy=strategy,
                                      feedback=strategy != "linear" and name != "int8")


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  mesh, launched = host_local_mesh(args.hosts, args.local)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcomm
  hosts, local = mesh.shape["host"], mesh.shape["local"]
  axes = ("host", "local")
  params = {"w": jnp.zeros((args.elements,), jnp.float32)}
  grads = jax.device_put(
      jax.random.normal(jax.random.PRNGKey(0), (mesh.size, args.elements)),
      NamedSharding(mesh, P(axes)))
  links = {"nvlink4+100gbe": {"host": jaxcomm.link("100gbe"), "local": jaxcomm.link("nvlink4")},
           "nvlink4+1gbe": {"host": jaxcomm.link("1gbe"), "local": jaxcomm.link("nvlink4")}}
  rows = []
  for strategy, name in PAIRS:
    tx = _allreduce(strategy, name)
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axes), specs),
                       out_specs=(P(), specs))
    def step(g, s):
      update, s = tx.update({"w": g[0]}, s)
      return update["w"], s

    report = jaxcomm.accounting.measure(step, grads, state, mesh=mesh)
    seconds = median_seconds(lambda step=step, state=state: step(grads, state), args.repeats)
    link = report.link_bytes(("host", "local"))
    modeled = {key: jaxcomm.predict(report, value).total for key, value in links.items()}
    rows.append((strategy, name, link["host"], link["local"], 1e3 * seconds,
                 *(1e3 * v for v in modeled.values())))
  if jax.process_index() == 0:
    where = ("processes (gloo)" if launched else "simulated devices")
    print(f"compressed_allreduce of {args.elements:,} float32 per device on {hosts} hosts x "
          f"{local} local {where}; bytes per device per call, from compiled HLO")
    header = (f"{'strategy':<10} {'compressor':<12} {'host B':>12} {'local B':>12} "
              f"{'measured ms':>12} " + " ".join(f"{'model ' + k + ' ms':>24}" for k in links))
    print(header)
    print("-" * len(header))
    for strategy, name, host_b, local_b, ms, *model in rows:
      print(f"{strategy:<10} {name:<12} {host_b:>12,.0f} {local_b:>12,.0f} {ms:>12.2f} "
            + " ".join(f"{m:>24.3f}" for m in model))
  return 0


if __name__ == "__main__":
  sys.exit(main())
