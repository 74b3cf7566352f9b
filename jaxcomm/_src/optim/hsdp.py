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

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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
# Collectives over the sharded axis that shard-aware code declares by this name scope (PowerSGD's
# column-block products); check_shardable allows them.
SHARD_AWARE_SCOPE = "hsdp_shard_aware"
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
    with _sharded(layout):
      return tx.update(jax.tree.map(lambda g: g / group, grads), state, params)

  return optax.GradientTransformation(init, update)


def init_sharded(tx: optax.GradientTransformation, params, specs, mesh: Mesh, axis: str):
  """``(shards, opt_state, layout)`` for ``data_parallel(..., shard_over=axis)``: ``params``
  split as ``specs`` says (flat where it names no axis), per host when ``tx`` keeps per-worker
  parameters (:func:`keeps_per_host_params`), and ``tx``'s state on them."""
  shards, layout = shard_params(params, mesh, axis, leaf_dims(params, specs, mesh, axis))
  if keeps_per_host_params(tx, shards, mesh, layout):
    shards, layout = per_host_params(shards, layout, mesh)
  opt_state, _ = init_on_shards(on_shards(tx, layout), shards, mesh, layout)
  return shards, opt_state, layout


def init_on_shards(tx: optax.GradientTransformation, shards, mesh: Mesh, layout: ShardLayout):
  """``(opt_state, specs)`` of ``tx`` (made with :func:`on_shards`) on ``shards``, after
  :func:`check_shardable`; a ``tx.init`` that cannot trace on shards is a ``ValueError``."""
  axis, params_specs = layout.axis, layout_specs(shards, layout)
  try:
    opt_state, specs = sharded_init(tx, shards, mesh, params_specs)
  except (TypeError, ValueError) as error:
    raise ValueError(
        f"shard_over={axis!r}: tx.init fails on flat parameter shards (different on each "
        f"device of {axis!r}, replicated over the other axes, or per host for the algorithms "
        f"that keep one model per worker): {error} Use shard_over=None.") from error
  check_shardable(tx, shards, opt_state, specs, mesh, axis, params_specs,
                  per_host=bool(layout.per_host))
  return opt_state, specs


def check_shardable(tx: optax.GradientTransformation, shards, opt_state, state_specs,
                    mesh: Mesh, axis: str, params_specs, per_host: bool = False) -> None:
  """Refuses a ``tx`` (made with :func:`on_shards`) that cannot run exactly on flat shards.

  Three checks: no state node of a transformation that needs the leaf's shape (adafactor,
  PowerSGD); and, traced on abstract values, ``tx.update`` sends no array over ``axis``
  (only scalar agreements such as the non-finite check): its fast level is the
  reduce-scatter already done, and shards differ across ``axis``, so averaging them there
  (e.g. ``jaxcomm.dgc`` or a pmean over every axis) would be wrong; and its updates are the
  same on every host, as the replicated shards need, unless ``per_host`` (the parameters
  are per-host, :func:`per_host_params`: local SGD, DiLoCo, SlowMo, BMUF, FedAvg, 0/1 Adam).

  Raises:
    ValueError: naming the transformation or the collective, its axes and its operand.
  """
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
    updates = tx.update(grads, opt_state, shards)[0]
    differing.extend(set(others) & set(jax.typeof(leaf).mat.varying)
                     for leaf in jax.tree.leaves(updates))
    return ()

  jaxpr = jax.make_jaxpr(jax.shard_map(probe, mesh=mesh, in_specs=(params_specs, state_specs),
                                       out_specs=()))(shards, opt_state)
  for primitive, axes, shape, scope in _collectives(jaxpr.jaxpr):
    if axis in axes and any(dim != 1 for dim in shape) and SHARD_AWARE_SCOPE not in scope:
      raise ValueError(
          f"shard_over={axis!r}: tx.update runs {primitive} over {axes} on an array of shape "
          f"{shape}, but under sharded data parallelism the gradients are already "
          f"reduce-scattered over {axis!r} and each device holds a different shard, so tx may "
          f"only communicate over {others}. Transformations that average over every axis "
          "themselves (jaxcomm.dgc, powersgd_allreduce, a pmean over all axes) cannot run on "
          "shards: use jaxcomm.compressed_allreduce(...) or shard_over=None.")
  if any(differing) and not per_host:
    raise ValueError(
        f"shard_over={axis!r}: tx.update returns updates that differ across mesh axes "
        f"{tuple(sorted(set().union(*differing)))}, but the parameter shards are replicated "
        "over them. Per-host parameters are kept only for the algorithms that keep one model "
        "per worker (the periodic-averaging engine: jaxcomm.local_sgd, diloco, "
        "streaming_diloco, slowmo, bmuf, fedavg; and zero_one_adam); others (e.g. an "
        "optimizer without an allreduce) cannot run on shards: put "
        "jaxcomm.compressed_allreduce(...) first in the chain, or use shard_over=None.")


def _sub_jaxprs(eqn) -> Iterator:
  """The jaxprs nested in ``eqn`` (a call's body, a conditional's branches, a loop's body)."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def _collectives(jaxpr):
  """``(primitive, axes, operand shape, name scope)`` of every collective in ``jaxpr``, nested
  ones too."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _COLLECTIVES:
      axes = eqn.params.get(_COLLECTIVES[name])
      axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
      for var in eqn.invars:
        yield (name, axes, tuple(getattr(var.aval, "shape", ())),
               str(eqn.source_info.name_stack))
    for inner in _sub_jaxprs(eqn):
      yield from _collectives(inner)


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
# passed through), conditionals on a scalar index, loops over a carry.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint", "cond",
                    "while"})


def mixing_operations(jaxpr) -> Iterator[tuple[str, tuple]]:
  """``(primitive, shape)`` of every operation in ``jaxpr`` (nested ones too) that may combine
  different elements of an array of rank >= 1: anything but elementwise arithmetic, reshapes
  and broadcasts of scalars (a reduction, a sort, a slice, ``iota``, random bits).

  A transformation without one is exact on flat zero-padded shards: each element of its
  output depends on the same element of the gradient, state and parameters only. With one,
  it would compute on this device's shard alone (``optax.clip_by_global_norm``'s norm,
  LAMB's per-leaf trust ratio, ``optax.add_noise``'s draws). Rank, not size, decides, so a
  one-element shard is caught too; operations on scalars (step counts, schedules) pass.
  """
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _CALLS:
      for inner in _sub_jaxprs(eqn):
        yield from mixing_operations(inner)
      continue
    arrays = eqn.invars[:1] if name == "broadcast_in_dim" else [*eqn.invars, *eqn.outvars]
    shapes = [tuple(var.aval.shape) for var in arrays if hasattr(var.aval, "shape")]
    if name not in _ELEMENTWISE and any(shape for shape in shapes):
      yield name, next(shape for shape in shapes if shape)


def _skeleton(jaxpr) -> Iterator[tuple]:
  """Per operation of ``jaxpr`` (calls flattened): its primitive, its constant operands and
  its outputs' dtypes; what is left of a computation once its shapes are removed."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _CALLS:
      for inner in _sub_jaxprs(eqn):
        yield from _skeleton(inner)
      continue
    constants = tuple(repr(var.val) for var in eqn.invars if hasattr(var, "val"))
    yield (eqn.primitive.name, constants,
           tuple(str(getattr(var.aval, "dtype", "")) for var in eqn.outvars))


def check_elementwise(tx: optax.GradientTransformation, shards, shapes: tuple,
                      caller: str) -> None:
  """Refuses a ``tx`` that is not exact on flat shards: its ``init`` and ``update`` must be
  elementwise (no :func:`mixing_operations`) on the full leaves and on the shards, and run
  the same operations on both.

  Both are traced on abstract leaves (nothing is computed): with the full ``shapes`` (made
  at least 1-D) and with ``shards``' shapes. The second comparison catches logic that looks
  at a leaf's rank or shape (a weight-decay mask by rank, an optimizer that treats matrices
  differently such as Muon): on 1-D shards it would silently take the other branch.

  Raises:
    ValueError: naming ``caller``, the operation and its operand's shape.
  """
  leaves, treedef = jax.tree.flatten(shards)

  def traced(leaf_shapes):
    params = treedef.unflatten([jax.ShapeDtypeStruct(shape, leaf.dtype)
                                for shape, leaf in zip(leaf_shapes, leaves)])
    return jax.make_jaxpr(lambda p: tx.update(p, tx.init(p), p))(params).jaxpr

  full = traced([shape or (1,) for shape in shapes])
  on_shards = traced([leaf.shape for leaf in leaves])
  for jaxpr, where in ((full, "the full leaves"), (on_shards, "1/G shards")):
    for primitive, shape in mixing_operations(jaxpr):
      raise ValueError(
          f"{caller}: inner runs {primitive} on an array of shape {shape} of "
          f"{where}, which combines different elements (e.g. optax.clip_by_global_norm's "
          "norm, a per-leaf trust ratio, random noise); under shard_over each device holds "
          "only its 1/G shard of every leaf, so it would compute on the shard alone. Use an "
          "elementwise inner optimizer (optax.adamw, sgd, lion, ...) or shard_over=None.")
  if list(_skeleton(full)) != list(_skeleton(on_shards)):
    raise ValueError(
        f"{caller}: inner runs other operations on flat 1/G shards than on the full leaves "
        "(logic that looks at a leaf's rank or shape, e.g. a weight-decay mask by rank): "
        "under shard_over it would silently take the other branch. Pass masks by name, or "
        "use shard_over=None.")


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
