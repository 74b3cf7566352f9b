"""A short compressed MLP run that checkpoints, restores and can die mid-step.

Imported by the tests (in-process, 8 simulated devices) and run as a program, in a fresh
process or as one process of a multi-process job::

  rel_training.py OUT.npz --start S --stop T [--restore DIR] [--save-dir DIR --save-at K ...]
                  [--die-at K]

The optimizer state holds every kind of jaxcomm state: TernGrad (stochastic: per-step PRNG
keys) over a two-phase host level with error feedback (worker and server residuals), the step
and skip counters, and Adam's moments. Checkpoint ``K`` is the state after ``K`` steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxcomm.distributed  # noqa: E402

JOINED = __name__ == "__main__" and jaxcomm.distributed.initialize_from_env()

import jax  # noqa: E402

if __name__ == "__main__" and not JOINED:
  jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from models.data import teacher_classification  # noqa: E402
from models.mlp import classification_loss, init_mlp  # noqa: E402

AXES = ("host", "local")
BATCH_PER_DEVICE = 16
STEPS = 10


def optimizer() -> optax.GradientTransformation:
  return optax.chain(
      jaxcomm.compressed_allreduce(jaxcomm.compress.terngrad(), strategy="two_phase", seed=3),
      optax.adam(3e-3))


def mesh_for_this_job():
  return jaxcomm.make_mesh() if jax.process_count() > 1 else jaxcomm.make_mesh(hosts=2, local=4)


def _global(tree, mesh, spec):
  def place(value):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])
  return jax.tree.map(place, tree)


def _host(tree):
  """Host copies of replicated arrays (each process holds them in full)."""
  return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def initial_model():
  """``(graphdef, params)`` of the MLP every run starts from."""
  return init_mlp(16, [32], 4, seed=0)


def train(mesh, start: int, stop: int, *, restore: str | None = None,
          save_dir: str | None = None, save_at=(), die_at: int | None = None):
  """Runs steps ``start .. stop-1``; returns ``(params, losses)`` as numpy."""
  graphdef, params = initial_model()
  loss_fn = classification_loss(graphdef)
  per_step = mesh.size * BATCH_PER_DEVICE
  inputs, labels = (np.asarray(a) for a in teacher_classification(1, per_step * STEPS, 16, 4))
  tx = optimizer()
  params = _global(params, mesh, P())
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  if restore is not None:
    target = {"params": params, "opt_state": checkpoint.abstract_state(tx, params, mesh)}
    restored = checkpoint.restore(restore, target, step=start)
    params, opt_state = restored["params"], restored["opt_state"]
  step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
  losses = []
  for index in range(start, stop):
    batch = _global((inputs[index * per_step:(index + 1) * per_step],
                     labels[index * per_step:(index + 1) * per_step]), mesh, P(AXES))
    params, opt_state, loss = step(params, opt_state, batch)
    if index + 1 == die_at and jax.process_index() == 1:
      os.kill(os.getpid(), signal.SIGKILL)  # the step is in flight: dispatch is asynchronous
    losses.append(float(loss))
    if save_dir is not None and index + 1 in save_at:
      checkpoint.save(save_dir, index + 1, {"params": params, "opt_state": opt_state})
      print(f"saved step {index + 1}", flush=True)
  return _host(params), np.asarray(losses)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--start", type=int, default=0)
  parser.add_argument("--stop", type=int, default=STEPS)
  parser.add_argument("--restore")
  parser.add_argument("--save-dir")
  parser.add_argument("--save-at", type=int, nargs="*", default=())
  parser.add_argument("--die-at", type=int)
  args = parser.parse_args(argv)
  params, losses = train(mesh_for_this_job(), args.start, args.stop, restore=args.restore,
                         save_dir=args.save_dir, save_at=tuple(args.save_at),
                         die_at=args.die_at)
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(args.out, losses=losses, **flat)
  return 0


if __name__ == "__main__":
  sys.exit(main())
