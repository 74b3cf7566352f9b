"""Saving and restoring training state with orbax, device-local communication state included.

A long run must not lose what compression has not sent yet: the error-feedback residuals
(worker and server), PowerSGD warm starts, PRNG keys and counters of
:func:`jaxcomm.compressed_allreduce`, next to the parameters and the state of the optax
transformations chained after it. They are ordinary pytrees of ``jax.Array``, partly
device-local (sharded along their first dimension, see :func:`jaxcomm.sharded_init`), so
orbax writes each shard from the process that holds it (tensorstore/OCDBT files, JSON
metadata; nothing is pickled) and reads it back onto the same layout.

Restoring needs a *target*: the pytree structure, shapes, dtypes and shardings of the state.
:func:`abstract_state` builds it from the optimizer without computing anything; any pytree
of arrays laid out as wanted (e.g. a fresh ``sharded_init``) serves as well. Every process of
a multi-process job calls these functions together, with the same directory (a file system
all processes see).

Requires the optional dependency ``orbax-checkpoint`` (``pip install jaxcomm[checkpoint]``).

Example:
  >>> opt_state, specs = jaxcomm.sharded_init(tx, params, mesh)  # doctest: +SKIP
  >>> jaxcomm.checkpoint.save(directory, step, {'params': params, 'opt': opt_state})  # doctest: +SKIP
  >>> target = {'params': params, 'opt': jaxcomm.checkpoint.abstract_state(tx, params, mesh)}  # doctest: +SKIP
  >>> state = jaxcomm.checkpoint.restore(directory, target)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomm.optim.sharding import state_specs

try:
  import orbax.checkpoint as ocp
except ImportError:  # The error is raised where a checkpoint is first used.
  ocp = None


def _orbax():
  if ocp is None:
    raise ImportError("jaxcomm.checkpoint needs orbax-checkpoint: pip install "
                      "'jaxcomm[checkpoint]' (or pip install orbax-checkpoint).")
  return ocp


def _check_directory(directory) -> str:
  if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
    raise TypeError(f"directory must be a non-empty path, got {directory!r}.")
  return os.path.abspath(os.fspath(directory))


def _check_step(name: str, step) -> int:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {step!r}.")
  if step < 0:
    raise ValueError(f"{name} must be >= 0, got {step}.")
  return int(step)


def _manager(directory: str, max_to_keep: int | None = None):
  orbax = _orbax()
  options = orbax.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=False)
  return orbax.CheckpointManager(directory, options=options)


def abstract_state(tx: optax.GradientTransformation, params, mesh: Mesh,
                   params_spec: PartitionSpec = PartitionSpec()):
  """The restore target of ``tx``'s state: ``jax.ShapeDtypeStruct`` s with their shardings.

  Traces ``tx.init`` inside ``shard_map`` as :func:`jaxcomm.sharded_init` runs it, without
  computing, and attaches ``NamedSharding(mesh, spec)`` from :func:`jaxcomm.state_specs`:
  device-local leaves (residuals) come back sharded over the devices, the rest replicated.

  Args:
    tx: the optimizer, e.g. an ``optax.chain`` starting with ``compressed_allreduce``.
    params: parameters (arrays or ``jax.ShapeDtypeStruct``), as passed to the train step.
    mesh: the train step's mesh; it must have the shape of the run that saved the state.
    params_spec: the ``in_specs`` entry of ``params`` (default replicated).

  Returns:
    A pytree of ``jax.ShapeDtypeStruct`` with the structure of ``tx.init(params)``.
  """
  specs = state_specs(tx, params, mesh, params_spec)
  abstract_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(params_spec,),
                                        out_specs=specs), abstract_params)
  return jax.tree.map(
      lambda shape, spec: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                               sharding=NamedSharding(mesh, spec)),
      shapes, specs)


def save(directory, step: int, state, *, max_to_keep: int | None = None) -> None:
  """Writes ``state`` as checkpoint ``step`` under ``directory``; returns once it is on disk.

  Every process calls it with the same arguments; each writes the shards it holds.

  Args:
    directory: the checkpoint root; created if missing. Checkpoint ``step`` is a
      subdirectory, written to a temporary name and renamed when complete, so a process killed
      while saving leaves the previous checkpoints intact.
    step: the training step the state belongs to, >= 0.
    state: any pytree of ``jax.Array`` / numpy arrays / Python scalars (``None`` and empty
      containers allowed; raw or typed PRNG keys), e.g.
      ``{'params': params, 'opt_state': opt_state}``.
    max_to_keep: keep only this many most recent checkpoints (``None``: all).

  Raises:
    TypeError, ValueError: for a malformed argument; the message names it.
    ValueError: if checkpoint ``step`` already exists.
  """
  directory = _check_directory(directory)
  step = _check_step("step", step)
  if max_to_keep is not None:
    _check_step("max_to_keep", max_to_keep)
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
  with _manager(directory, max_to_keep) as manager:
    if step in manager.all_steps():
      raise ValueError(f"step {step} is already checkpointed in {directory}.")
    manager.save(step, args=_orbax().args.StandardSave(state))
    manager.wait_until_finished()


def all_steps(directory) -> list[int]:
  """The checkpointed steps under ``directory``, ascending (empty if there are none)."""
  directory = _check_directory(directory)
  if not os.path.isdir(directory):
    return []
  with _manager(directory) as manager:
    return sorted(manager.all_steps())


def latest_step(directory) -> int | None:
  """The most recent checkpointed step under ``directory``, or ``None``."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def _as_abstract(leaf):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


def restore(directory, target, *, step: int | None = None) -> Any:
  """Reads checkpoint ``step`` (default: the latest) laid out like ``target``.

  Every process calls it; each reads the shards its devices hold.

  Args:
    directory: the checkpoint root given to :func:`save`.
    target: the structure, shapes, dtypes and shardings to restore into: arrays (e.g. a
      fresh ``sharded_init`` state) or ``jax.ShapeDtypeStruct`` with ``sharding`` set (e.g.
      :func:`abstract_state`). Leaves without a sharding are restored on the default device.
    step: which checkpoint; ``None`` for the latest.

  Returns:
    The saved pytree, with ``target``'s structure and each leaf's sharding.

  Raises:
    FileNotFoundError: if there is no such checkpoint; the message lists the steps there are.
    ValueError: if the checkpoint does not match ``target`` (structure, shape or dtype).
  """
  directory = _check_directory(directory)
  steps = all_steps(directory)
  if step is None:
    if not steps:
      raise FileNotFoundError(f"no checkpoint under {directory}.")
    step = steps[-1]
  step = _check_step("step", step)
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint for step {step} under {directory}; "
                            f"checkpointed steps: {steps}.")
  abstract = jax.tree.map(_as_abstract, target)
  with _manager(directory) as manager:
    try:
      return manager.restore(step, args=_orbax().args.StandardRestore(abstract))
    except (ValueError, KeyError, TypeError) as error:
      raise ValueError(f"checkpoint {step} under {directory} does not match target: "
                       f"{error}") from error
