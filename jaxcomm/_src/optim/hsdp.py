"""Hybrid sharded data parallelism (HSDP): parameters, optimizer state and residuals kept as
flat ``1/G`` shards over a host's fast axis, replicated over the slow axes.

Each parameter leaf of ``d`` elements is flattened and zero-padded to ``G * ceil(d/G)``; device
``i`` of the fast axis holds elements ``[i n, (i+1) n)``, ``n = ceil(d/G)``. The padding is
exact: the padded entries never reach the loss, so their gradient is 0 and every elementwise
optimizer (SGD, momentum, Adam/AdamW, weight decay) keeps them at 0. Inside the step
(:func:`jaxcomm.data_parallel` with ``shard_over=``) each leaf is all-gathered over the fast
axis where the loss uses it (``(G-1)/G * 4d`` bytes per device), and ``jax.grad`` transposes
that all-gather into a reduce-scatter (``(G-1)/G * 4d``): every device receives its host's
summed gradient of exactly its shard. ``tx`` then runs on the host's mean gradient shard
inside :func:`jaxcomm.collectives.prescattered` (:func:`on_shards`), so
:func:`jaxcomm.compressed_allreduce` only crosses the slow axes with the ``1/G`` shard and no
full gradient is ever all-gathered.

ZeRO-3 / FSDP: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020; hybrid sharding: Zhao et al., "PyTorch FSDP", VLDB 2023.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxcomm._src.collectives.hierarchical import prescattered
from jaxcomm._src.collectives.powersgd import PowerSGDLeafState
from jaxcomm._src.compress.powersgd import (PRECISION, back_project, compression_rate, initial_q,
                                            matrix_shape, orthogonalize, project)
from jaxcomm._src.keys import nth_key
from jaxcomm._src.mesh_axes import manual_axes, vary, vary_tree
from jaxcomm._src.nonfinite import any_nonfinite, keep_if
from jaxcomm._src.optim.sharding import sharded_init, state_specs

# Collectives as jaxpr primitives, with the parameter naming their axes.
_COLLECTIVES = {"psum": "axes", "pmax": "axes", "pmin": "axes", "all_gather": "axis_name",
                "all_gather_invariant": "axis_name", "reduce_scatter": "axis_name",
                "psum_scatter": "axis_name", "ppermute": "axis_name", "all_to_all": "axis_name",
                "psum_invariant": "axes"}
# State types of transformations that cannot run on shards, and why.
_NEEDS_SHAPE = {"FactoredState": "optax.adafactor, whose factored second moments need the "
                                 "matrix, which flat shards lose",
                "LeafAllReduceState": "a whole-leaf matrix compressor (e.g. gradzip), whose "
                                      "basis needs the matrix, which flat shards lose"}
# The name scope of code that computes exactly on shards (shard_aware): its collectives over the
# sharded axis (PowerSGD's column-block products) and its operations that combine a shard's
# elements (a compressor's norm or top-k, which the replicated path computes on the same shard
# after its reduce-scatter). check_shardable allows both there.
SHARD_AWARE_SCOPE = "hsdp_shard_aware"
# The name scope (a prefix, then the optimizer's role) of a user's optimizer called from
# shard-aware code (user_optimizer): check_shardable checks it as it checks a plain chain.
USER_SCOPE = "hsdp_user."
_SHARDED_LEAVES: contextvars.ContextVar = contextvars.ContextVar("jaxcomm_hsdp_leaves",
                                                                default=None)


class ShardLayout(NamedTuple):
  """Where each parameter leaf's shard comes from.

  Attributes:
    shapes: the leaves' full shapes, in ``jax.tree.leaves`` order.
    axis: the fast mesh axis the shards are split over.
    dims: per leaf, ``None`` (flat, zero-padded shards) or the dimension split over ``axis``
      (from a ``PartitionSpec`` / ``nnx.with_partitioning`` annotation naming ``axis``).
    per_host: ``()`` (shards replicated over the other axes), or those axes: every host
      keeps its own parameters (:func:`per_host_params`), flat shards only.
  """
  shapes: tuple
  axis: str
  dims: tuple
  per_host: tuple = ()


def check_shard_axis(mesh: Mesh, axis: Any) -> str:
  """Validates ``shard_over``: one axis of ``mesh`` (others are the slow axes)."""
  if not isinstance(axis, str) or axis not in mesh.axis_names:
    raise ValueError(f"shard_over must be the name of one axis of the mesh, one of "
                     f"{tuple(mesh.axis_names)}; got {axis!r}.")
  return axis


def _leaf_dim(name: str, shape: tuple, spec, mesh: Mesh, axis: str) -> int | None:
  """The dimension ``spec`` splits over ``axis`` (``None``: flat shards), after checking it."""
  if not isinstance(spec, PartitionSpec):
    raise TypeError(f"specs{name} must be a PartitionSpec, got {spec!r}.")
  entries = [entry if isinstance(entry, tuple) else (entry,) for entry in spec]
  names = [n for entry in entries for n in entry if n is not None]
  for n in names:
    if n not in mesh.axis_names:
      raise ValueError(f"specs{name} = {spec} names {n!r}, which the mesh lacks (axes "
                       f"{tuple(mesh.axis_names)}).")
    if n != axis:
      raise ValueError(f"specs{name} = {spec} names {n!r}, but with shard_over={axis!r} the "
                       f"parameters are replicated over the other axes: name only {axis!r}.")
  if len(spec) > len(shape) or len(names) > 1 or any(len(e) > 1 for e in entries if axis in e):
    raise ValueError(f"specs{name} = {spec} must split at most one of the {len(shape)} "
                     f"dimensions of shape {shape} over {axis!r}.")
  dim = next((i for i, entry in enumerate(entries) if axis in entry), None)
  group = mesh.shape[axis]
  if dim is not None and shape[dim] % group:
    raise ValueError(f"specs{name} = {spec} splits dimension {dim} of shape {shape} over the "
                     f"{group} devices of {axis!r}, which does not divide {shape[dim]}: "
                     "annotate another dimension, or none (flat shards, zero-padded).")
  return dim


def leaf_dims(params, specs, mesh: Mesh, axis: str) -> tuple:
  """Per leaf of ``params``, the dimension ``specs`` (a ``PartitionSpec`` pytree with
  ``params``' structure, or ``None``) splits over ``axis``; ``None`` where it names none.

  Raises:
    ValueError: a spec naming an axis the mesh lacks or another axis than ``axis``, more
      than one dimension, or a dimension ``axis``'s size does not divide; specs of another
      structure.
  """
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  if specs is None:
    return (None,) * len(paths)
  flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  if len(flat) != len(paths):
    raise ValueError(f"specs must have one PartitionSpec per parameter leaf ({len(paths)}), "
                     f"got {len(flat)}.")
  return tuple(_leaf_dim(jax.tree_util.keystr(path), tuple(jnp.shape(leaf)), spec, mesh, axis)
               for (path, leaf), spec in zip(paths, flat))


def _spec(dim: int | None, axis: str) -> PartitionSpec:
  return PartitionSpec(axis) if dim is None else PartitionSpec(*[None] * dim, axis)


def layout_specs(shards, layout: ShardLayout):
  """The ``PartitionSpec`` pytree of ``shards`` (``shard_map``'s ``in_specs`` entry)."""
  if layout.per_host:
    return jax.tree.map(lambda _: PartitionSpec((*layout.per_host, layout.axis)), shards)
  return jax.tree.unflatten(jax.tree.structure(shards),
                            [_spec(dim, layout.axis) for dim in layout.dims])


# State types of the algorithms that keep one model per worker between synchronizations.
_PER_WORKER_STATES = ("PeriodicState", "ZeroOneAdamState")


def _slow_axes(mesh: Mesh, axis: str) -> tuple[tuple, int]:
  """The axes other than ``axis`` (the hosts') and their number of devices."""
  slow = tuple(a for a in mesh.axis_names if a != axis)
  return slow, math.prod(mesh.shape[a] for a in slow)


def keeps_per_host_params(tx: optax.GradientTransformation, shards, mesh: Mesh,
                          layout: ShardLayout) -> bool:
  """Whether ``tx`` keeps per-worker parameters between synchronizations (its state holds a
  ``PeriodicState``: local SGD, DiLoCo, streaming DiLoCo, SlowMo, BMUF, FedAvg; or a
  ``ZeroOneAdamState``: 0/1 Adam's local steps), traced without computing on the flat
  per-host shards :func:`per_host_params` would make (these algorithms refuse parameters
  replicated over their workers)."""
  slow, copies = _slow_axes(mesh, layout.axis)
  flat = layout._replace(dims=(None,) * len(layout.dims), per_host=slow)
  group = mesh.shape[layout.axis]
  abstract = [jax.ShapeDtypeStruct((copies * group * -(-math.prod(shape) // group),),
                                   leaf.dtype)
              for leaf, shape in zip(jax.tree.leaves(shards), layout.shapes)]
  abstract = jax.tree.unflatten(jax.tree.structure(shards), abstract)
  specs = state_specs(on_shards(tx, flat), abstract, mesh, layout_specs(abstract, flat))
  nodes = jax.tree.leaves(specs, is_leaf=lambda n: type(n).__name__ in _PER_WORKER_STATES)
  return any(type(node).__name__ in _PER_WORKER_STATES for node in nodes)


def per_host_params(shards, layout: ShardLayout, mesh: Mesh) -> tuple[Any, ShardLayout]:
  """Every host's own copy of the flat ``shards``: each leaf tiled to ``(H G ceil(d/G),)``
  with ``PartitionSpec((*slow_axes, axis))`` (the hosts are the workers of local SGD and
  DiLoCo, each a ``G``-device sharded data-parallel group)."""
  if any(dim is not None for dim in layout.dims):
    raise ValueError("per-host parameters (local SGD, DiLoCo, SlowMo under shard_over) need "
                     "flat shards; drop the PartitionSpec / nnx.with_partitioning annotations.")
  slow, copies = _slow_axes(mesh, layout.axis)
  sharding = NamedSharding(mesh, PartitionSpec((*slow, layout.axis)))
  tiled = jax.tree.map(lambda leaf: jax.jit(lambda x: jnp.tile(x, copies),
                                            out_shardings=sharding)(leaf), shards)
  return tiled, layout._replace(per_host=slow)


def shard_params(params, mesh: Mesh, axis: str, dims: tuple) -> tuple[Any, ShardLayout]:
  """``1/G`` shards of ``params`` placed on ``mesh``: split along ``dims[i]`` where it is set,
  else flat and zero-padded.

  Returns:
    ``(shards, layout)``: ``shards`` has ``params``' structure; a flat leaf is a global array
    of shape ``(G * ceil(d/G),)`` with ``PartitionSpec(axis)``, a dimension-split one keeps
    its shape, split along that dimension; all replicated over the other axes.
  """
  group = mesh.shape[axis]
  leaves, treedef = jax.tree.flatten(params)

  def flat(leaf):
    return jnp.pad(leaf.reshape(-1), (0, -leaf.size % group))

  shards = [jax.jit(flat if dim is None else lambda leaf: leaf,
                    out_shardings=NamedSharding(mesh, _spec(dim, axis)))(jnp.asarray(leaf))
            for leaf, dim in zip(leaves, dims)]
  layout = ShardLayout(tuple(tuple(jnp.shape(leaf)) for leaf in leaves), axis, tuple(dims))
  return treedef.unflatten(shards), layout


def gather_params(shards, layout: ShardLayout):
  """Inside ``shard_map``: the full parameters from this device's shards (one all-gather
  over ``layout.axis`` per leaf, ``(G-1)/G * 4 G ceil(d/G)`` bytes for ``d`` elements; its
  transpose is the gradient's reduce-scatter, as many bytes)."""
  leaves, treedef = jax.tree.flatten(shards)
  full = [jax.lax.all_gather(leaf, layout.axis, tiled=True)[:math.prod(shape)].reshape(shape)
          if dim is None else jax.lax.all_gather(leaf, layout.axis, axis=dim, tiled=True)
          for leaf, shape, dim in zip(leaves, layout.shapes, layout.dims)]
  return treedef.unflatten(full)


def unshard_params(shards, layout: ShardLayout, copies: int = 1):
  """Outside ``shard_map``: the full parameters, replicated (for ``trainer.model``); with
  per-host parameters (``copies`` hosts), their mean over the hosts."""
  leaves, treedef = jax.tree.flatten(shards)
  if layout.per_host:
    leaves = [jnp.mean(leaf.reshape(copies, -1), axis=0) for leaf in leaves]
  full = [leaf[:math.prod(shape)].reshape(shape) if dim is None else leaf
          for leaf, shape, dim in zip(leaves, layout.shapes, layout.dims)]
  return treedef.unflatten(full)


class ShardedLeaves(NamedTuple):
  """What shard-aware transformations see inside :func:`on_shards` (:func:`sharded_leaves`).

  Attributes:
    axis: the mesh axis the leaves are sharded over.
    shapes: the full shapes of the leaves, in ``jax.tree.leaves`` order.
    dims: per leaf, ``None`` (a flat shard) or the dimension split over ``axis``.
  """
  axis: str
  shapes: tuple
  dims: tuple


def sharded_leaves() -> ShardedLeaves | None:
  """Inside ``on_shards(tx, ...).init`` / ``.update``: the sharded axis and the leaves' full
  shapes (each leaf ``tx`` sees is then this device's flat ``ceil(d/G)`` shard); else ``None``."""
  return _SHARDED_LEAVES.get()


def sharded_leaves_over(fast_axis: str, caller: str) -> ShardedLeaves | None:
  """:func:`sharded_leaves`, for a transformation whose fast axis must be the sharded one.

  Raises:
    ValueError: the leaves are sharded over another axis than ``fast_axis``.
  """
  shards = sharded_leaves()
  if shards is not None and shards.axis != fast_axis:
    raise ValueError(f"{caller}: the parameters are sharded over {shards.axis!r} (shard_over), "
                     f"so fast_axis must be {shards.axis!r}; got fast_axis={fast_axis!r}.")
  return shards


def _scoped(tx: optax.GradientTransformation, scope: str) -> optax.GradientTransformation:
  """``tx`` with its ``update`` in the name scope ``scope`` (extra arguments kept)."""

  def update(updates, state, params=None, **extra_args):
    with jax.named_scope(scope):
      return tx.update(updates, state, params, **extra_args)

  if isinstance(tx, optax.GradientTransformationExtraArgs):
    return optax.GradientTransformationExtraArgs(tx.init, update)
  return optax.GradientTransformation(tx.init, lambda u, s, p=None: update(u, s, p))


def shard_aware(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` declared exact on shards: its ``update`` runs in the name scope
  :data:`SHARD_AWARE_SCOPE`, where :func:`check_shardable` allows collectives over the sharded
  axis and operations that combine elements of a shard. For jaxcomm's own transformations
  whose shard-aware paths compute on each ``1/G`` shard what the replicated path computes on
  it (:func:`jaxcomm.compressed_allreduce` after its reduce-scatter, the periodic engine's
  synchronization, ...). An optimizer they take from the user goes through
  :func:`user_optimizer`."""
  return _scoped(tx, SHARD_AWARE_SCOPE)


def user_optimizer(tx: optax.GradientTransformation, role: str) -> optax.GradientTransformation:
  """``tx``, a user's optimizer that shard-aware code calls (e.g. DiLoCo's inner optimizer),
  with its ``update`` in a name scope that ends the enclosing :func:`shard_aware` region:
  :func:`check_shardable` checks it as it checks a plain chain, naming it by ``role``
  (e.g. ``'compress_updates.inner'``)."""
  return _scoped(tx, USER_SCOPE + role)


@contextlib.contextmanager
def _sharded(layout: ShardLayout) -> Iterator[None]:
  axis = layout.axis
  token = _SHARDED_LEAVES.set(ShardedLeaves(axis, layout.shapes, layout.dims))
  try:
    with prescattered((axis,)):
      yield
  finally:
    _SHARDED_LEAVES.reset(token)


def on_shards(tx: optax.GradientTransformation,
              layout: ShardLayout) -> optax.GradientTransformation:
  """``tx`` run on shards reduce-scattered over ``layout.axis``; shard-aware transformations
  read the leaves' full shapes and split dimensions (:func:`sharded_leaves`; PowerSGD
  factorizes column blocks with them).

  ``update`` takes the *sum* over ``axis`` of the devices' gradients of this device's shard
  (what the transpose of :func:`gather_params` gives) and hands ``tx`` their mean, inside
  :func:`jaxcomm.collectives.prescattered`: the ``G`` devices of a host act as one worker
  whose gradient is the host's mean, so algorithms whose per-worker state is linear in the
  gradient (error feedback, momentum, 1-bit Adam's local momentum) see what they would see
  replicated after their own fast level.

  ``init`` marks as varying over ``axis`` every floating-point state leaf shaped like a shard
  that ``tx.init`` made from the shapes alone (``jnp.zeros(p.shape)`` is the same on every
  device, but under sharding such a leaf belongs to this device's shard), and every state
  leaf that ``tx.update`` (traced, not run) returns varying over ``axis`` (e.g. a history
  buffer of the last ``tau`` gradient shards, shaped ``(tau, n)``).
  """

  axis = layout.axis

  def init(params):
    with _sharded(layout):
      state = tx.init(params)
    shard_shapes = {jnp.shape(leaf) for leaf in jax.tree.leaves(params)}

    def per_shard(leaf):
      if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.shape in shard_shapes:
        return vary(leaf, (axis,))
      return leaf

    state = jax.tree.map(per_shard, state)
    grads = vary_tree(params, manual_axes("on_shards.init"))  # as the step passes them
    with _sharded(layout):
      updated = jax.make_jaxpr(lambda s: tx.update(grads, s, params)[1])(state).out_avals
    return jax.tree.unflatten(jax.tree.structure(state), [
        vary(leaf, (axis,)) if axis in new.mat.varying else leaf
        for leaf, new in zip(jax.tree.leaves(state), updated)])

  def update(grads, state, params=None):
    group = jax.lax.axis_size(axis)
    with jax.named_scope(SHARD_AWARE_SCOPE):
      grads = jax.tree.map(lambda g: g / group, grads)
    with _sharded(layout):
      return tx.update(grads, state, params)

  return optax.GradientTransformation(init, update)


def init_sharded(tx: optax.GradientTransformation, params, specs, mesh: Mesh, axis: str):
  """``(shards, opt_state, layout)`` for ``data_parallel(..., shard_over=axis)``: ``params``
  split as ``specs`` says (flat where it names no axis), per host when ``tx`` keeps per-worker
  parameters (:func:`keeps_per_host_params`), and ``tx``'s state on them."""
  shards, layout = shard_params(params, mesh, axis, leaf_dims(params, specs, mesh, axis))
  if keeps_per_host_params(tx, shards, mesh, layout):
    shards, layout = per_host_params(shards, layout, mesh)
  opt_state, _ = init_on_shards(tx, shards, mesh, layout)
  return shards, opt_state, layout


def init_on_shards(tx: optax.GradientTransformation, shards, mesh: Mesh, layout: ShardLayout):
  """``(opt_state, specs)`` of ``on_shards(tx, layout)`` on ``shards``, after
  :func:`check_shardable`; a ``tx.init`` that cannot trace on shards is a ``ValueError``."""
  axis, params_specs = layout.axis, layout_specs(shards, layout)
  try:
    opt_state, specs = sharded_init(on_shards(tx, layout), shards, mesh, params_specs)
  except (TypeError, ValueError) as error:
    raise ValueError(
        f"shard_over={axis!r}: tx.init fails on flat parameter shards (different on each "
        f"device of {axis!r}, replicated over the other axes, or per host for the algorithms "
        f"that keep one model per worker): {error} Use shard_over=None.") from error
  check_shardable(tx, shards, opt_state, specs, mesh, layout)
  return opt_state, specs


def check_shardable(tx: optax.GradientTransformation, shards, opt_state, state_specs,
                    mesh: Mesh, layout: ShardLayout) -> None:
  """Refuses a ``tx`` that cannot run exactly on the shards of ``layout``.

  ``on_shards(tx, layout).update`` is traced on abstract values (nothing is computed), and so
  is ``tx.update`` as the replicated step runs it, on the full leaves (at least 1-D). Outside
  the regions that jaxcomm's transformations declare exact (:func:`shard_aware`; a user's
  optimizer inside them, :func:`user_optimizer`, is checked again), checked are:

  * no state node of a transformation that needs the leaf's shape (adafactor, gradzip);
  * no collective sends an array over ``layout.axis`` (only scalar agreements such as the
    non-finite check): the gradients are already reduce-scattered there and shards differ
    across it, so averaging them (``jaxcomm.dgc`` without ``fast_axis``, a pmean over every
    axis) would be wrong;
  * no operation that combines a shard's elements (:func:`_mixing_shape`): it would compute
    on the shard alone (``optax.clip_by_global_norm``'s norm, LAMB's trust ratio, noise);
  * the same operations on shards as on the full leaves (:func:`_skeleton`): logic that looks
    at a leaf's rank or shape (a weight-decay mask by rank) would take another branch on
    flat shards;
  * the updates are the same on every host, as the replicated shards need, unless the
    parameters are per host (``layout.per_host``, :func:`per_host_params`: local SGD, DiLoCo,
    SlowMo, BMUF, FedAvg, 0/1 Adam).

  Raises:
    ValueError: naming the transformation, collective or operation, its axes or its
      operand's shape, and what to use instead.
  """
  axis, per_host = layout.axis, bool(layout.per_host)
  nodes = jax.tree.leaves(opt_state, is_leaf=lambda n: type(n).__name__ in _NEEDS_SHAPE)
  for node in nodes:
    if type(node).__name__ in _NEEDS_SHAPE:
      raise ValueError(f"shard_over={axis!r}: tx holds a {type(node).__name__}, i.e. "
                       f"{_NEEDS_SHAPE[type(node).__name__]}: it cannot run on 1/G shards; "
                       "use an elementwise compressor and optimizer, or shard_over=None.")
  others = tuple(a for a in mesh.axis_names if a != axis)

  differing = []

  def probe(shards, opt_state):
    grads = shards if per_host else vary_tree(shards, others)
    updates = on_shards(tx, layout).update(grads, opt_state, shards)[0]
    differing.extend(set(others) & set(jax.typeof(leaf).mat.varying)
                     for leaf in jax.tree.leaves(updates))
    return ()

  jaxpr = jax.make_jaxpr(jax.shard_map(
      probe, mesh=mesh, in_specs=(layout_specs(shards, layout), state_specs),
      out_specs=()))(shards, opt_state).jaxpr
  checked = list(_checked_operations(jaxpr))
  for eqn, who in checked:
    collective = _collective(eqn)
    if collective and axis in collective[0] and any(dim != 1 for dim in collective[1]):
      raise ValueError(
          f"shard_over={axis!r}: {who} runs {eqn.primitive.name} over {collective[0]} on an "
          f"array of shape {collective[1]}, but under sharded data parallelism the gradients "
          f"are already reduce-scattered over {axis!r} and each device holds a different "
          f"shard, so tx may only communicate over {others}. Transformations that average over "
          "every axis themselves (jaxcomm.dgc, powersgd_allreduce, a pmean over all axes) "
          "cannot run on shards: use jaxcomm.compressed_allreduce(...) or shard_over=None.")
  mixing = [(_mixing_shape(eqn), eqn, who) for eqn, who in checked]
  mixing = [entry for entry in mixing if entry[0]]
  if mixing:  # the largest operand names the culprit best (not a key split, say)
    shape, eqn, who = max(mixing, key=lambda entry: math.prod(entry[0]))
    raise ValueError(
        f"shard_over={axis!r}: {who} runs {eqn.primitive.name} on an array of shape {shape}, "
        "which combines different elements (e.g. optax.clip_by_global_norm's norm, LAMB's "
        "per-leaf trust ratio, optax.add_noise's draws); under shard_over each device holds "
        "only its 1/G shard of every leaf, so it would compute on the shard alone. Use "
        "elementwise optimizers there (optax.adamw, sgd, lion, ...; jaxcomm's own "
        "transformations declare their exact parts), or shard_over=None.")
  _check_same_operations(tx, checked, shards, mesh, layout)
  if any(differing) and not per_host:
    raise ValueError(
        f"shard_over={axis!r}: tx.update returns updates that differ across mesh axes "
        f"{tuple(sorted(set().union(*differing)))}, but the parameter shards are replicated "
        "over them. Per-host parameters are kept only for the algorithms that keep one model "
        "per worker (the periodic-averaging engine: jaxcomm.local_sgd, diloco, "
        "streaming_diloco, slowmo, bmuf, fedavg; and zero_one_adam); others (e.g. an "
        "optimizer without an allreduce) cannot run on shards: put "
        "jaxcomm.compressed_allreduce(...) first in the chain, or use shard_over=None.")


def _check_same_operations(tx: optax.GradientTransformation, checked: list, shards,
                           mesh: Mesh, layout: ShardLayout) -> None:
  """Refuses a ``tx`` whose operations on shards (``checked``, from
  :func:`_checked_operations`) are not those of ``tx.update`` on the full leaves (at least 1-D) as
  the replicated step runs it: inside ``shard_map`` over ``mesh``, every device's gradient its
  own; with per-host parameters, over ``mesh`` with one device per host, each its own worker
  (the hosts-as-workers run the sharded one equals)."""
  every = tuple(mesh.axis_names)
  sizes = [1 if layout.per_host and name == layout.axis else mesh.shape[name] for name in every]
  replicated_mesh = AbstractMesh(tuple(sizes), every, axis_types=(AxisType.Explicit,) * len(every))
  full = [jax.ShapeDtypeStruct(shape or (1,), leaf.dtype)
          for shape, leaf in zip(layout.shapes, jax.tree.leaves(shards))]
  full = jax.tree.unflatten(jax.tree.structure(shards), full)
  traced = []

  def probe(params):
    params = vary_tree(params, every) if layout.per_host else params
    state, grads = tx.init(params), vary_tree(params, every)
    traced.append(jax.make_jaxpr(lambda s: tx.update(grads, s, params))(state).jaxpr)
    return ()

  jax.eval_shape(jax.shard_map(probe, mesh=replicated_mesh, in_specs=(PartitionSpec(),),
                               out_specs=()), full)
  on_shards_ops = collections.Counter(_skeleton(checked))
  replicated_ops = collections.Counter(_skeleton(_checked_operations(traced[0])))
  if on_shards_ops != replicated_ops:
    who, name, _, _ = min((on_shards_ops - replicated_ops) or (replicated_ops - on_shards_ops),
                          key=repr)
    raise ValueError(
        f"shard_over={layout.axis!r}: {who} runs other operations on flat 1/G shards than on "
        f"the full leaves (e.g. {name} a different number of times): logic that looks at a "
        "leaf's rank or shape (a weight-decay mask by rank, an optimizer that treats matrices "
        "differently) would silently take the other branch on the shards. Pass masks by "
        "parameter name, or use shard_over=None.")


def _sub_jaxprs(eqn) -> Iterator:
  """The jaxprs nested in ``eqn`` (a call's body, a conditional's branches, a loop's body)."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def _operations(jaxpr, scope: str = "") -> Iterator[tuple[Any, str]]:
  """``(eqn, name scope)`` of every operation in ``jaxpr``, nested ones too (a nested
  jaxpr's name stack is relative to its caller's, which is prepended)."""
  for eqn in jaxpr.eqns:
    here = "/".join(name for name in (scope, str(eqn.source_info.name_stack)) if name)
    yield eqn, here
    for inner in _sub_jaxprs(eqn):
      yield from _operations(inner, here)


def _checked_operations(jaxpr) -> Iterator[tuple[Any, str]]:
  """``(eqn, who)`` of the operations of ``jaxpr`` outside exact regions, ``who`` naming
  their code (``'tx'``, or a :func:`user_optimizer`'s role): the innermost of the scopes
  :data:`SHARD_AWARE_SCOPE` and :data:`USER_SCOPE` decides."""
  for eqn, scope in _operations(jaxpr):
    who = "tx"
    for name in reversed(scope.split("/")):
      if name == SHARD_AWARE_SCOPE or name.startswith(USER_SCOPE):
        who = None if name == SHARD_AWARE_SCOPE else name[len(USER_SCOPE):]
        break
    if who is not None:
      yield eqn, who


def _collective(eqn) -> tuple[tuple, tuple] | None:
  """``(axes, operand shape)`` of a collective ``eqn`` (its largest operand), else ``None``."""
  name = eqn.primitive.name
  if name not in _COLLECTIVES:
    return None
  axes = eqn.params.get(_COLLECTIVES[name])
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  shapes = [tuple(getattr(var.aval, "shape", ())) for var in eqn.invars]
  return axes, max(shapes, key=math.prod, default=())


# Primitives that compute each output element from the same element of every array operand
# (scalars broadcast), and reshapes, which keep the elements' flat order.
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq",
    "erf", "erf_inv", "erfc", "exp", "exp2", "expand_dims", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul",
    "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem", "reshape",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "squeeze", "sub",
    "tan", "tanh", "xor"})
# Primitives whose nested jaxprs decide instead: calls and custom derivatives (operands
# passed through), conditionals on a scalar index, loops over a carry, shard_map's body.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint", "cond",
                    "while", "shard_map"})
# Primitives that change only how shard_map types a value (varying over which axes).
_TYPE_CASTS = frozenset({"pvary", "pcast"})


def _mixing_shape(eqn) -> tuple:
  """The shape of an array of rank >= 1 whose elements ``eqn`` may combine, or ``()``:
  anything but elementwise arithmetic, reshapes, broadcasts of scalars and shard_map's type
  casts (a reduction, a sort, a slice, ``iota``, random bits) on an array of rank >= 1.

  Without one, a computation is exact on flat zero-padded shards: each element of its output
  depends on the same element of the gradient, state and parameters only. Rank, not size,
  decides, so a one-element shard is caught too; operations on scalars (step counts,
  schedules) pass. Calls and conditionals are judged by their nested operations.
  """
  name = eqn.primitive.name
  if name in _ELEMENTWISE or name in _CALLS or name in _TYPE_CASTS:
    return ()
  arrays = eqn.invars[:1] if name == "broadcast_in_dim" else [*eqn.invars, *eqn.outvars]
  shapes = [tuple(var.aval.shape) for var in arrays if getattr(var.aval, "shape", ())]
  return max(shapes, key=math.prod, default=())


def _constant(var, cast_constants: dict) -> tuple | None:
  """``(dtype, value)`` of the constant ``var`` is (a literal, a scalar, or one cast by
  shard_map), else ``None``."""
  if hasattr(var, "val"):
    value = np.asarray(var.val)
    return value.dtype.name, value.tolist()
  return cast_constants.get(var)


def _skeleton(checked: Iterable[tuple[Any, str]]) -> Iterator[tuple]:
  """Per operation of ``checked`` (:func:`_checked_operations`; calls and type casts left
  out): who runs it, its primitive, its constant operands and its outputs' dtypes; what is
  left of a computation once its shapes are removed."""
  cast_constants = {}  # a constant cast to varying is still that constant
  for eqn, who in checked:
    if eqn.primitive.name in _TYPE_CASTS:
      cast_constants.update({out: _constant(var, cast_constants)
                             for var, out in zip(eqn.invars, eqn.outvars)})
    if eqn.primitive.name in _CALLS or eqn.primitive.name in _TYPE_CASTS:
      continue
    constants = tuple(constant for constant in (_constant(var, cast_constants)
                                                for var in eqn.invars) if constant is not None)
    yield (who, eqn.primitive.name, constants,
           tuple(str(getattr(var.aval, "dtype", "")) for var in eqn.outvars))


def column_blocks(shape: tuple, group: int, rank: int, min_compression_rate: float) -> int:
  """Columns per device of a leaf's ``(out, rest)`` PowerSGD matrix under sharding over
  ``group`` devices, or 0 when the leaf is sent dense: its compression rate is below
  ``min_compression_rate``, or ``rest`` is not a multiple of ``group`` (then the flat
  ``1/G`` shards are not blocks of whole columns)."""
  if compression_rate(tuple(shape), rank) < min_compression_rate:
    return 0
  _, rest = matrix_shape(tuple(shape))
  return rest // group if rest % group == 0 else 0


def powersgd_states(leaves, shards: ShardedLeaves, *, rank: int, min_compression_rate: float,
                    seed: int | jax.Array, slow_axis: str) -> tuple:
  """PowerSGD's per-leaf state on shards: for a factorized leaf, this device's rows of the
  warm start ``Q`` (``(c, r)`` for its ``c`` columns, varying over the sharded axis) and a
  residual shaped like its flat shard; ``()`` for a leaf sent dense."""
  group = jax.lax.axis_size(shards.axis)
  states = []
  for index, (leaf, shape, dim) in enumerate(zip(leaves, shards.shapes, shards.dims)):
    # A flat shard, or one split along the leading dimension, is a block of whole columns.
    columns = column_blocks(shape, group, rank, min_compression_rate) if not dim else 0
    if not columns:
      states.append(())
      continue
    block = jax.lax.dynamic_slice_in_dim(initial_q(nth_key(seed, index), shape, rank),
                                         jax.lax.axis_index(shards.axis) * columns, columns)
    residual = vary(jnp.zeros(leaf.shape, jnp.float32), (slow_axis,))
    states.append(PowerSGDLeafState(q=block, residual=residual))
  return tuple(states)


def powersgd_on_shards(leaves, states, shards: ShardedLeaves, *, slow_axis: str,
                       epsilon: float, feedback: bool):
  """One PowerSGD step (Vogels et al. 2019) on column blocks of each host's matrix.

  A factorized leaf's ``(out, rest) = (m, n)`` matrix ``A`` is split by columns: this device's
  flat shard is ``A_i`` (``m x c``, ``c = n/G``) with rows ``Q_i`` of ``Q``. Then
  ``P = A Q = sum_i A_i Q_i`` is ``psum``-ed over the sharded axis and then over ``slow_axis``
  and orthogonalized (the same on every device); ``Q'_i = A_i^T P`` is ``psum``-ed over
  ``slow_axis`` only; the output block is ``P Q'_i^T`` and the residual
  ``A_i - P Q'_i^T / H``: exactly the replicated PowerSGD, computed blockwise. Bytes per
  device and factorized leaf: ``2 (G-1)/G 4 m r`` over the sharded axis, ``2 (H-1)/H 4 r
  (m + c)`` over ``slow_axis``; a dense leaf's shard of ``s`` elements: ``2 (H-1)/H 4 s``.

  Returns:
    ``(outputs, new_states)``: the mean's flat shards (float32) and the states.
  """
  hosts, axis = jax.lax.axis_size(slow_axis), shards.axis
  outputs, new_states = [], []
  for leaf, state, shape in zip(leaves, states, shards.shapes):
    if not isinstance(state, PowerSGDLeafState):
      outputs.append(jax.lax.psum(leaf.astype(jnp.float32), slow_axis))
      new_states.append(state)
      continue
    m = shape[-1]
    corrected = (leaf.astype(jnp.float32) + (state.residual if feedback else 0.0))
    corrected = corrected.reshape(-1, m).T  # (m, c)
    with jax.named_scope(SHARD_AWARE_SCOPE):
      p = jax.lax.psum(jax.lax.psum(project(corrected, state.q), axis), slow_axis)
    p = orthogonalize(p, epsilon)
    q = jax.lax.psum(back_project(corrected, p), slow_axis)
    approx = jnp.matmul(p, q.T, precision=PRECISION)
    with jax.named_scope(SHARD_AWARE_SCOPE):
      alive = jax.lax.psum(jnp.sum(q * q, axis=0, keepdims=True), axis) > 0
    residual = ((corrected - approx / hosts).T.reshape(leaf.shape) if feedback
                else state.residual)
    outputs.append(approx.T.reshape(leaf.shape))
    new_states.append(keep_if(any_nonfinite(approx, (axis,)), state, PowerSGDLeafState(
        q=jnp.where(alive, q, state.q), residual=residual)))
  return outputs, new_states
