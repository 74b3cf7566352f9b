"""gather_impl: all_gather vs the psum-built gather of byte payloads on this backend.

Times ``jax.lax.all_gather`` and :func:`jaxcomm._src.collectives.strategies.psum_gather` of a uint8
payload over the ``host`` axis for several sizes, to choose
``jaxcomm._src.collectives.strategies.PREFERRED_GATHER`` by measurement. In one process it
simulates ``--hosts x --local`` CPU devices; under the launcher
(``python -m jaxcomm.launch -n 2 --local-devices 1 -- python -m benchmarks.gather_impl``) the
host axis crosses processes (gloo) and process 0 prints.
"""

from __future__ import annotations

import argparse
import functools
import sys

from benchmarks.common import host_local_mesh, median_seconds


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gather_impl",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--hosts", type=int, default=2, help="host-axis size (one process)")
  parser.add_argument("--local", type=int, default=1, help="local-axis size (one process)")
  parser.add_argument("--sizes-kb", default="32,1024,4096", help="payload sizes in KiB")
  parser.add_argument("--repeats", type=int, default=10, help="timed calls (median)")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  mesh, launched = host_local_mesh(args.hosts, args.local)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxcomm._src.collectives.strategies import psum_gather
  axes = ("host", "local")
  rows = []
  for size_kb in (int(s) for s in args.sizes_kb.split(",")):
    data = jax.device_put(
        jax.random.randint(jax.random.PRNGKey(0), (mesh.size, size_kb * 1024), 0, 255
                           ).astype(jnp.uint8), NamedSharding(mesh, P(axes)))
    timings = {}
    for name, gather in (("all_gather", lambda p: jax.lax.all_gather(p, "host", to="invarying")),
                         ("psum", lambda p: psum_gather(p, "host"))):
      @jax.jit
      @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(axes), out_specs=P("local"))
      def run(x, gather=gather):
        return gather(x[0])[None].sum(axis=(0, 1), dtype=jnp.int32)[None]

      timings[name] = 1e3 * median_seconds(lambda run=run: run(data), args.repeats)
    rows.append((size_kb, timings["all_gather"], timings["psum"]))
  if jax.process_index() == 0:
    where = "processes (gloo)" if launched else "simulated CPU devices"
    print(f"gather of a uint8 payload over {mesh.shape['host']} hosts ({where}); median ms")
    print(f"{'KiB':>8} {'all_gather':>12} {'psum-built':>12} {'faster':>12}")
    for size_kb, native, built in rows:
      print(f"{size_kb:>8} {native:>12.2f} {built:>12.2f} "
            f"{'all_gather' if native <= built else 'psum':>12}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
