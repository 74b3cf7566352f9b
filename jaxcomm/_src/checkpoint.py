"""The implementation of :mod:`jaxcomm.checkpoint` (private: import that module)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxcomm._src.collectives.strategies import TwoPhaseState
from jaxcomm._src.compress.error_feedback import ErrorFeedbackState, EstimateFeedbackState
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.compressed_allreduce import CompressedAllReduceState
from jaxcomm._src.optim.periodic import PeriodicState
from jaxcomm._src.optim.zero_one_adam import ZeroOneAdamState
from jaxcomm._src.optim.sharding import sharded_init, state_specs

try:
  import orbax.checkpoint as ocp
except ImportError:  # The error is raised where a checkpoint is first used.
  ocp = None

__all__ = ["CorruptCheckpointError", "abstract_state", "all_steps", "latest_step", "restore",
           "save", "verify"]

MANIFEST = "jaxcomm_manifest.json"
FORMAT = 1
RESIDUAL_RULES = ("sum", "reset")
_PARTIAL = re.compile(r"^\d+\.partial")


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


def abstract_state(tx: optax.GradientTransformation, params, mesh: Mesh,
                   params_spec: PartitionSpec = PartitionSpec()):
  """The restore target of ``tx``'s state: ``jax.ShapeDtypeStruct`` s with their shardings.

  Traces ``tx.init`` inside ``shard_map`` as :func:`jaxcomm.optim.sharded_init` runs it, without
  computing, and attaches ``NamedSharding(mesh, spec)`` from :func:`jaxcomm.optim.state_specs`:
  device-local leaves (residuals) come back sharded over the devices, the rest replicated.

  Args:
    tx: the optimizer, e.g. an ``optax.chain`` starting with ``compressed_allreduce``.
    params: parameters (arrays or ``jax.ShapeDtypeStruct``), as passed to the train step.
    mesh: the mesh to restore onto. On another shape than the saving run's, pass ``tx`` and
      ``params`` to :func:`restore` as well, so the residuals are mapped.
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


class CorruptCheckpointError(ValueError):
  """A checkpoint's files do not match its manifest (missing, truncated or altered)."""


def _is_primary() -> bool:
  return jax.process_index() == 0


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _fsync_directory(path: str) -> None:
  descriptor = os.open(path, os.O_RDONLY)
  try:
    os.fsync(descriptor)
  finally:
    os.close(descriptor)


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as stream:
    for block in iter(lambda: stream.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _file_records(root: str) -> dict[str, dict[str, Any]]:
  """``{relative path: {'bytes': size, 'sha256': digest}}`` of every file under ``root``."""
  records = {}
  for folder, _, names in os.walk(root):
    for name in names:
      path = os.path.join(folder, name)
      records[os.path.relpath(path, root)] = {"bytes": os.path.getsize(path),
                                              "sha256": _sha256(path)}
  return dict(sorted(records.items()))


def _write_json(path: str, value) -> None:
  """Writes ``value`` as JSON at ``path`` all at once: a temporary file, fsync, rename."""
  temporary = f"{path}.tmp"
  with open(temporary, "w") as stream:
    json.dump(value, stream, indent=1)
    stream.flush()
    os.fsync(stream.fileno())
  os.replace(temporary, path)


def _mesh_axes(tree) -> dict[str, int] | None:
  """``{axis: size}`` of the mesh the tree's arrays are laid out on (None if none is)."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return {str(axis): int(size) for axis, size in sharding.mesh.shape.items()}
  return None


def _remove_leftovers(directory: str) -> None:
  """Deletes what saves killed midway left: ``<step>.partial`` (and orbax's temporaries)."""
  for name in os.listdir(directory):
    if _PARTIAL.match(name):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def save(directory, step: int, state, *, max_to_keep: int | None = None) -> None:
  """Writes ``state`` as checkpoint ``step`` under ``directory``; returns once it is on disk.

  Every process calls it with the same arguments; each writes the shards it holds. The
  checkpoint becomes visible only when complete: orbax writes ``<step>.partial``, process 0
  then records every file's size and SHA-256 in ``jaxcomm_manifest.json`` (written to a
  temporary name and renamed) and renames the directory to ``<step>`` (fsync'ed). A process
  killed at any point leaves either no checkpoint ``step`` or a complete one; earlier ones are
  untouched, and the next save removes the leftovers. Hashing reads the checkpoint once more.

  Args:
    directory: the checkpoint root; created if missing.
    step: the training step the state belongs to, >= 0.
    state: any pytree of ``jax.Array`` / numpy arrays / Python scalars (``None`` and empty
      containers allowed; raw or typed PRNG keys), e.g.
      ``{'params': params, 'opt_state': opt_state}``. The mesh of its arrays is recorded,
      so a restore on another mesh shape can map device-local residuals (:func:`restore`).
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
  if step in all_steps(directory):
    raise ValueError(f"step {step} is already checkpointed in {directory}.")
  final = os.path.join(directory, str(step))
  partial = f"{final}.partial"
  if _is_primary():
    os.makedirs(directory, exist_ok=True)
    _remove_leftovers(directory)
  _barrier(f"jaxcomm_checkpoint_begin_{step}")
  _orbax().Checkpointer(ocp.StandardCheckpointHandler()).save(
      partial, args=ocp.args.StandardSave(state))
  if _is_primary():
    _write_json(os.path.join(partial, MANIFEST),
                {"format": FORMAT, "step": step, "mesh": _mesh_axes(state),
                 "files": _file_records(partial)})
    os.rename(partial, final)
    _fsync_directory(directory)
    for old in all_steps(directory)[:-max_to_keep] if max_to_keep else ():
      shutil.rmtree(os.path.join(directory, str(old)))
  _barrier(f"jaxcomm_checkpoint_end_{step}")


def all_steps(directory) -> list[int]:
  """The complete checkpoints under ``directory``, ascending (empty if there are none)."""
  directory = _check_directory(directory)
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and os.path.isfile(os.path.join(directory, name, MANIFEST)))


def latest_step(directory) -> int | None:
  """The most recent complete checkpoint under ``directory``, or ``None``."""
  steps = all_steps(directory)
  return steps[-1] if steps else None


def _read_manifest(path: str, step: int) -> dict[str, Any]:
  manifest_path = os.path.join(path, MANIFEST)
  try:
    with open(manifest_path) as stream:
      manifest = json.load(stream)
    if not isinstance(manifest["files"], dict):
      raise TypeError("'files' is not a mapping")
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise CorruptCheckpointError(f"checkpoint step {step} is corrupt: its manifest "
                                 f"{manifest_path} cannot be read ({error}).") from None
  return manifest


def verify(directory, step: int) -> dict[str, Any]:
  """Checks checkpoint ``step`` against its manifest; returns the manifest.

  Raises:
    CorruptCheckpointError: naming the step and the first file that is missing, has another
      size or another SHA-256 than the manifest records (or the manifest itself, unreadable).
  """
  path = os.path.join(_check_directory(directory), str(_check_step("step", step)))
  manifest = _read_manifest(path, step)
  files = manifest["files"]
  for name, record in files.items():
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      problem = "is missing"
    elif os.path.getsize(file) != record["bytes"]:
      problem = f"has {os.path.getsize(file)} bytes, the manifest records {record['bytes']}"
    elif _sha256(file) != record["sha256"]:
      problem = "does not have the SHA-256 the manifest records"
    else:
      continue
    raise CorruptCheckpointError(f"checkpoint step {step} is corrupt: file {file} {problem}.")
  return manifest


def _leaf_name(path) -> str:
  """``opt_state[0].level_states[1][1].residual`` for a key path of a target or metadata tree."""
  name = ""
  for key in path:
    part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
    if isinstance(part, (int, np.integer)) or str(part).isdigit():  # orbax writes "0" for 0
      name += f"[{int(part)}]"
    else:
      name += f".{part}" if name else str(part)
  return name


def _shape(leaf) -> tuple[int, ...]:
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # stored as its key data
    leaf = jax.eval_shape(jax.random.key_data, leaf)
  return tuple(leaf.shape)


def _check_matches(path: str, step: int, saved_tree, target, hint: str) -> None:
  """Raises ValueError naming every leaf where the target's structure or shapes differ.

  Dtypes may differ: orbax casts to the target's dtype.
  """
  saved = {_leaf_name(p): tuple(leaf.shape) for p, leaf
           in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
  wanted = {_leaf_name(p): _shape(leaf) for p, leaf
            in jax.tree_util.tree_flatten_with_path(target)[0]}
  problems = [f"{name} is in the target but not in the checkpoint"
              for name in sorted(wanted.keys() - saved.keys())]
  problems += [f"{name} is in the checkpoint but not in the target"
               for name in sorted(saved.keys() - wanted.keys())]
  problems += [f"{name} has shape {saved[name]} in the checkpoint, {wanted[name]} in the "
               f"target" for name in sorted(saved.keys() & wanted.keys())
               if saved[name] != wanted[name]]
  if problems:
    shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6
                                       else "")
    raise ValueError(f"checkpoint step {step} ({path}) does not match the target at "
                     f"{len(problems)} leaves: {shown}.{hint}")


def _abstract(leaf):
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


def _target_mesh(target) -> Mesh | None:
  for leaf in jax.tree.leaves(target):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def restore(directory, target, *, step: int | None = None, tx=None, params=None,
            params_spec: PartitionSpec = PartitionSpec(), residuals: str = "sum",
            shard_over: str | None = None, verify_files: bool = True) -> Any:
  """Reads checkpoint ``step`` (default: the newest good one) laid out like ``target``.

  Every process calls it; each reads the shards its devices hold. Each file is first checked
  against the checkpoint's manifest (size and SHA-256). Without ``step``, a corrupt checkpoint
  is reported with a warning naming its step and file and the next older one is used.

  **Another mesh shape** (e.g. saved on 2 hosts x 4, restored on 4 x 2 or 1 x 8): parameters
  and replicated optimizer state are resharded by orbax. The device-local error-feedback
  residuals of :func:`jaxcomm.compressed_allreduce` have a layout that depends on the mesh;
  pass ``tx`` and ``params`` (as to :func:`abstract_state`) and they follow ``residuals``:
  ``'sum'``: for every gradient element, the residual mass each old host held is added into new
  host ``h mod H'`` (two-phase server residuals move to the element's new owner), so the sum
  over hosts of what is pending is exactly conserved; ``'reset'``: zero residuals (the mass
  pending at the checkpoint is dropped). Other per-level state (a compressor's own state, e.g.
  PowerSGD factors) restarts from ``tx.init``; EF21
  estimates restart at zero together with their mean (``estimates``). Needs the
  two-level topology (dense fast axis, compressed slow axis) on a ``jaxcomm.make_mesh`` mesh
  (``('host', 'local')``, slow axis first). On one host (``H' = 1``) no level is compressed:
  the summed residuals are kept but never sent.

  **Sharded data parallelism** (the :class:`~jaxcomm.TrainState` of
  ``data_parallel(..., shard_over=axis)`` as ``target``, ``trainer.init(params)``): pass
  ``shard_over=axis`` with ``tx`` and the full ``params`` too. Each flat leaf of a
  ``d``-element parameter (parameters, Adam moments) was saved padded to ``G ceil(d/G)``; its
  first ``d`` entries are restored, zero-padded to ``G' ceil(d/G')``; a leaf split along a
  dimension keeps its shape and its moments are re-cut. The residuals follow ``residuals`` as
  above, each parameter leaf being one bucket (with ``bucket_bytes=``, only ``'reset'``).
  Per-host parameters (the periodic engine under ``shard_over``: local SGD, DiLoCo, SlowMo,
  BMUF, FedAvg) restore as the mean of the saved hosts' models, the same on every new host,
  and so does every per-host leaf of the inner optimizer's state (e.g. its Adam moments);
  the anchor and the outer state are replicated over hosts and follow the flat rule, and
  per-host residuals (SparseLoCo's error buffers) follow ``residuals``. 0/1 Adam's per-host
  parameters, momentum and anchor likewise restore as the hosts' mean (its variance is
  replicated over hosts: the flat rule); its two-phase residuals only with
  ``residuals='reset'``.
  docs/hsdp.md, "Checkpoints".

  Args:
    directory: the checkpoint root given to :func:`save`.
    target: the structure, shapes, dtypes and shardings to restore into: arrays (e.g. a
      fresh ``sharded_init`` state) or ``jax.ShapeDtypeStruct`` with ``sharding`` set (e.g.
      :func:`abstract_state`). Leaves without a sharding are restored on the default device.
    step: which checkpoint; ``None`` for the newest good one.
    tx: the optimizer, to map residuals saved on another mesh shape (see above).
    params: parameters or their shapes, as given to :func:`abstract_state`; with ``tx``.
    params_spec: the ``in_specs`` entry of ``params`` (default replicated); with ``tx``.
    residuals: ``'sum'`` or ``'reset'``, for a restore on another mesh shape.
    shard_over: ``None``, or the axis a ``data_parallel(..., shard_over=)`` state is sharded
      over (with ``tx`` and ``params``), for a restore on another mesh shape.
    verify_files: check every file's SHA-256 against the manifest first.

  Returns:
    The saved pytree, with ``target``'s structure and each leaf's sharding.

  Raises:
    FileNotFoundError: if there is no such checkpoint; the message lists the steps there are.
    CorruptCheckpointError: if checkpoint ``step`` (or, without ``step``, every one) is corrupt;
      the message names the step and the file.
    ValueError: if the checkpoint does not match ``target``: the message names each leaf whose
      structure, shape or dtype differs (e.g. another method or model shape).
  """
  directory = _check_directory(directory)
  if residuals not in RESIDUAL_RULES:
    raise ValueError(f"residuals must be one of {', '.join(RESIDUAL_RULES)}; got {residuals!r}.")
  if shard_over is not None and not isinstance(shard_over, str):
    raise ValueError(f"shard_over must be None or the name of the mesh axis the state is "
                     f"sharded over (as given to data_parallel); got {shard_over!r}.")
  if (tx is None) != (params is None):
    raise ValueError("tx and params go together (as for abstract_state): got "
                     f"tx={'set' if tx is not None else None}, "
                     f"params={'set' if params is not None else None}.")
  steps = all_steps(directory)
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {directory}.")
  if step is not None and _check_step("step", step) not in steps:
    raise FileNotFoundError(f"no checkpoint for step {step} under {directory}; "
                            f"checkpointed steps: {steps}.")
  error = None
  for candidate in [step] if step is not None else steps[::-1]:
    try:
      manifest = (verify(directory, candidate) if verify_files else
                  _read_manifest(os.path.join(directory, str(candidate)), candidate))
    except CorruptCheckpointError as corrupt:
      if step is not None:
        raise
      warnings.warn(f"{corrupt} Using an older checkpoint.", stacklevel=2)
      error = corrupt
      continue
    return _restore_step(os.path.join(directory, str(candidate)), candidate, manifest, target,
                         (tx, params, params_spec, residuals, shard_over))
  raise CorruptCheckpointError(f"every checkpoint under {directory} is corrupt; the oldest: "
                               f"{error}")


def _restore_step(path: str, step: int, manifest, target, elastic) -> Any:
  checkpointer = _orbax().Checkpointer(ocp.StandardCheckpointHandler())
  saved_tree = checkpointer.metadata(path).item_metadata.tree
  saved_mesh, mesh = manifest.get("mesh"), _target_mesh(target)
  tx, params, params_spec, residuals, shard_over = elastic
  moved = saved_mesh is not None and mesh is not None and saved_mesh != dict(mesh.shape)
  layout = None
  if moved and tx and shard_over is not None:
    layout = _ShardedLayout(tx, params, shard_over, saved_mesh, target)
  elif moved and tx:
    layout = _Layout.replicated(tx, params, params_spec, saved_mesh, mesh)
  hint = (f" (saved on mesh {saved_mesh}, the target is on {dict(mesh.shape)}: pass tx= and "
          f"params= to map compressed_allreduce's device-local residuals, and shard_over= for "
          f"the state of data_parallel(..., shard_over=).)" if moved and not tx else "")
  read = layout.saved_target(target) if layout else target
  _check_matches(path, step, saved_tree, read, hint)
  restored = checkpointer.restore(path, args=ocp.args.StandardRestore(
      jax.tree.map(_abstract, read)))
  return layout.mapped(restored, residuals) if layout else restored


def _is_allreduce_state(node) -> bool:
  return isinstance(node, CompressedAllReduceState)


def _allreduce_states(tree) -> list[CompressedAllReduceState]:
  return [node for node in jax.tree.leaves(tree, is_leaf=_is_allreduce_state)
          if _is_allreduce_state(node)]


def _replace_allreduce_states(tree, replacements):
  replacements = iter(replacements)
  return jax.tree.map(lambda node: next(replacements) if _is_allreduce_state(node) else node,
                      tree, is_leaf=_is_allreduce_state)


def _abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
  return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def _traced_state(tx, params, params_spec, sizes: dict[str, int]):
  """``tx.init``'s state shapes on a mesh of ``sizes`` (an abstract mesh: no devices needed)."""
  mesh = _abstract_mesh(sizes)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  specs = state_specs(tx, abstract, mesh, params_spec)
  return jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(params_spec,),
                                      out_specs=specs), abstract)


def _fold_hosts(mass: jax.Array, hosts: int) -> jax.Array:
  """``(H, s) -> (hosts, s)``: old host ``h``'s mass added into new host ``h mod hosts``."""
  padded = jnp.pad(mass, ((0, -mass.shape[0] % hosts), (0, 0)))
  return padded.reshape(-1, hosts, mass.shape[1]).sum(axis=0)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _moved_residual(old: jax.Array, kind: str, saved: tuple[int, int], new: tuple[int, int],
                    elements: int, new_length: int) -> jax.Array:
  """A residual laid out for mesh ``saved = (H, G)`` re-laid out for ``new = (H', G')``.

  ``kind``: ``'flat'`` (error feedback of a gather/linear level: per device the ``L = ceil(s/G)``
  elements of its fast-axis shard), ``'worker'`` (two-phase: that shard padded to ``H`` chunks)
  or ``'server'`` (two-phase: chunk ``h`` of the shard, owned by host ``h``). ``elements`` is
  the bucket's gradient size ``s``; ``new_length`` the per-device length on the new mesh.
  Returns the new global ``(H' G' new_length,)`` array, float32.
  """
  (hosts, local), (new_hosts, new_local) = saved, new
  shard, new_shard = -(-elements // local), -(-elements // new_local)
  old = old.astype(jnp.float32).reshape(hosts, local, -1)
  if kind == "server":
    full = jnp.transpose(old, (1, 0, 2)).reshape(local, -1)[:, :shard].reshape(-1)[:elements]
    full = jnp.pad(full, (0, new_local * new_shard - elements)).reshape(new_local, new_shard)
    chunks = jnp.pad(full, ((0, 0), (0, new_length * new_hosts - new_shard)))
    return jnp.transpose(chunks.reshape(new_local, new_hosts, new_length), (1, 0, 2)).reshape(-1)
  mass = _fold_hosts(old[:, :, :shard].reshape(hosts, -1)[:, :elements], new_hosts)
  mass = jnp.pad(mass, ((0, 0), (0, new_local * new_shard - elements)))
  mass = mass.reshape(new_hosts, new_local, new_shard)
  return jnp.pad(mass, ((0, 0), (0, 0), (0, new_length - new_shard))).reshape(-1)


def _check_two_axes(saved_mesh: dict[str, int], mesh: Mesh) -> None:
  if tuple(saved_mesh) != tuple(mesh.axis_names) or len(saved_mesh) != 2:
    raise ValueError(f"mapping residuals to another mesh shape needs the same two mesh axes "
                     f"(slow, fast) on both: saved {saved_mesh}, target {dict(mesh.shape)}.")


class _Layout:
  """compressed_allreduce's level states on the saved mesh and on the target mesh.

  ``saved``, ``elements`` and ``fresh``: the :class:`CompressedAllReduceState` s of ``tx`` traced
  on the saved mesh, on a mesh of one device (each bucket's gradient size) and initialized on
  the target mesh. ``blocks``: per bucket, ``None`` (device ``i``'s residual covers the
  bucket's contiguous elements ``[i n, (i+1) n)``) or ``(shape, dim)``: the bucket is a leaf of
  ``shape`` split along ``dim > 0`` (:func:`_split_order`).
  """

  def __init__(self, saved, elements, fresh, saved_mesh: dict[str, int], mesh: Mesh,
               blocks: tuple = ()):
    _check_two_axes(saved_mesh, mesh)
    self.mesh, self.saved_sizes = mesh, tuple(saved_mesh.values())
    self.sizes = tuple(mesh.shape.values())
    self.saved, self.elements, self.fresh, self.blocks = saved, elements, fresh, blocks

  @classmethod
  def replicated(cls, tx, params, params_spec, saved_mesh: dict[str, int], mesh: Mesh):
    zeros = jax.tree.map(lambda p: np.zeros(p.shape, p.dtype), params)
    return cls(_allreduce_states(_traced_state(tx, params, params_spec, saved_mesh)),
               _allreduce_states(_traced_state(tx, params, params_spec,
                                               dict.fromkeys(saved_mesh, 1))),
               _allreduce_states(sharded_init(tx, zeros, mesh, params_spec)[0]), saved_mesh,
               mesh)

  def _placement(self, shape) -> NamedSharding:
    spread = len(shape) > 0 and shape[0] % self.mesh.size == 0
    return NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names) if spread
                         else PartitionSpec())

  def saved_target(self, target):
    """``target`` with every compressed_allreduce level state in its saved shapes."""
    nodes = _allreduce_states(target)
    if len(nodes) != len(self.saved):
      raise ValueError(f"the target holds {len(nodes)} compressed_allreduce states, tx "
                       f"{len(self.saved)}: pass the tx the target was built with.")
    return _replace_allreduce_states(target, [node._replace(level_states=jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._placement(s.shape)),
        saved.level_states)) for node, saved in zip(nodes, self.saved)])

  def mapped(self, restored, residuals: str):
    """``restored`` (saved shapes) with its level states laid out for the target mesh. A
    bucket with EF21 estimates restarts them, and their mean in ``estimates`` with them, so
    the mean stays the mean of the devices' estimates."""
    nodes = []
    for node, fresh, units in zip(_allreduce_states(restored), self.fresh, self.elements):
      blocks = (self.blocks if len(self.blocks) == len(node.level_states)
                else (None,) * len(node.level_states))
      levels = tuple(self._bucket(old, new, unit, residuals, block) for old, new, unit, block
                     in zip(node.level_states, fresh.level_states, units.level_states, blocks))
      estimates = tuple(
          new if any(isinstance(state, EstimateFeedbackState) for state in bucket) else old
          for old, new, bucket in zip(node.estimates, fresh.estimates, fresh.level_states))
      nodes.append(node._replace(level_states=levels, estimates=estimates))
    return _replace_allreduce_states(restored, nodes)

  def _move(self, old, new, kind: str, elements: int, block=None) -> jax.Array:
    length = new.shape[0] // self.mesh.size
    if block is not None:
      old = _split_order(old, self.saved_sizes, *block, True)
    moved = _moved_residual(old, kind, self.saved_sizes, self.sizes, elements, length)
    if block is not None:
      moved = _split_order(moved, self.sizes, *block, False)
    return jax.device_put(moved.astype(new.dtype), new.sharding)

  def _bucket(self, old: tuple, new: tuple, unit: tuple, residuals: str, block=None) -> tuple:
    if residuals == "reset":
      return new
    if len(old) != 2 or old[0] != ():
      raise ValueError(f"residuals='sum' maps the two-level topology (dense fast axis, "
                       f"compressed slow axis); this state has {len(old)} levels: restore on "
                       f"the saved mesh shape or pass residuals='reset'.")
    old, new, unit = old[1], new[1], unit[1]
    if isinstance(old, ErrorFeedbackState):
      return (), new._replace(residual=self._move(old.residual, new.residual, "flat",
                                                  unit.residual.shape[0], block))
    if isinstance(old, TwoPhaseState) and block is not None:
      raise ValueError(f"residuals='sum' maps two-phase residuals of flat shards; a leaf of "
                       f"shape {block[0]} split along dimension {block[1]} has them: restore "
                       "on the saved mesh shape or pass residuals='reset'.")
    if isinstance(old, TwoPhaseState):
      elements = unit.worker_residual.shape[0]
      return (), TwoPhaseState(
          self._move(old.worker_residual, new.worker_residual, "worker", elements),
          self._move(old.server_residual, new.server_residual, "server", elements))
    return (), new


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _split_order(residual: jax.Array, sizes: tuple[int, int], shape: tuple, dim: int,
                 to_moved: bool) -> jax.Array:
  """Every device's residual of a leaf of ``shape`` split along ``dim`` over the fast axis of
  a ``sizes = (H, G)`` mesh, from the block's own row-major order to the order of the block
  with ``dim`` moved first (``to_moved``), or back. In the moved order device ``i``'s block
  is elements ``[i n, (i+1) n)`` of the leaf with ``dim`` moved first, ``n = d/G``: the
  layout of a flat shard, which :func:`_moved_residual` maps. ``residual``: ``(H G n,)``."""
  hosts, local = sizes
  block = list(shape)
  block[dim] //= local
  if to_moved:
    return jnp.moveaxis(residual.reshape(hosts * local, *block), 1 + dim, 1).reshape(-1)
  moved = [block[dim]] + block[:dim] + block[dim + 1:]
  return jnp.moveaxis(residual.reshape(hosts * local, *moved), 1, 1 + dim).reshape(-1)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _restacked(stacked: jax.Array, shape: tuple, dim: int, local: int,
               new_local: int) -> jax.Array:
  """Optimizer state of a leaf of ``shape`` split along ``dim``, kept as the devices' blocks
  stacked along the first dimension (``jaxcomm.optim.state_specs``' layout of a device-local
  leaf: ``(G shape[0], ...)`` for ``dim > 0``), re-cut for ``new_local`` devices."""
  block = list(shape)
  block[dim] //= local
  full = jnp.concatenate(list(stacked.reshape(local, *block)), axis=dim)
  return jnp.concatenate(jnp.split(full, new_local, axis=dim), axis=0)


@functools.partial(jax.jit, static_argnums=(1, 2), static_argnames="sharding")
def _repadded(flat: jax.Array, elements: int, length: int, *, sharding) -> jax.Array:
  """The first ``elements`` entries of ``flat``, zero-padded to ``length``, on ``sharding``."""
  return jax.lax.with_sharding_constraint(jnp.pad(flat[:elements], (0, length - elements)),
                                          sharding)


def _split_dims(target, axis: str, saved_mesh: dict[str, int]) -> tuple[tuple, bool]:
  """``(dims, per_host)``: per parameter leaf of ``target``, ``None`` (a flat shard) or the
  dimension split over ``axis``; and whether the parameters are per host (the periodic
  engine's or 0/1 Adam's workers). Refuses a target that is not a ``TrainState``."""
  if not (hasattr(target, "params") and hasattr(target, "opt_state")):
    raise ValueError("restore(..., shard_over=) reads a jaxcomm.TrainState (the state of "
                     "data_parallel(..., shard_over=)); pass trainer.init(params) as target, "
                     f"got {type(target).__name__}.")
  if axis not in saved_mesh:
    raise ValueError(f"shard_over={axis!r} is not an axis of the saved mesh {saved_mesh}.")
  per_host = False
  for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
    spec = getattr(getattr(leaf, "sharding", None), "spec", ())
    per_host = per_host or bool(len(spec) and isinstance(spec[0], tuple) and len(spec[0]) > 1)
  # A 1-D leaf split along its only dimension is laid out as a flat shard is.
  return tuple(None if len(leaf.shape) == 1 else
               next(i for i, entry in enumerate(leaf.sharding.spec) if entry == axis)
               for leaf in jax.tree.leaves(target.params)), per_host


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4), static_argnames="sharding")
def _host_mean(flat: jax.Array, hosts: int, elements: int, length: int, new_hosts: int, *,
               sharding) -> jax.Array:
  """A per-host flat leaf (``hosts`` rows) as the mean of its rows, its first ``elements``
  entries kept, zero-padded to ``length`` and tiled for ``new_hosts``, on ``sharding``."""
  mean = jnp.mean(flat.reshape(hosts, -1), axis=0)[:elements]
  return jax.lax.with_sharding_constraint(
      jnp.tile(jnp.pad(mean, (0, length - elements)), new_hosts), sharding)


class _ShardedLayout:
  """A ``data_parallel(..., shard_over=axis)`` :class:`~jaxcomm.TrainState` saved on one mesh
  shape, laid out for ``target``'s.

  Every flat leaf (parameters and the optimizer state shaped like them, e.g. Adam moments)
  of a ``d``-element parameter was saved zero-padded to ``G ceil(d/G)``: its first ``d``
  entries are kept and zero-padded to ``G' ceil(d/G')`` (what lies beyond ``d`` is padding the
  loss never reads). A parameter split along a dimension keeps its shape on every mesh (the
  target's ``G'`` divides it) and is resharded as it is; optimizer state shaped like its
  block (Adam moments) is stored as the devices' blocks stacked along the first dimension
  and is re-cut (:func:`_restacked`).
  compressed_allreduce's level states follow ``residuals`` by :class:`_Layout`: device
  ``(h, i)``'s slow-level residual covers elements ``[i n, (i+1) n)``, ``n = ceil(d/G)``, of
  host ``h``'s leaf (of the leaf with its split dimension moved first, for a split leaf),
  which is the replicated path's layout after its reduce-scatter with the leaf as the bucket.
  Per-host parameters (the periodic engine's hosts as workers, ``P((slow, axis))``) and the
  per-host leaves of the inner optimizer's state (its moments) restore as the mean over the
  saved hosts, the same on every new host (:func:`_host_mean`); per-host residuals (e.g.
  SparseLoCo's error buffers) follow ``residuals``, as PowerSGD's do.
  """

  def __init__(self, tx, params, axis: str, saved_mesh: dict[str, int], target):
    dims, self.per_host = _split_dims(target, axis, saved_mesh)
    self.mesh, self.target, self.axis = _target_mesh(target), target, axis
    leaves, self.treedef = jax.tree.flatten(params)
    shapes = tuple(tuple(jnp.shape(leaf)) for leaf in leaves)
    slow = tuple(a for a in saved_mesh if a != axis)
    layout = hsdp.ShardLayout(shapes, axis, dims, slow if self.per_host else ())
    self.leaves = [(math.prod(shape), jnp.result_type(leaf), shape, dim)
                   for leaf, shape, dim in zip(leaves, shapes, dims)]
    self.tx = hsdp.on_shards(tx, layout)
    self.spec = hsdp.layout_specs(self._shards(1, 1), layout)
    self.saved_group, self.saved_hosts = saved_mesh[axis], math.prod(saved_mesh[a] for a in slow)
    self.hosts = self.mesh.size // self.mesh.shape[axis]
    saved_shards = self._shards(self.saved_hosts, self.saved_group)
    self.saved = _traced_state(self.tx, saved_shards, self.spec, saved_mesh)
    self.saved_specs = state_specs(self.tx, saved_shards, _abstract_mesh(saved_mesh), self.spec)
    if jax.tree.structure(self.saved) != jax.tree.structure(target.opt_state):
      raise ValueError(
          f"shard_over={axis!r}: tx's state has another structure on the saved mesh "
          f"{saved_mesh} than on the target mesh {dict(self.mesh.shape)} (e.g. PowerSGD "
          "factorizes a leaf whose columns split over one fast-axis size but not the other, "
          "and sends it dense there): restore onto a mesh whose fast axis splits the same "
          "leaves.")
    self.unit = _traced_state(self.tx, self._shards(1, 1), self.spec,
                              dict.fromkeys(saved_mesh, 1))
    zeros = jax.tree.map(lambda p: np.zeros(p.shape, p.dtype),
                         self._shards(self.hosts, self.mesh.shape[axis]))
    fresh = sharded_init(self.tx, zeros, self.mesh, self.spec)[0]
    blocks = tuple((shape, dim) if dim else None for shape, dim in zip(shapes, dims))
    # Saved shape of a split leaf's stacked blocks -> (leaf shape, split dimension).
    self.stacked = {(self.saved_group * shape[0], *shape[1:dim], shape[dim] // self.saved_group,
                     *shape[dim + 1:]): (shape, dim) for shape, dim in zip(shapes, dims) if dim}
    self.allreduce = _Layout(_allreduce_states(self.saved), _allreduce_states(self.unit),
                             _allreduce_states(fresh), saved_mesh, self.mesh, blocks)

  def _shards(self, hosts: int, group: int):
    """Abstract parameter shards on a fast axis of ``group`` devices: flat (one copy per host
    of ``hosts`` when per host), or full-shaped."""
    copies = hosts if self.per_host else 1
    return self.treedef.unflatten([
        jax.ShapeDtypeStruct((copies * group * -(-size // group),) if dim is None else shape,
                             dtype)
        for size, dtype, shape, dim in self.leaves])

  def _host_mean(self, value, elements: int, target) -> jax.Array:
    """A per-host flat leaf: the mean over the saved hosts, laid out like ``target``."""
    return _host_mean(value, self.saved_hosts, elements, target.shape[0] // self.hosts,
                      self.hosts, sharding=target.sharding)

  def saved_target(self, target):
    place = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                           sharding=self.allreduce._placement(s.shape))
    saved_shards = self._shards(self.saved_hosts, self.saved_group)
    return target._replace(params=jax.tree.map(place, saved_shards),
                           opt_state=jax.tree.map(place, self.saved))

  def _leaf(self, residuals: str, value, saved, saved_spec, target, inner: bool):
    """One leaf laid out like ``target``. A 1-D leaf sharded over the axis on the saved mesh is
    a flat shard of some parameter of ``d`` elements, saved with ``L >= d`` entries per host
    and wanted with ``L' >= d``: replicated over the slow axis (parameters, Adam moments), its
    first ``min(L, L')`` entries are kept and zero-padded; per host and ``inner`` (the
    periodic engine's inner optimizer state or 0/1 Adam's momentum and anchor beside per-host
    parameters, :data:`_HOST_MEAN_FIELDS`), the mean of the
    hosts' first ``min(L, L')`` entries, zero-padded, on every new host; per host otherwise
    (PowerSGD's residual, SparseLoCo's error buffer) it is mapped by ``residuals`` as an
    error-feedback residual of ``min(L, L')`` elements (:func:`_moved_residual`); either way
    the ``d`` real entries are exact. A
    compressed_allreduce state (mapped already) or any other leaf is kept as it is (e.g.
    PowerSGD's ``Q``, replicated over hosts: its rows are re-sharded)."""
    if _is_allreduce_state(value):
      return value
    sharding = getattr(target, "sharding", None)
    over = saved_spec[0] if len(saved_spec) else None
    over = over if isinstance(over, tuple) else (over,)
    if over == (self.axis,) and tuple(saved.shape) in self.stacked:
      value = _restacked(value, *self.stacked[tuple(saved.shape)], self.saved_group,
                         self.mesh.shape[self.axis])
    if len(saved.shape) != 1 or self.axis not in over:
      return jax.device_put(value, sharding)
    if over == (self.axis,):
      kept = min(saved.shape[0], target.shape[0])
      return _repadded(value, kept, target.shape[0], sharding=sharding)
    if inner:
      kept = min(saved.shape[0] // self.saved_hosts, target.shape[0] // self.hosts)
      return self._host_mean(value, kept, target)
    if residuals == "reset":
      return jax.device_put(jnp.zeros(target.shape, target.dtype), sharding)
    (hosts, _), (new_hosts, _) = self.allreduce.saved_sizes, self.allreduce.sizes
    kept = min(saved.shape[0] // hosts, target.shape[0] // new_hosts)
    moved = _moved_residual(value, "flat", self.allreduce.saved_sizes, self.allreduce.sizes,
                            kept, target.shape[0] // self.mesh.size)
    return jax.device_put(moved.astype(target.dtype), sharding)

  def mapped(self, restored, residuals: str):
    """``restored`` (saved shapes) laid out like the target."""
    buckets = {len(node.level_states) for node in _allreduce_states(self.unit)}
    if residuals == "sum" and buckets - {len(self.leaves)}:
      raise ValueError("restore(..., shard_over=, residuals='sum') maps one residual per "
                       f"parameter leaf ({len(self.leaves)}); this compressed_allreduce packs "
                       f"{sorted(buckets)} buckets (bucket_bytes=): pass residuals='reset'.")
    if residuals == "sum" and self.per_host and _zero_one_adam(self.saved):
      raise ValueError("restore(..., shard_over=, residuals='sum') onto another mesh shape: "
                       "0/1 Adam's two-phase server residuals hold 1/H chunks of each host's "
                       "shard, whose owners change with H; no sum rule maps them: pass "
                       "residuals='reset' (its momentum and parameters restore as the hosts' "
                       "mean).")
    opt_state = self.allreduce.mapped(restored.opt_state, residuals)
    params = [jax.device_put(value, target.sharding) if dim is not None else
              self._host_mean(value, size, target) if self.per_host else
              _repadded(value, size, target.shape[0], sharding=target.sharding)
              for value, (size, _, _, dim), target in zip(
                  jax.tree.leaves(restored.params), self.leaves,
                  jax.tree.leaves(self.target.params))]
    return restored._replace(
        params=self.treedef.unflatten(params),
        opt_state=jax.tree.map(functools.partial(self._leaf, residuals), opt_state, self.saved,
                               self.saved_specs, self.target.opt_state,
                               _inner_mask(self.saved, self.per_host),
                               is_leaf=_is_allreduce_state))


def _zero_one_adam(state) -> bool:
  """Whether ``state`` holds a :class:`ZeroOneAdamState`."""
  nodes = jax.tree.leaves(state, is_leaf=lambda node: isinstance(node, ZeroOneAdamState))
  return any(isinstance(node, ZeroOneAdamState) for node in nodes)


#: Per node type, the fields restored as the hosts' mean under per-host parameters: the
#: periodic engine's inner optimizer state, 0/1 Adam's momentum and anchor.
_HOST_MEAN_FIELDS = {PeriodicState: ("inner",), ZeroOneAdamState: ("mu", "anchor")}


def _inner_mask(state, per_host: bool):
  """``state`` with every leaf ``True`` where it is restored as the hosts' mean under per-host
  parameters (:data:`_HOST_MEAN_FIELDS`), else ``False``."""
  typed = lambda node: isinstance(node, tuple(_HOST_MEAN_FIELDS))
  return jax.tree.map(
      lambda node: (node._replace(**{
          field: jax.tree.map(lambda _: per_host and field in _HOST_MEAN_FIELDS[type(node)],
                              getattr(node, field)) for field in node._fields})
                    if typed(node) else False), state, is_leaf=typed)
