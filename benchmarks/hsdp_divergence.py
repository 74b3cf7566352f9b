"""hsdp_divergence: how far HSDP's parameters drift from the replicated run's, step by step.

For each ``--methods`` name of :data:`benchmarks.scan.methods.REGISTRY`, trains the mesh
scan's quick GPT task (seed 0, the scan's batches, 2x4 mesh) with
``jaxcomm.data_parallel`` replicated and with ``shard_over='local'`` in lockstep, and prints
the largest absolute parameter difference after steps 1, 5, 10, 20, 50, 100, 150 and 200,
then both held-out losses. Methods that compute the same mean in both modes differ only by
float rounding (two summation orders); this shows how fast that rounding grows.

Run: ``PYTHONPATH=. python -m benchmarks.hsdp_divergence --methods powersgd-r1,topk-ef``.
"""

from __future__ import annotations

import argparse
import os

CHECKPOINTS = (1, 5, 10, 20, 50, 100, 150, 200)


def drift(name: str, steps: int = 200) -> None:
  """Prints the largest parameter difference at :data:`CHECKPOINTS` and the held-out losses."""
  import jax
  import jax.numpy as jnp
  import jaxcomm
  from benchmarks.scan import methods as registry
  from benchmarks.scan.tasks import BATCH, TASKS
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  task = TASKS["gpt"]("quick", BATCH["gpt"] * 8, steps, 0)
  setting = registry.Setting(lr=task.lr, seed=0, topk_density=0.01, sketch_density=0.02,
                             hosts=2, local=4, params=task.params, steps=steps)
  trainers = [jaxcomm.data_parallel(task.loss_fn, registry.REGISTRY[name].build(setting), mesh,
                                    shard_over=shard_over) for shard_over in (None, "local")]
  states = [trainer.init(task.params) for trainer in trainers]
  cells = []
  for index in range(steps):
    states = [trainer.step(state, task.batch(index))[0]
              for trainer, state in zip(trainers, states)]
    if index + 1 in CHECKPOINTS:
      replicated, sharded = (t.model(s) for t, s in zip(trainers, states))
      gap = max(float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(replicated), jax.tree.leaves(sharded)))
      cells.append(f"{index + 1}: {gap:.1e}")
  held = [float(jax.jit(task.loss_fn)(t.model(s), task.held_out))
          for t, s in zip(trainers, states)]
  print(f"{name}: largest |replicated - HSDP| parameter difference after step "
        f"{', '.join(cells)}; held-out {held[0]:.4f} replicated, {held[1]:.4f} HSDP",
        flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--methods", default="powersgd-r1,powersgd-r4,topk-ef")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  for name in args.methods.split(","):
    drift(name)


if __name__ == "__main__":
  main()
