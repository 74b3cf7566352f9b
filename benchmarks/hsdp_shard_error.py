"""hsdp_shard_error: what the count sketch and PowerSGD lose on HSDP shards vs replicated chunks.

Both measurements use the quick GPT of the mesh scan (``benchmarks.scan.tasks``, seed 0) and
its gradient of the global batch at the initial parameters.

``sketch``: the scan's ``sketch`` method compresses all gradients in one bucket with one
count-sketch row of ``width = ceil(0.02 * ceil(d / G))`` buckets per device. Replicated, a
device sketches its contiguous ``1/G`` chunk of the concatenated gradient (whole leaves);
under ``shard_over`` it sketches the ``1/G`` shard of *every* leaf. Each layout runs through
the real trainer (``jaxcomm.data_parallel``, one step of SGD(1) on a linear loss whose
gradient is the fixed GPT gradient on every device, so the step is minus the decoded
estimate), for ``--seeds`` hash seeds, next to one sketch of the whole vector with ``G``
times the width (the same bytes per host). Prints each leaf's share of ``||g||^2`` and its
relative squared error ``||g^ - g||^2 / ||g||^2`` per layout, and the total.

``powersgd``: the relative error ``||A - A_r||^2 / ||A||^2`` of the best rank-``r``
approximation (SVD) of each gradient matrix (PowerSGD's ``(out, rest)`` view), of the whole
matrix at ranks 1-4, and of ``G`` independent rank-1 approximations of its column blocks (what
a device would send if it factorized its own block), with the bytes of the factors.

Run: ``PYTHONPATH=. python -m benchmarks.hsdp_shard_error`` (CPU, 8 simulated devices).
"""

from __future__ import annotations

import argparse
import math
import os


def _gpt_gradient(batch_steps=(0,)):
  """``(task, [(names, leaves)])``: the quick GPT task and its gradient at the initial
  parameters on the global batch of each step in ``batch_steps``."""
  import jax
  from benchmarks.scan.tasks import BATCH, TASKS
  task = TASKS["gpt"]("quick", BATCH["gpt"] * 8, 200, 0)  # hsdp_lm --size quick --steps 200
  grads = []
  for step in batch_steps:
    grad = jax.grad(lambda p: task.loss_fn(p, task.batch(step)))(task.params)
    flat = jax.tree_util.tree_flatten_with_path(grad)[0]
    grads.append(([jax.tree_util.keystr(path) for path, _ in flat], [g for _, g in flat]))
  return task, grads


def _decoded(task, leaves, compressor, shard_over, total: int):
  """The trainer's decoded mean of ``leaves`` (identical on every device) on a 2x4 mesh:
  minus one SGD(1) step of a loss whose gradient is ``leaves``."""
  import jax
  import jax.numpy as jnp
  import optax
  import jaxcomm
  loss = lambda params, batch: sum(jnp.vdot(p, g) for p, g in zip(jax.tree.leaves(params),
                                                                  leaves))
  tx = optax.chain(jaxcomm.compressed_allreduce(compressor, bucket_bytes=4 * total),
                   optax.sgd(1.0))
  trainer = jaxcomm.data_parallel(loss, tx, jaxcomm.make_mesh(hosts=2, local=4),
                                  shard_over=shard_over)
  state, _ = trainer.step(trainer.init(task.params), jnp.zeros((8, 1)))
  return [p - q for p, q in zip(jax.tree.leaves(task.params),
                                jax.tree.leaves(trainer.model(state)))]


def _whole_vector(leaves, width: int, seed: int):
  """One count sketch of ``width`` buckets over the concatenated gradient, decoded, per leaf."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jaxcomm
  sketch = jaxcomm.compress.count_sketch(width, 1, seed=seed)
  flat = jnp.concatenate([g.reshape(-1) for g in leaves])
  payload, _ = sketch.encode(flat, sketch.init(flat.shape, flat.dtype), jax.random.key(0))
  decoded = sketch.decode(payload, flat.shape)
  ends = np.cumsum([g.size for g in leaves])
  return [decoded[end - g.size:end].reshape(g.shape) for g, end in zip(leaves, ends)]


def sketch(seeds: int, local: int = 4) -> None:
  """Prints the per-leaf and total relative squared error of the count sketch per layout."""
  import numpy as np
  import jaxcomm
  task, [(names, leaves)] = _gpt_gradient()
  total = sum(g.size for g in leaves)
  width = max(1, math.ceil(0.02 * -(-total // local)))
  squares = np.array([float((g ** 2).sum()) for g in leaves])
  errors = {"replicated chunk": [], "HSDP shards": [], f"whole, {local}x width": []}
  for seed in range(seeds):
    compressor = jaxcomm.compress.count_sketch(width, 1, seed=seed)
    estimates = (_decoded(task, leaves, compressor, None, total),
                 _decoded(task, leaves, compressor, "local", total),
                 _whole_vector(leaves, local * width, seed))
    for rows, estimate in zip(errors.values(), estimates):
      rows.append([float(((e - g) ** 2).sum()) for e, g in zip(estimate, leaves)])
  print(f"count sketch, one row of {width} buckets per device ({4 * width + 8} B), {total} "
        f"elements, G = {local}, {seeds} hash seeds; per leaf ||g^ - g||^2 / ||g||^2 "
        "(mean over seeds)")
  print("| leaf | elements | share of ||g||^2 | " + " | ".join(errors) + " |")
  print("|---|---|---|" + "---|" * len(errors))
  for index, name in enumerate(names):
    cells = " | ".join(f"{np.mean(np.array(rows)[:, index]) / squares[index]:.1f}"
                       for rows in errors.values())
    print(f"| {name} | {leaves[index].size} | {squares[index] / squares.sum():.3f} | {cells} |")
  cells = []
  for rows in errors.values():
    relative = np.array(rows).sum(axis=1) / squares.sum()
    cells.append(f"{relative.mean():.1f} [{relative.min():.1f}, {relative.max():.1f}]")
  print(f"| total (mean [min, max] over seeds) | {total} | 1 | " + " | ".join(cells) + " |")


def powersgd(local: int = 4, batch_steps=(0, 50, 100)) -> None:
  """Prints the best rank-r error of whole gradient matrices and of their column blocks."""
  import numpy as np
  from jaxcomm._src.compress.powersgd import matrix_shape, to_matrix
  _, grads = _gpt_gradient(batch_steps)

  def tail(matrix, rank):
    singular = np.linalg.svd(matrix, compute_uv=False)
    return float((singular[rank:] ** 2).sum())

  print(f"best rank-r approximation (SVD), G = {local} column blocks; relative squared error "
        "(factor floats per host)")
  print("| batch | leaf | m x n | whole r1 | blocks r1 | whole r2 | whole r4 |")
  print("|---|---|---|---|---|---|---|")
  for step, (names, leaves) in zip(batch_steps, grads):
    for name, leaf in zip(names, leaves):
      if leaf.ndim < 2:
        continue
      m, n = matrix_shape(leaf.shape)
      matrix = np.asarray(to_matrix(leaf), np.float64)
      norm, columns = float((matrix ** 2).sum()), n // local
      blocks = sum(tail(matrix[:, i * columns:(i + 1) * columns], 1) for i in range(local))
      print(f"| {step} | {name} | {m} x {n} | {tail(matrix, 1) / norm:.3f} ({m + n}) | "
            f"{blocks / norm:.3f} ({local * m + n}) | {tail(matrix, 2) / norm:.3f} "
            f"({2 * (m + n)}) | {tail(matrix, 4) / norm:.3f} ({4 * (m + n)}) |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--what", default="sketch,powersgd", help="sketch, powersgd or both")
  parser.add_argument("--seeds", type=int, default=4, help="hash seeds of the sketch")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  what = args.what.split(",")
  if "sketch" in what:
    sketch(args.seeds)
  if "powersgd" in what:
    powersgd()


if __name__ == "__main__":
  main()
