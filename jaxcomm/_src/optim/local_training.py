"""Device-local parameters: each device trains its own copy of the model.

Local SGD, DiLoCo, SlowMo, FedAvg and gossip let the parameters of different devices drift
apart between synchronizations, so inside ``jax.shard_map`` the parameters are *varying* over
the mesh axes rather than replicated. Following :mod:`jaxcomm.optim.sharding`, a device-local
leaf of local shape ``(n, ...)`` is held outside ``shard_map`` as a global array of shape
``(devices * n, ...)`` sharded along its first dimension (``PartitionSpec(axes)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomm._src.mesh_axes import manual_axes


def to_device_local(params, mesh: Mesh):
  """Gives every device of ``mesh`` its own copy of ``params`` (global leading axis).

  Args:
    params: a pytree of arrays with at least one dimension each.
    mesh: the device mesh; every axis of it becomes a device-local axis.

  Returns:
    The pytree with each leaf of shape ``(n, ...)`` tiled to ``(devices * n, ...)`` and
    sharded ``PartitionSpec(mesh.axis_names)``: inside ``shard_map`` each device sees
    ``(n, ...)``.
  """
  sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

  def tile(path, leaf):
    if jnp.ndim(leaf) == 0:
      raise ValueError(f"params{jax.tree_util.keystr(path)} is a scalar; device-local "
                       "parameters need a leading dimension to shard.")
    return jax.device_put(jnp.concatenate([leaf] * mesh.devices.size, axis=0), sharding)

  return jax.tree_util.tree_map_with_path(tile, params)


def device_mean(params, mesh: Mesh):
  """The average over devices of device-local ``params`` (the consensus model)."""
  count = mesh.devices.size
  return jax.tree.map(
      lambda leaf: jnp.mean(leaf.reshape(count, -1, *leaf.shape[1:]), axis=0), params)


def consensus_distance(params, axes: Sequence[str] | None = None) -> jax.Array:
  """``(1/n) sum_i ||x_i - x_bar||^2`` over devices, inside ``shard_map``; replicated scalar.

  Costs two float32 all-reduces of the parameters (the mean, then the scalar).

  Args:
    params: device-local parameters (varying over ``axes``).
    axes: mesh axes the devices span; defaults to every manual axis.
  """
  axes = tuple(axes) if axes is not None else manual_axes("consensus_distance")
  squared = sum(jnp.sum(jnp.square(leaf - jax.lax.pmean(leaf, axes)))
                for leaf in jax.tree.leaves(params))
  return jax.lax.pmean(squared, axes)


def local_training_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh,
                        state_specs, batch_spec: PartitionSpec | None = None) -> Callable:
  """Builds ``step(params, opt_state, batch) -> (params, opt_state, loss)`` for device-local
  parameters, jitted.

  Like :func:`jaxcomm.optim.data_parallel_step`, but ``params`` are device-local
  (:func:`to_device_local`): each device differentiates its own copy (varying parameters
  need no ``local_grad``: ``jax.grad`` inserts no ``psum``) and ``tx`` decides when and how
  the copies meet. The returned loss is the mean over devices of each device's loss.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` for one device's batch.
    tx: e.g. :func:`jaxcomm.optim.diloco` or :func:`jaxcomm.optim.gossip`.
    mesh: the device mesh.
    state_specs: ``PartitionSpec`` pytree of the state, from
      ``jaxcomm.optim.sharded_init(tx, params, mesh, PartitionSpec(mesh.axis_names))``.
    batch_spec: spec of every batch leaf; defaults to ``P(mesh.axis_names)``.

  Returns:
    The jitted step function.
  """
  axes = tuple(mesh.axis_names)
  local = PartitionSpec(axes)
  batch_spec = local if batch_spec is None else batch_spec

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(local, state_specs, batch_spec),
                 out_specs=(local, state_specs, PartitionSpec()))
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

  return step
