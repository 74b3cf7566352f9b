"""PowerSGD's approximation error against the best rank-r approximation (SVD), over steps.

The same gradient matrix is fed to ``jaxcomm.powersgd_allreduce`` (no error feedback) step
after step on a simulated 2 x 4 mesh; each warm-started power iteration should move the
output closer to the truncated SVD of the mean gradient. Printed: relative distance
``||P Q^T - M_r|| / ||M_r||`` at chosen steps, for a matrix with a spectral gap and for a
Gaussian one (no gap: slow convergence).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.powersgd_svd",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--ranks", default="1,2,4", help="comma-separated ranks")
  parser.add_argument("--steps", type=int, default=64, help="warm-started steps")
  parser.add_argument("--shape", default="256,128", help="matrix shape m,n")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  import jaxcomm
  m, n = (int(v) for v in args.shape.split(","))
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  left, _ = jnp.linalg.qr(jax.random.normal(keys[0], (m, n)))
  right, _ = jnp.linalg.qr(jax.random.normal(keys[1], (n, n)))
  decaying = (left * (1.0 / (1.0 + jnp.arange(n)) ** 1.5)) @ right.T
  matrices = {"decaying spectrum": decaying,
              "gaussian": jax.random.normal(keys[2], (m, n)) / np.sqrt(n)}
  checkpoints = [s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s <= args.steps]
  print(f"PowerSGD vs SVD on a {m}x{n} mean gradient, 2 hosts x 4 devices, no error feedback")
  print(f"{'matrix':<18} {'rank':>4} " + " ".join(f"{'step ' + str(s):>9}" for s in checkpoints))
  for name, target in matrices.items():
    noise = jax.random.normal(keys[3], (8, m, n)) * 0.1
    grads = target + noise - jnp.mean(noise, 0)
    u, s, vt = np.linalg.svd(np.asarray(target))
    for rank in (int(r) for r in args.ranks.split(",")):
      best = (u[:, :rank] * s[:rank]) @ vt[:rank]
      tx = jaxcomm.powersgd_allreduce(rank=rank, feedback=False, min_compression_rate=1.0)
      state, specs = jaxcomm.optim.sharded_init(tx, {"w": grads[0]}, mesh)

      @jax.jit
      @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(("host", "local")), specs),
                         out_specs=(P(), specs))
      def step(g, opt_state):
        update, opt_state = tx.update({"w": g[0]}, opt_state)
        return update["w"], opt_state

      errors = []
      for _ in range(args.steps):
        output, state = step(grads, state)
        errors.append(np.linalg.norm(np.asarray(output) - best) / np.linalg.norm(best))
      print(f"{name:<18} {rank:>4} " + " ".join(f"{errors[s - 1]:>9.4f}" for s in checkpoints))
  return 0


if __name__ == "__main__":
  sys.exit(main())
