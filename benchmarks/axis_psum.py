"""What one ``psum`` costs over each axis of a 2x2 mesh: the fast axis against the slow one.

Times a jitted ``shard_map`` ``psum`` of a float32 array per device (the slow-link MLP's
4,836,874 gradient elements, 19.3 MB) over ``'local'``, over ``'host'`` and over both. Run it
in one process (4 simulated CPU devices) and across two processes of two devices each; on
the CPU backend the second shows that a process's own two devices sum over gloo's TCP
transport, at the cross-process price (docs/collectives.md, session 13)::

  python -m benchmarks.axis_psum
  python -m jaxcomm.launch -n 2 --local-devices 2 -- python -m benchmarks.axis_psum
"""

from __future__ import annotations

import functools
import sys

from benchmarks.common import host_local_mesh, median_seconds

ELEMENTS = 4_836_874


def main() -> int:
  mesh, _ = host_local_mesh(2, 2)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  spec = PartitionSpec(("host", "local"))
  x = jax.device_put(jnp.ones((4, ELEMENTS), jnp.float32), NamedSharding(mesh, spec))
  for axes in ("local", "host", ("host", "local")):
    psum = functools.partial(jax.lax.psum, axis_name=axes)
    summed = jax.jit(jax.shard_map(psum, mesh=mesh, in_specs=spec, out_specs=spec))
    ms = 1e3 * median_seconds(functools.partial(summed, x), 15)
    print(f"process {jax.process_index()} of {jax.process_count()}: psum over {axes}: "
          f"{ms:.1f} ms", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
