"""The data-parallel step over a mesh, for a transformation that communicates.

:func:`device_step` is the per-device body, the one mechanism behind both
:func:`jaxcomm.data_parallel` (the library-owned step) and :func:`data_parallel_step` (the
expert path that returns the raw jitted ``shard_map``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxcomm._src.optim.gradients import local_value_and_grad


def device_step(loss_fn: Callable, tx: optax.GradientTransformation,
                axes: tuple[str, ...]) -> Callable:
  """``step(params, opt_state, batch, *loss_args) -> (params, opt_state, mean loss)``, run on
  each device inside ``jax.shard_map`` over ``axes``.

  Each device takes its own gradient (:func:`jaxcomm.optim.local_value_and_grad`: no implicit
  full-precision ``psum``) and ``tx`` does all communication. The loss is ``pmean``-ed over
  ``axes`` (``2 (N-1)/N * 4`` bytes per device for ``N`` devices).
  """
  value_and_grad = local_value_and_grad(loss_fn)

  def step(params, opt_state, batch, *loss_args):
    loss, grads = value_and_grad(params, batch, *loss_args)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axes)

  return step


def data_parallel_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh,
                       state_specs, batch_spec: PartitionSpec | None = None) -> Callable:
  """Builds ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted.

  The expert path under :func:`jaxcomm.data_parallel`, with the same per-device body
  (:func:`device_step`): the caller creates the state with :func:`jaxcomm.optim.sharded_init` and
  waits for steps itself (on simulated CPU devices, wait for each step:
  docs/reliability.md). Parameters are replicated; the batch is split over every mesh axis
  along its first dimension; ``tx`` does all communication (its first element is typically
  :func:`jaxcomm.compressed_allreduce`). The returned loss is the mean over devices.
  Place the initial parameters as the step returns them
  (``jax.device_put(params, NamedSharding(mesh, PartitionSpec()))``): parameters laid out
  otherwise are accepted, but the second step, handed the first one's replicated output,
  compiles the step again.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` for one device's batch.
    tx: the optimizer chain.
    mesh: the device mesh.
    state_specs: ``PartitionSpec`` pytree of ``tx``'s state, from
      :func:`jaxcomm.optim.sharded_init`.
    batch_spec: spec of every batch leaf; defaults to ``P(mesh.axis_names)`` (split over all
      devices along the first dimension).

  Returns:
    The jitted step function.
  """
  axes = tuple(mesh.axis_names)
  batch_spec = PartitionSpec(axes) if batch_spec is None else batch_spec
  return jax.jit(jax.shard_map(device_step(loss_fn, tx, axes), mesh=mesh,
                               in_specs=(PartitionSpec(), state_specs, batch_spec),
                               out_specs=(PartitionSpec(), state_specs, PartitionSpec())))
