"""A data-parallel train step over a mesh, for a transformation that communicates."""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxcomm.optim.gradients import local_value_and_grad


def data_parallel_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh,
                       state_specs, batch_spec: PartitionSpec | None = None) -> Callable:
  """Builds ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted.

  Parameters are replicated; the batch is split over every mesh axis along its first
  dimension; each device takes its own gradient (:func:`jaxcomm.local_value_and_grad`) and
  ``tx`` does all communication (its first element is typically
  :func:`jaxcomm.compressed_allreduce`). The returned loss is the mean over devices.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` for one device's batch.
    tx: the optimizer chain.
    mesh: the device mesh.
    state_specs: ``PartitionSpec`` pytree of ``tx``'s state, from :func:`jaxcomm.sharded_init`.
    batch_spec: spec of every batch leaf; defaults to ``P(mesh.axis_names)`` (split over all
      devices along the first dimension).

  Returns:
    The jitted step function.
  """
  axes = tuple(mesh.axis_names)
  batch_spec = PartitionSpec(axes) if batch_spec is None else batch_spec

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(PartitionSpec(), state_specs, batch_spec),
                 out_specs=(PartitionSpec(), state_specs, PartitionSpec()))
  def step(params, opt_state, batch):
    loss, grads = local_value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

  return step
