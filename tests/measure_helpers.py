"""Bytes of one ``tx.update`` on per-device gradients, read from the compiled HLO."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting


def measure_update(tx, params, mesh):
  """The :class:`~jaxcomm.accounting.CommReport` of ``tx.update`` inside ``shard_map`` over
  every axis of ``mesh``, on zero gradients shaped like ``params`` on each device."""
  axes = tuple(mesh.axis_names)
  state, specs = jaxcomm.sharded_init(tx, params, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axes), specs), out_specs=(P(), specs))
  def step(grads, opt_state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), opt_state)

  grads = jax.tree.map(lambda p: jnp.zeros((mesh.size, *p.shape)), params)
  return accounting.measure(step, grads, state, mesh=mesh)
