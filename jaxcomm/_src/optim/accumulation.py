"""Gradient accumulation whose communication really runs once per ``k`` micro-steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.mesh_axes import vary, vary_tree
from jaxcomm._src.validation import check_int_range


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    inner: the wrapped chain's state (only changed on the ``k``-th micro-step).
    gradient_sum: gradient-shaped running sum of this window's micro-step gradients
      (device-local when the gradients are).
    count: int32 micro-step counter.
  """
  inner: Any
  gradient_sum: Any
  count: jax.Array


def _zeros_like_output(abstract):
  zeros = jnp.zeros(abstract.shape, abstract.dtype)
  varying = tuple(abstract.manual_axis_type.varying) if hasattr(abstract, "manual_axis_type") \
      else ()
  return vary(zeros, varying)


def accumulate_gradients(tx: optax.GradientTransformation, k: int) -> optax.GradientTransformation:
  """Sums ``k`` micro-step gradients locally, then runs ``tx`` once on their mean.

  ``optax.MultiSteps`` calls the inner ``update`` on *every* micro-step and keeps its result
  only on the ``k``-th (``jnp.where`` on the updates and state): around a chain that starts
  with :func:`jaxcomm.compressed_allreduce`, its collectives execute every micro-step, ``k``
  times the traffic. Here ``tx.update`` sits in the taken branch of ``lax.cond``, so the
  collectives inside it execute only on the ``k``-th micro-step; the other micro-steps
  return zero updates and move no bytes.

  Bytes per device per micro-step: those of ``tx`` divided by ``k`` (none on ``k-1`` of
  ``k`` micro-steps).

  Args:
    tx: the chain to run every ``k`` micro-steps, e.g.
      ``optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.01)),
      optax.sgd(0.1, momentum=0.9))``.
    k: micro-steps per update, ``>= 1``.

  Returns:
    An ``optax.GradientTransformation`` whose state is :class:`AccumulationState`.
  """
  k = check_int_range("k", k, 1)

  def init(params) -> AccumulationState:
    # Inside shard_map, per-device gradients differ on every device: so does their sum.
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    zeros = vary_tree(jax.tree.map(jnp.zeros_like, params), axes)
    return AccumulationState(inner=tx.init(params), gradient_sum=zeros,
                             count=jnp.zeros((), jnp.int32))

  def update(grads, state: AccumulationState, params=None):
    total = jax.tree.map(lambda s, g: s + g.astype(s.dtype), state.gradient_sum, grads)

    def emit(operands):
      total, inner = operands
      mean = jax.tree.map(lambda s, g: (s / k).astype(g.dtype), total, grads)
      updates, inner = tx.update(mean, inner, params)
      return updates, inner, jax.tree.map(jnp.zeros_like, total)

    def hold(operands):
      total, inner = operands
      shapes = jax.eval_shape(lambda ops: emit(ops)[0], operands)
      return jax.tree.map(_zeros_like_output, shapes), inner, total

    updates, inner, total = jax.lax.cond((state.count + 1) % k == 0, emit, hold,
                                         (total, state.inner))
    return updates, AccumulationState(inner=inner, gradient_sum=total, count=state.count + 1)

  return optax.GradientTransformation(init, update)
