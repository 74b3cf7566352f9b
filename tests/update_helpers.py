"""One optimizer update inside ``shard_map`` on per-device gradients, for tests.

Gradients are passed with a leading device axis (``(devices, *shape)`` per leaf); device ``i``
updates with ``grads[i]``.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting


def update_fn(tx, params, mesh, *, every_device=False):
  """``(state, update)`` with ``update(grads, state) -> (out, state)`` jitted over ``mesh``.

  ``out`` is ``tx.update``'s result, replicated; with ``every_device`` each device's own
  result, stacked along a leading device axis (to check that all devices agree).
  """
  axes = tuple(mesh.axis_names)
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axes), specs),
                     out_specs=(P(axes) if every_device else P(), specs))
  def update(grads, opt_state):
    out, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state)
    return (jax.tree.map(lambda leaf: leaf[None], out) if every_device else out), opt_state

  return state, update


def apply_fn(tx, params, mesh, params_spec=P()):
  """``(state, step)`` with ``step(params, state, grads) -> (params, state)`` jitted over
  ``mesh``: ``tx.update`` with ``params``, then ``optax.apply_updates``. ``params_spec`` is
  ``P()`` for replicated parameters or ``P(mesh.axis_names)`` for device-local ones."""
  axes = tuple(mesh.axis_names)
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh, params_spec)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(params_spec, specs, P(axes)),
                     out_specs=(params_spec, specs))
  def step(params, opt_state, grads):
    updates, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return state, step


def measure_update(tx, params, mesh):
  """The :class:`~jaxcomm.accounting.CommReport` of ``tx.update`` on zero gradients shaped
  like ``params`` on every device."""
  state, update = update_fn(tx, params, mesh)
  grads = jax.tree.map(lambda p: jnp.zeros((mesh.size, *p.shape)), params)
  return accounting.measure(update, grads, state, mesh=mesh)
