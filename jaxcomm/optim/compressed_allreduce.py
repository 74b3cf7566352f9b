"""``compressed_allreduce``: the topology-aware gradient mean as an optax transformation."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm.collectives.axes import require_axes, require_varying
from jaxcomm.collectives.hierarchical import hierarchical_allreduce, shard_size
from jaxcomm.compress.base import Compressor, check_float_input
from jaxcomm.compress.error_feedback import error_feedback
from jaxcomm.topology import HOST_AXIS, LOCAL_AXIS


class CompressedAllReduceState(NamedTuple):
  """State of :func:`compressed_allreduce`.

  Attributes:
    compressor_state: one compressor state per gradient leaf, for that leaf's ``ceil(d/G)``
      shard. Device-local (varying over both mesh axes): inside ``shard_map`` a leaf of shape
      ``(n,)`` is this device's; outside it is the ``(H*G*n,)`` concatenation, sharded with
      ``PartitionSpec((slow_axis, fast_axis))``. :func:`jaxcomm.sharded_init` builds these specs.
    key: PRNG key, replicated; split every step.
    count: int32 step counter, replicated.
  """
  compressor_state: Any
  key: jax.Array
  count: jax.Array


def _validate_compressor(compressor: Compressor | None) -> None:
  if compressor is not None and not isinstance(compressor, Compressor):
    raise TypeError(
        f"compressor must be a jaxcomm.Compressor or None, got {type(compressor).__name__}.")


def compressed_allreduce(
    compressor: Compressor | None,
    *,
    feedback: bool = True,
    fast_axis: str = LOCAL_AXIS,
    slow_axis: str = HOST_AXIS,
    seed: int = 0,
) -> optax.GradientTransformation:
  """Averages per-device gradients: full precision inside a host, compressed across hosts.

  Place it first in an ``optax.chain``; the transformations after it see the global mean
  gradient, identical on every device. Both ``init`` and ``update`` run inside
  ``jax.shard_map`` over a mesh with ``fast_axis`` and ``slow_axis``. The state is partly
  device-local: create it with :func:`jaxcomm.sharded_init`, which also returns the
  ``PartitionSpec`` pytree to use for it in the train step's ``in_specs``/``out_specs``.

  Bytes per device and step, for each gradient leaf of ``D`` bytes, ``G`` devices per host,
  ``H`` hosts and a payload of ``c`` bytes for the leaf's ``1/G`` shard:
  ``2(G-1)/G * D`` over the fast axis and ``(H-1) * c`` over the slow axis
  (see :func:`jaxcomm.collectives.hierarchical_allreduce`).

  Args:
    compressor: compressor for the slow axis, e.g. ``jaxcomm.topk(0.01)``; ``None`` for full
      precision everywhere.
    feedback: wrap the compressor in :func:`jaxcomm.error_feedback` (recommended for biased
      compressors such as top-k and sign; ignored when ``compressor`` is None).
    fast_axis: the intra-host mesh axis name.
    slow_axis: the inter-host mesh axis name.
    seed: seed of the PRNG key used by stochastic compressors.

  Returns:
    An ``optax.GradientTransformation``. ``update(grads, state, params=None)`` expects this
    device's own gradients (varying over both axes: see :func:`jaxcomm.local_grad`) and
    returns the mean.

  Example:
    >>> tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.01)),
    ...                  optax.adamw(1e-3))  # doctest: +SKIP
  """
  _validate_compressor(compressor)
  if not isinstance(feedback, bool):
    raise TypeError(f"feedback must be a bool, got {feedback!r}.")
  for name, axis in (("fast_axis", fast_axis), ("slow_axis", slow_axis)):
    if not isinstance(axis, str) or not axis:
      raise TypeError(f"{name} must be a non-empty mesh axis name, got {axis!r}.")
  if fast_axis == slow_axis:
    raise ValueError(f"fast_axis and slow_axis must differ, both are {fast_axis!r}.")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"seed must be an int, got {seed!r}.")
  if compressor is not None and feedback:
    compressor = error_feedback(compressor)
  axes = (slow_axis, fast_axis)

  def init(params) -> CompressedAllReduceState:
    require_axes(axes, "compressed_allreduce.init")
    fast_size = jax.lax.axis_size(fast_axis)

    def leaf_state(leaf):
      check_float_input(leaf, "params")
      if compressor is None:
        return ()
      shape = (shard_size(leaf.size, fast_size),)
      return jax.lax.pcast(compressor.init(shape, leaf.dtype), axes, to="varying")

    return CompressedAllReduceState(
        compressor_state=jax.tree.map(leaf_state, params),
        key=jax.random.PRNGKey(seed),
        count=jnp.zeros((), jnp.int32))

  def update(grads, state: CompressedAllReduceState, params=None):
    del params
    require_axes(axes, "compressed_allreduce.update")
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
      check_float_input(grad, f"grads{jax.tree_util.keystr(path)}")
    require_varying(grads, axes, "compressed_allreduce.update")
    key, step_key = jax.random.split(state.key)
    leaves, treedef = jax.tree.flatten(grads)
    states = treedef.flatten_up_to(state.compressor_state)
    means, new_states = [], []
    for index, (grad, leaf_state) in enumerate(zip(leaves, states)):
      mean, leaf_state = hierarchical_allreduce(
          grad, compressor, leaf_state, jax.random.fold_in(step_key, index),
          fast_axis=fast_axis, slow_axis=slow_axis)
      means.append(mean)
      new_states.append(leaf_state)
    new_state = CompressedAllReduceState(
        compressor_state=treedef.unflatten(new_states), key=key, count=state.count + 1)
    return treedef.unflatten(means), new_state

  return optax.GradientTransformation(init, update)
