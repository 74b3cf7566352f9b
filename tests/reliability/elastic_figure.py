"""The quality effect of the residual rules of an elastic restore (docs/reliability.md).

  PYTHONPATH=. python tests/reliability/elastic_figure.py [--steps 300] [--out docs/img/...]

MLP 64-256-256-10 on a teacher task, top-k 1% with error feedback (gather) + Adam 1e-3 on
2 hosts x 4 local (simulated). The uninterrupted run trains ``--steps`` steps; the others
checkpoint at half way and restore on 4 x 2 and on 1 x 8 with ``residuals='sum'`` and
``'reset'``, then train the second half on the same batches. Prints the mean loss over the
first 20 steps after the restore and over the last 20, and plots the curves.
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jaxcomm  # noqa: E402
from jaxcomm import checkpoint  # noqa: E402
from models.data import teacher_classification  # noqa: E402
from models.mlp import classification_loss, init_mlp  # noqa: E402

BATCH = 8 * 32
WINDOW = 20


def _tx():
  return optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.01), strategy="gather"),
                     optax.adam(1e-3))


def _train(mesh, loss_fn, params, opt_state, specs, data, start, stop):
  step = jaxcomm.optim.data_parallel_step(loss_fn, _tx(), mesh, specs)
  inputs, labels = data
  losses = []
  for i in range(start, stop):
    params, opt_state, loss = step(params, opt_state, (inputs[i * BATCH:(i + 1) * BATCH],
                                                       labels[i * BATCH:(i + 1) * BATCH]))
    losses.append(float(loss))  # waits for the step (simulated devices: one step in flight)
  return params, opt_state, losses


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "elastic_restore.png"))
  args = parser.parse_args(argv)
  half = args.steps // 2
  graphdef, params = init_mlp(64, [256, 256], 10, seed=0)
  loss_fn = classification_loss(graphdef)
  data = tuple(np.asarray(a) for a in teacher_classification(0, args.steps * BATCH, 64, 10))
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  opt_state, specs = jaxcomm.optim.sharded_init(_tx(), params, mesh)
  saved_params, saved_state, first = _train(mesh, loss_fn, params, opt_state, specs, data, 0,
                                            half)
  _, _, rest = _train(mesh, loss_fn, saved_params, saved_state, specs, data, half, args.steps)
  curves = {"uninterrupted 2x4": first + rest}
  with tempfile.TemporaryDirectory() as directory:
    checkpoint.save(directory, half, {"params": saved_params, "opt_state": saved_state})
    for hosts, local in ((4, 2), (1, 8)):
      new_mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
      replicated = NamedSharding(new_mesh, P())
      target = {"params": jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype,
                                                                      sharding=replicated),
                                       params),
                "opt_state": checkpoint.abstract_state(_tx(), params, new_mesh)}
      new_specs = jaxcomm.optim.state_specs(_tx(), params, new_mesh)
      for rule in ("sum", "reset"):
        state = checkpoint.restore(directory, target, tx=_tx(), params=params, residuals=rule)
        _, _, losses = _train(new_mesh, loss_fn, state["params"], state["opt_state"], new_specs,
                              data, half, args.steps)
        curves[f"restored on {hosts}x{local}, {rule}"] = first + losses
  print(f"top-k 1% gather + Adam 1e-3, checkpoint at step {half} of {args.steps} on 2x4")
  print(f"{'run':<26}{'mean loss, ' + str(WINDOW) + ' steps after':>26}{'last ' + str(WINDOW):>10}")
  for name, losses in curves.items():
    print(f"{name:<26}{np.mean(losses[half:half + WINDOW]):>26.4f}"
          f"{np.mean(losses[-WINDOW:]):>10.4f}")
  _plot(curves, half, args.out)


def _plot(curves, half, out) -> None:
  figure, axis = plt.subplots(figsize=(7, 4))
  for name, losses in curves.items():
    steps = np.arange(len(losses))
    shown = steps >= (0 if name.startswith("uninterrupted") else half)
    axis.plot(steps[shown], np.asarray(losses)[shown], label=name, linewidth=1)
  axis.axvline(half, color="grey", linestyle=":", linewidth=1)
  axis.set_xlabel("step")
  axis.set_ylabel("training loss")
  axis.set_yscale("log")
  axis.set_title("Elastic restore: residuals summed vs reset (top-k 1%, 2x4 -> 4x2 / 1x8)")
  axis.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(out, dpi=110)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
