"""Shared set-up of the low-communication algorithm tests: one MLP problem on a 2x4 mesh."""

import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.optim.local_training import local_training_step, to_device_local
from models.data import teacher_classification
from models.mlp import classification_loss, init_mlp

AXES = ("host", "local")
DEVICES = 8
PER_DEVICE = 16


@functools.cache
def problem():
  """``(loss_fn, params, (inputs, labels), mesh)``, built once per test session."""
  graphdef, params = init_mlp(16, [32], 4, seed=0)
  data = teacher_classification(0, DEVICES * PER_DEVICE * 80, 16, 4)
  return classification_loss(graphdef), params, data, jaxcomm.make_mesh(hosts=2, local=4)


def batch(data, index):
  inputs, labels = data
  size = DEVICES * PER_DEVICE
  index = index % (inputs.shape[0] // size)
  return inputs[index * size:(index + 1) * size], labels[index * size:(index + 1) * size]


def numpy_roundtrip(state, specs, mesh):
  """Save to plain numpy arrays and restore onto the mesh with the state's specs."""
  saved = jax.tree.map(np.asarray, state)
  assert all(type(leaf) is np.ndarray for leaf in jax.tree.leaves(saved))
  return jax.tree.map(
      lambda spec, subtree: jax.device_put(subtree, NamedSharding(mesh, spec)), specs, saved,
      is_leaf=lambda node: isinstance(node, P))


def train(tx, steps, *, local=False, params=None, start=0, state=None):
  """Runs ``steps`` steps; returns ``(params, state, losses, step_fn, specs)``.

  ``local=True`` trains device-local parameters (local SGD, DiLoCo, gossip, ...), else
  replicated ones with :func:`jaxcomm.optim.data_parallel_step`.
  """
  loss_fn, initial, data, mesh = problem()
  if params is None:
    # On the mesh before the first step: a step handed arrays laid out otherwise than its
    # outputs compiles a second time on the second step.
    params = (to_device_local(initial, mesh) if local
              else jax.device_put(initial, NamedSharding(mesh, P())))
  params_spec = P(AXES) if local else P()
  specs = jaxcomm.optim.state_specs(tx, params, mesh, params_spec)
  if state is None:
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, params_spec)
  make = local_training_step if local else jaxcomm.optim.data_parallel_step
  step = make(loss_fn, tx, mesh, specs)
  losses = []
  for i in range(start, start + steps):
    params, state, loss = step(params, state, batch(data, i))
    losses.append(float(loss))
  return params, state, losses, step, specs


def consensus(params, local):
  """The model every device agrees on: the device mean for device-local parameters."""
  _, _, _, mesh = problem()
  return jaxcomm._src.optim.local_training.device_mean(params, mesh) if local else params


@functools.cache
def sync_sgd(learning_rate, steps):
  """The baseline: synchronous data-parallel SGD at full precision, run once per session for
  each ``(learning_rate, steps)`` (tests only read it)."""
  return train(optax.chain(jaxcomm.compressed_allreduce(), optax.sgd(learning_rate)), steps)


def eval_loss(params, local=False):
  loss_fn, _, data, _ = problem()
  return float(loss_fn(consensus(params, local), batch(data, 0)))
