"""Creating and sharding optimizer state that is partly device-local.

jaxcomm state mixes replicated leaves (PRNG keys, counters, and the moments of an optimizer
chained after the allreduce) with device-local ones (error-feedback residuals, which differ on
every device). Inside ``jax.shard_map`` JAX tracks which mesh axes a value varies over; the
helpers here read that from a trace of ``tx.init`` and turn it into ``PartitionSpec`` s.
A device-local leaf of local shape ``(n, ...)`` becomes a global array of shape
``(devices * n, ...)`` sharded along its first dimension.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _leaf_spec(leaf, mesh: Mesh) -> PartitionSpec:
  varying = [axis for axis in mesh.axis_names if axis in jax.typeof(leaf).mat.varying]
  if not varying:
    return PartitionSpec()
  if leaf.ndim == 0:
    raise ValueError(f"A device-local state leaf must have at least one dimension to be "
                     f"sharded over {tuple(varying)}; got a scalar of dtype {leaf.dtype}.")
  return PartitionSpec(tuple(varying) if len(varying) > 1 else varying[0])


def state_specs(tx: optax.GradientTransformation, params, mesh: Mesh,
                params_spec=PartitionSpec()):
  """``PartitionSpec`` pytree for ``tx.init(params)`` run inside ``shard_map`` over ``mesh``.

  Replicated leaves get ``P()``; device-local leaves get ``P(varying_axes)`` on their first
  dimension. Nothing is computed: ``tx.init`` is only traced.

  Args:
    tx: the transformation, e.g. an ``optax.chain`` starting with ``compressed_allreduce``.
    params: parameters (arrays or ``jax.ShapeDtypeStruct``), as passed to the train step.
    mesh: the mesh of the train step's ``shard_map``.
    params_spec: the ``in_specs`` entry of ``params`` (default replicated).

  Returns:
    A pytree of ``PartitionSpec`` with the structure of the optimizer state.
  """
  found = []

  def probe(local_params):
    found.append(jax.tree.map(lambda leaf: _leaf_spec(leaf, mesh), tx.init(local_params)))
    return ()

  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(params_spec,), out_specs=()),
                 abstract)
  return found[0]


def sharded_init(tx: optax.GradientTransformation, params, mesh: Mesh,
                 params_spec=PartitionSpec()):
  """Runs ``tx.init`` inside ``shard_map`` and returns ``(state, specs)``.

  Use ``specs`` for the state in the train step's ``in_specs`` and ``out_specs``.

  Args:
    tx: the transformation.
    params: parameters, as passed to the train step.
    mesh: the train step's mesh.
    params_spec: the ``in_specs`` entry of ``params`` (default replicated).

  Returns:
    ``(state, specs)``: the initial state, each leaf a global ``jax.Array`` laid out on
    ``mesh`` as ``specs`` says, and the ``PartitionSpec`` pytree.

  Example:
    >>> opt_state, opt_specs = jaxcomm.optim.sharded_init(tx, params, mesh)  # doctest: +SKIP
  """
  specs = state_specs(tx, params, mesh, params_spec)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(params_spec,), out_specs=specs),
                 out_shardings=jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))
  return init(params), specs
