"""The library-owned data-parallel step: ``data_parallel(loss_fn, tx, mesh)``.

``trainer.init(model)`` places every state leaf (replicated parameters, device-local residuals
with the specs of :func:`jaxcomm.optim.state_specs`); ``trainer.step(state, batch)`` runs the jitted
``shard_map`` of :func:`jaxcomm.optim.train_step.device_step` (per-device gradients, ``tx``
does all communication) and returns the mean loss. On the CPU backend it keeps at most one
step in flight: jaxlib 0.10.2's CPU runtime can deadlock when many multi-device steps are
queued back to back while the cores are loaded (docs/reliability.md).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomm._src.validation import check_bool, check_float_tree
from jaxcomm._src.distributed import StepWatchdog
from jaxcomm._src.optim import hsdp
from jaxcomm._src.optim.regather import regathered
from jaxcomm._src.optim.sharding import sharded_init, state_specs
from jaxcomm._src.optim.train_step import device_step


class TrainState(NamedTuple):
  """State of a :func:`data_parallel` trainer; a pytree of global ``jax.Array`` s.

  Attributes:
    params: the parameters, replicated (for an ``nnx.Module``, its ``nnx.Param`` state); with
      ``shard_over``, each leaf a flat zero-padded array sharded over that axis
      (:mod:`jaxcomm.optim.hsdp`; ``trainer.model(state)`` has the full ones).
    opt_state: ``tx``'s state, each leaf replicated or device-local as
      :func:`jaxcomm.optim.state_specs` says.
    key: the replicated PRNG key split every step (``None`` without ``key=``).
  """
  params: Any
  opt_state: Any
  key: Any = None


class Trainer(NamedTuple):
  """What :func:`data_parallel` returns.

  Attributes:
    init: ``init(params_or_module, specs=None) -> TrainState``, every leaf placed on the
      mesh. With ``shard_over``, ``specs`` (a ``PartitionSpec`` pytree like the parameters)
      or, for an ``nnx.Module``, its ``nnx.with_partitioning`` annotations choose the
      dimension each leaf is split along (docs/hsdp.md).
    step: ``step(state, batch) -> (state, loss)``: one jitted step, ``loss`` the mean over
      devices; ``step.lower(state, batch)`` lowers it (for :func:`jaxcomm.accounting.measure`)
      and ``step.wait()`` blocks until every dispatched step has finished.
    model: ``model(state)`` -> the trained ``nnx.Module`` (for a module given to ``init``) or
      the parameter pytree.
  """
  init: Callable
  step: Callable
  model: Callable


def _check_key(key):
  if key is None:
    return None
  if isinstance(key, int) and not isinstance(key, bool):
    return jax.random.key(key)
  if isinstance(key, jax.Array) and (
      (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ())
      or (key.dtype == jnp.uint32 and key.shape == (2,))):
    return key
  raise TypeError("key must be None, an int seed, a jax.random.key(...) or a "
                  f"jax.random.PRNGKey(...); got {key!r}.")


def _check_args(loss_fn, tx, mesh, batch_spec, max_in_flight) -> None:
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, loss_fn(params_or_model, batch); got {loss_fn!r}.")
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (jaxcomm.make_mesh), got "
                    f"{type(mesh).__name__}.")
  if batch_spec is not None and not all(isinstance(spec, PartitionSpec)
                                        for spec in jax.tree.leaves(batch_spec)):
    raise TypeError(f"batch_spec must be a PartitionSpec (or a pytree of them), got {batch_spec!r}.")
  if max_in_flight is not None and (isinstance(max_in_flight, bool)
                                    or not isinstance(max_in_flight, int) or max_in_flight < 1):
    raise ValueError(f"max_in_flight must be None or an int >= 1, got {max_in_flight!r}.")


def _split_module(model):
  """``(graphdef, params)`` of an ``nnx.Module``, or ``(None, model)`` for a pytree."""
  if not isinstance(model, nnx.Module):
    return None, model
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
        rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})
    raise ValueError(f"data_parallel trains the nnx.Param variables of a module; this one also "
                     f"holds {', '.join(kinds)} (e.g. batch statistics or Rngs), which a "
                     "replicated step would have to reduce or split: pass randomness with "
                     "data_parallel(..., key=) and keep other variables out of the module.")
  return graphdef, params


def split_params(model):
  """``(graphdef, params)``: an ``nnx.Module`` split into its graph and its ``nnx.Param``
  state (``nnx.merge(graphdef, params)`` rebuilds it), or ``(None, model)`` for a pytree.

  Raises:
    ValueError: the module holds variables other than ``nnx.Param`` (batch statistics, Rngs).
  """
  return _split_module(model)


def _placed(tx, params, graphdef, specs, mesh: Mesh, shard_over: str | None, copy: bool):
  """``(params, opt_state, layout)`` on ``mesh``: replicated (``layout`` ``None``), or
  sharded over ``shard_over`` as ``specs`` or the module's ``nnx.with_partitioning``
  annotations say (:func:`jaxcomm.optim.hsdp.init_sharded`).
  With ``copy``, the placed parameters share no buffer with ``params`` (a donating step must
  not delete the caller's arrays; ``device_put`` keeps the source's buffer as one device's
  shard even with ``may_alias=False``)."""
  if copy:
    params = jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), params)
  if shard_over is None:
    if specs is not None:
      raise ValueError("init(..., specs=) places parameter shards: it needs "
                       "data_parallel(..., shard_over=); got shard_over=None.")
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    return params, sharded_init(tx, params, mesh)[0], None
  if specs is None and graphdef is not None:
    specs = nnx.get_partition_spec(params)
  return hsdp.init_sharded(tx, params, specs, mesh, shard_over)


class _Dispatcher:
  """Bounds the steps in flight: before dispatching a step, waits until at most
  ``max_in_flight`` earlier ones may be unfinished (``None``: never waits). With 1, step
  ``t+1`` is dispatched once step ``t-1`` has finished."""

  def __init__(self, max_in_flight: int | None):
    self.max_in_flight = max_in_flight
    self.pending: collections.deque = collections.deque()

  def before_dispatch(self) -> None:
    while self.max_in_flight is not None and len(self.pending) > self.max_in_flight:
      # The loss has a shard on every device, each ready when that device's execution of the
      # step is: waiting for all of them waits for the whole step.
      jax.block_until_ready(self.pending.popleft())

  def dispatched(self, loss) -> None:
    if self.max_in_flight is not None:
      self.pending.append(loss)

  def wait(self) -> None:
    while self.pending:
      jax.block_until_ready(self.pending.popleft())


class _Step:
  """``step(state, batch)`` with bounded dispatch; one jitted ``shard_map`` per module and
  state layout (``build(params, with_key)`` makes it; ``module()`` is the current module's
  graph definition, ``None`` for a pytree)."""

  def __init__(self, build: Callable, module: Callable, dispatcher: _Dispatcher,
               watchdog=None):
    self._build, self._module, self._dispatcher, self._compiled = build, module, dispatcher, {}
    self._watchdog = watchdog

  def _jitted(self, state: TrainState) -> Callable:
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), state.params)
    signature = (self._module(), jax.tree.structure(state), tuple(jax.tree.leaves(params)))
    if signature not in self._compiled:
      self._compiled[signature] = self._build(params, state.key is not None)
    return self._compiled[signature]

  def __call__(self, state: TrainState, batch):
    jitted = self._jitted(state)
    if self._watchdog is not None:
      with self._watchdog.step(self._watchdog.next_step):
        self._dispatcher.wait()
        state, loss = jitted(state, batch)
        jax.block_until_ready(loss)  # the deadline must cover the step's collectives
      return state, loss
    self._dispatcher.before_dispatch()
    state, loss = jitted(state, batch)
    self._dispatcher.dispatched(loss)
    return state, loss

  def lower(self, state: TrainState, batch):
    return self._jitted(state).lower(state, batch)

  def wait(self) -> None:
    self._dispatcher.wait()


def data_parallel(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, *,
                  batch_spec: PartitionSpec | None = None, key: Any = None,
                  max_in_flight: int | None = None,
                  watchdog: StepWatchdog | None = None,
                  shard_over: str | None = None,
                  reshard_after_forward: bool = False,
                  donate: bool = False) -> Trainer:
  """Data-parallel training where the library owns the step.

  Parameters are replicated on every device of ``mesh`` (or sharded: ``shard_over``); each
  batch is split over every mesh axis along its first dimension; each device takes the
  gradient of its own share (:func:`jaxcomm.optim.local_value_and_grad`) and ``tx`` does all
  communication, typically
  ``optax.chain(jaxcomm.compressed_allreduce(...), optax.adamw(...))``. Bytes per device and
  step: those of ``tx`` plus the loss ``pmean``, ``2 (N-1)/N * 4`` for ``N`` devices.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` for a parameter pytree, or
      ``loss_fn(model, batch)`` for an ``nnx.Module`` given to ``init``; with ``key=``, a
      third argument: a PRNG key different on every device and step.
    tx: the optax transformation.
    mesh: the device mesh, e.g. ``jaxcomm.make_mesh(hosts=2, local=4)``.
    batch_spec: ``PartitionSpec`` of the batch leaves (or a pytree of them); default
      ``P(mesh.axis_names)``, split over all devices along the first dimension.
    key: ``None``, an int seed, or a ``jax.random.key`` / legacy ``PRNGKey`` for ``loss_fn``.
    max_in_flight: steps that may still be unfinished when the next is dispatched, an int
      >= 1; ``None`` (default) means 1 on the CPU backend, whose runtime can deadlock with
      many steps queued under load, and no bound on other backends.
    watchdog: a :class:`jaxcomm.distributed.StepWatchdog`, or ``None``. With one, every step
      meets the other processes at the watchdog's rendezvous before it is dispatched and is
      waited for inside its deadline (no step stays in flight), so a process stuck before or
      inside a step becomes an error naming it instead of a hang (docs/reliability.md).
    shard_over: ``None`` (parameters replicated), or the fast mesh axis (e.g. ``'local'``)
      to shard parameters, optimizer state and residuals over, replicated over the other
      axes: hybrid sharded data parallelism (:mod:`jaxcomm.optim.hsdp`, docs/hsdp.md). Each
      leaf of ``d`` elements is kept as a flat ``ceil(d/G)`` shard (zero-padded, exactly);
      per step and leaf the fast axis carries an all-gather and a reduce-scatter,
      ``(G-1)/G * 4 G ceil(d/G)`` bytes each, and ``tx`` only crosses the other axes with the shard.
      A leaf whose ``PartitionSpec`` (``init(params, specs=)``, or an ``nnx.with_partitioning``
      annotation) names ``shard_over`` on one dimension is split along it instead (that
      dimension must be a multiple of ``G``); naming another axis is a ``ValueError``.
      ``tx`` must be elementwise on shards (PowerSGD factorizes column blocks): a
      transformation that needs a leaf's shape (adafactor, gradzip) or averages over
      ``shard_over`` itself (``jaxcomm.dgc``) is a ``ValueError`` at ``init``.
    reshard_after_forward: with ``shard_over``, gather each parameter leaf where an operation
      of ``loss_fn`` first combines it with the batch, tied to that operation's input so it
      is gathered just before the layer that uses it, and gather it again for that
      operation's backward pass, tied to its incoming gradient
      (docs/hsdp.md, "Reshard after forward"): the gathered leaves are never kept from the
      forward to the backward pass (FSDP's reshard-after-forward; on a 4-block GPT at 2 x 4
      the step's compiled peak falls by about one parameter copy). Same results as ``False``
      (the loss bit-identical, gradients up to summation order). Costs one more fast-axis
      all-gather, ``(G-1)/G * 4 G ceil(d/G)`` bytes per step, of every leaf whose value the
      backward pass reads (weights, norm scales; not biases), and one more per further
      operation that reads a leaf (a tied embedding); docs/hsdp.md section 7.
    donate: the step donates the state it is given (``jax.jit``'s ``donate_argnums``): the
      new parameters, optimizer state and residuals are written into the old ones' buffers,
      so a step holds one copy of the state instead of two (docs/architecture.md, "Donating
      the state"). The state passed to ``step`` is deleted by it: keep only the returned
      one, as ``state, loss = trainer.step(state, batch)`` does. Same values as ``False``.

  Returns:
    A :class:`Trainer` ``(init, step, model)``.

  Example:
    >>> trainer = jaxcomm.data_parallel(loss_fn, tx, mesh)  # doctest: +SKIP
    >>> state = trainer.init(params)  # doctest: +SKIP
    >>> state, loss = trainer.step(state, batch)  # doctest: +SKIP
  """
  _check_args(loss_fn, tx, mesh, batch_spec, max_in_flight)
  if watchdog is not None and not isinstance(watchdog, StepWatchdog):
    raise TypeError(f"watchdog must be None or a jaxcomm.distributed.StepWatchdog, got "
                    f"{type(watchdog).__name__}.")
  key = _check_key(key)
  if shard_over is not None:
    shard_over = hsdp.check_shard_axis(mesh, shard_over)
  if not isinstance(reshard_after_forward, bool):
    raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}.")
  if reshard_after_forward and shard_over is None:
    raise ValueError("reshard_after_forward=True needs shard_over= (only sharded parameters "
                     "are gathered); got shard_over=None.")
  donate = check_bool("donate", donate)
  if max_in_flight is None and mesh.devices.flat[0].platform == "cpu":
    max_in_flight = 1
  axes = tuple(mesh.axis_names)
  batch_spec = PartitionSpec(axes) if batch_spec is None else batch_spec
  replicated = NamedSharding(mesh, PartitionSpec())
  # The nnx.Module given to the latest init (if any) and, with shard_over, its shard layout.
  module = {"graphdef": None, "layout": None}

  def as_model(params):
    return params if module["graphdef"] is None else nnx.merge(module["graphdef"], params)

  def gathered_loss(shards, *args):
    return loss_fn(as_model(hsdp.gather_params(shards, module["layout"])), *args)

  def loss_of_params(params, *args):
    if shard_over is None:
      return loss_fn(as_model(params), *args)
    if reshard_after_forward:
      return regathered(gathered_loss)(params, *args)
    return gathered_loss(params, *args)

  def sharded_tx() -> optax.GradientTransformation:
    if shard_over is None:
      return tx
    return hsdp.on_shards(tx, module["layout"])

  def build(params, with_key: bool) -> Callable:
    step_tx = sharded_tx()
    params_spec = (PartitionSpec() if shard_over is None
                   else hsdp.layout_specs(params, module["layout"]))
    specs = TrainState(params_spec, state_specs(step_tx, params, mesh, params_spec),
                       PartitionSpec() if with_key else None)
    per_device = device_step(loss_of_params, step_tx, axes)

    def step(state: TrainState, batch):
      if not with_key:
        params, opt_state, loss = per_device(state.params, state.opt_state, batch)
        return TrainState(params, opt_state), loss
      next_key, step_key = jax.random.split(state.key)
      device_key = jax.random.fold_in(step_key, jax.lax.axis_index(axes))
      params, opt_state, loss = per_device(state.params, state.opt_state, batch, device_key)
      return TrainState(params, opt_state, next_key), loss

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, batch_spec),
                                 out_specs=(specs, PartitionSpec())),
                   donate_argnums=(0,) if donate else ())

  def init(model, specs=None) -> TrainState:
    graphdef, params = _split_module(model)
    check_float_tree(params, "params")
    params, opt_state, layout = _placed(tx, params, graphdef, specs, mesh, shard_over, donate)
    module["graphdef"], module["layout"] = graphdef, layout
    placed_key = None if key is None else jax.device_put(
        jnp.array(key, copy=True) if donate else key, replicated)
    return TrainState(params, opt_state, placed_key)

  def model(state: TrainState):
    if shard_over is None:
      return as_model(state.params)
    copies = mesh.size // mesh.shape[shard_over]
    return as_model(jax.jit(hsdp.unshard_params, static_argnums=(1, 2),
                            out_shardings=replicated)(state.params, module["layout"], copies))

  return Trainer(init, _Step(build, lambda: (module["graphdef"], module["layout"]),
                             _Dispatcher(max_in_flight), watchdog), model)
