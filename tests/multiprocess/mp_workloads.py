"""Computations run both on a real multi-process mesh and on the simulated one-process mesh.

Each returns plain numpy values that are the same on every process (replicated results, and
device-local state gathered from all processes), so a multi-process run and a simulated run
with the same seeds can be compared value for value.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from models.data import teacher_classification
from models.mlp import classification_loss, init_mlp

AXES = ("host", "local")
# name -> (compressor, error feedback, strategy): every strategy of the slow axis, with and
# without error feedback and random keys. Each entry costs a compilation in three processes
# (the two launched and the simulated one), so a strategy is not repeated for a compressor
# whose path through it is the same (identity through gather, sign through two-phase).
COMPRESSORS = {
    "topk-ef": (jaxcomm.topk(0.1), True, "gather"),
    "sign-ef": (jaxcomm.sign(), True, "gather"),
    "int8": (jaxcomm.quantize(8), False, "gather"),
    "topk-ef-two-phase": (jaxcomm.topk(0.1), True, "two_phase"),
    "randomk-linear": (jaxcomm.randomk(0.25, shared=True), False, "linear"),
    "int8-shared-linear": (jaxcomm.compress.shared_quantize(), False, "linear"),
    "full-precision-dense": (None, False, None),
}
GRAD_SHAPES = {"kernel": (24, 10), "bias": (10,)}
ALLREDUCE_STEPS = 3
TRAIN_STEPS = 12
TRAIN_COMPRESSOR = "topk-ef"
BATCH_PER_DEVICE = 16


def to_global(tree, mesh, spec):
  """Global arrays laid out as ``spec`` from host values every process holds in full."""
  def place(value):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])
  return jax.tree.map(place, tree)


def to_numpy(tree):
  """Host copies of global arrays, gathered from every process when sharded."""
  return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
                      tree)


def _device_grads(mesh, step: int):
  """A distinct gradient pytree per device, as ``(devices, *shape)`` arrays over ``AXES``."""
  rng = np.random.default_rng(step)
  return to_global({name: rng.standard_normal((mesh.size, *shape), np.float32)
                    for name, shape in sorted(GRAD_SHAPES.items())}, mesh, P(AXES))


def allreduce_results(mesh) -> dict[str, np.ndarray]:
  """Means and final error-feedback state of ``compressed_allreduce`` for each compressor."""
  params = to_global({name: np.zeros(shape, np.float32) for name, shape in GRAD_SHAPES.items()},
                     mesh, P())
  results = {}
  for name, (compressor, feedback, strategy) in COMPRESSORS.items():
    tx = jaxcomm.compressed_allreduce(compressor, feedback=feedback, strategy=strategy, seed=7)
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), specs),
                       out_specs=(P(), specs))
    def update(grads, state, tx=tx):
      return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    for step in range(ALLREDUCE_STEPS):
      mean, state = update(_device_grads(mesh, step), state)
      for leaf, value in to_numpy(mean).items():
        results[f"{name}/step{step}/mean/{leaf}"] = value
    for path, value in jax.tree_util.tree_flatten_with_path(to_numpy(state))[0]:
      results[f"{name}/state{jax.tree_util.keystr(path)}"] = value
  return results


def training_results(mesh) -> dict[str, np.ndarray]:
  """Loss and parameters after every step of a short compressed data-parallel MLP run."""
  graphdef, params = init_mlp(16, [32], 4, seed=0)
  loss_fn = classification_loss(graphdef)
  inputs, labels = teacher_classification(0, mesh.size * BATCH_PER_DEVICE * TRAIN_STEPS, 16, 4)
  compressor, feedback, _ = COMPRESSORS[TRAIN_COMPRESSOR]
  tx = optax.chain(jaxcomm.compressed_allreduce(compressor, feedback=feedback),
                   optax.adam(3e-3))
  params = to_global(params, mesh, P())
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
  per_step = mesh.size * BATCH_PER_DEVICE
  batches = [to_global((inputs[i * per_step:(i + 1) * per_step],
                        labels[i * per_step:(i + 1) * per_step]), mesh, P(AXES))
             for i in range(TRAIN_STEPS)]
  link = jaxcomm.accounting.measure(step, params, opt_state, batches[0], mesh=mesh).link_bytes()
  results = {f"bytes/{axis}": np.float64(value) for axis, value in link.items()}
  for index, batch in enumerate(batches):
    params, opt_state, loss = step(params, opt_state, batch)
    results[f"step{index}/loss"] = np.asarray(loss)
    for path, value in jax.tree_util.tree_flatten_with_path(to_numpy(params))[0]:
      results[f"step{index}/params{jax.tree_util.keystr(path)}"] = value
  return results


HSDP_STEPS = 3


def hsdp_results(mesh) -> dict[str, np.ndarray]:
  """Loss and full parameters after each of ``HSDP_STEPS`` steps of ``jaxcomm.data_parallel``
  with ``shard_over='local'`` (top-k + error feedback, AdamW): parameters, moments and
  residuals live as flat shards over ``local``, which crosses no process, while ``host``
  crosses processes. The hidden width 30 makes the hidden bias need padding on ``G = 4``."""
  graphdef, params = init_mlp(16, [30], 4, seed=1)
  inputs, labels = teacher_classification(1, mesh.size * BATCH_PER_DEVICE * HSDP_STEPS, 16, 4)
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.25)),
                   optax.adamw(3e-3, weight_decay=0.1))
  trainer = jaxcomm.data_parallel(classification_loss(graphdef), tx, mesh, shard_over="local")
  state = trainer.init(params)
  per_step = mesh.size * BATCH_PER_DEVICE
  # Each device's slice of every flat parameter: 1/G of the padded leaf.
  results = {"hsdp/shard_lengths": np.array([leaf.addressable_shards[0].data.shape[0]
                                             for leaf in jax.tree.leaves(state.params)])}
  for index in range(HSDP_STEPS):
    batch = to_global((inputs[index * per_step:(index + 1) * per_step],
                       labels[index * per_step:(index + 1) * per_step]), mesh, P(AXES))
    state, loss = trainer.step(state, batch)
    results[f"hsdp/step{index}/loss"] = np.asarray(loss)
    for path, value in jax.tree_util.tree_flatten_with_path(to_numpy(trainer.model(state)))[0]:
      results[f"hsdp/step{index}/params{jax.tree_util.keystr(path)}"] = value
  return results
