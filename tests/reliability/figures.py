"""Prints the figures of docs/reliability.md: residual memory and the loss with bf16 residuals.

  PYTHONPATH=. python tests/reliability/figures.py
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jaxcomm  # noqa: E402
from models.data import teacher_classification  # noqa: E402
from models.mlp import classification_loss, init_mlp  # noqa: E402
from test_memory import residual_bytes_per_device  # noqa: E402

STEPS, BATCH = 300, 8 * 32


def main() -> None:
  graphdef, params = init_mlp(64, [256, 256], 10, seed=0)
  grad_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  loss_fn = classification_loss(graphdef)
  inputs, labels = teacher_classification(0, STEPS * BATCH, 64, 10)
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  print(f"MLP 64-256-256-10: {grad_bytes} gradient bytes (float32); mesh 2 hosts x 4 local")
  print(f"{'method':<22}{'residual B/device':>18}{'/gradient':>10}{'arg B/device':>14}"
        f"{'final loss':>12}")
  for name, compressor, strategy in (("topk(0.01) gather", jaxcomm.topk(0.01), "gather"),
                                     ("sign two_phase", jaxcomm.sign(), "two_phase")):
    for dtype in (jnp.float32, jnp.bfloat16):
      tx = optax.chain(jaxcomm.compressed_allreduce(compressor, strategy=strategy,
                                                    residual_dtype=dtype), optax.adam(1e-3))
      state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
      residual = sum(residual_bytes_per_device(state[0]).values())
      step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
      batch = (inputs[:BATCH], labels[:BATCH])
      arguments = step.lower(params, state, batch).compile().memory_analysis()
      current, losses = params, []
      for i in range(STEPS):
        current, state, loss = step(current, state, (inputs[i * BATCH:(i + 1) * BATCH],
                                                     labels[i * BATCH:(i + 1) * BATCH]))
        losses.append(float(loss))
      label = f"{name} {jnp.dtype(dtype).name}"
      print(f"{label:<22}{residual:>18}{residual / grad_bytes:>10.3f}"
            f"{arguments.argument_size_in_bytes:>14}{np.mean(losses[-20:]):>12.4f}")


if __name__ == "__main__":
  main()
