"""BMUF: block-wise model-update filtering, block momentum on periodically averaged models."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.mesh_axes import device_count
from jaxcomm._src.optim.periodic import periodic_averaging, worker_axes
from jaxcomm._src.validation import (check_bool, check_int_range, check_learning_rate,
                                     check_unit_interval)


class BlockMomentumState(NamedTuple):
  """State of :func:`block_momentum`.

  Attributes:
    update: ``Delta(t-1)``, the last filtered block update, parameter-shaped, replicated.
    count: int32 blocks filtered so far (the step of ``block_learning_rate``'s schedule).
  """
  update: optax.Updates
  count: jax.Array


def block_momentum(momentum: float | None, block_learning_rate: optax.ScalarOrSchedule,
                   nesterov: bool) -> optax.GradientTransformation:
  """The outer step of BMUF on the averaged pseudo-gradient ``mean_i (theta_init - theta_i)``.

  With ``W_g`` the global model and ``W_init`` the model every device started the block from
  (the ``theta_sync`` of :func:`~jaxcomm.optim.periodic.periodic_averaging`), the block's
  progress ``G = mean_i theta_i - W_init`` is filtered, ``Delta = momentum Delta_prev +
  block_learning_rate G``, and ``W_g <- W_g + Delta``. Classical block momentum starts the next
  block from ``W_g`` (``W_init = W_g``, step ``Delta``); Nesterov block momentum from the
  look-ahead point ``W_g + momentum Delta``, where ``G`` plays the gradient taken at the
  look-ahead point (measuring it from ``W_g`` instead counts ``momentum Delta_prev`` twice and
  diverges for ``momentum >= 1/2``). ``W_g = W_init - momentum Delta_prev`` is implicit and the
  step of ``W_init`` is ``(1 + momentum) Delta - momentum Delta_prev``. ``momentum=None`` is
  ``1 - 1/N`` for the ``N`` workers of the enclosing ``shard_map``: its devices, or its hosts
  under ``data_parallel(..., shard_over=)`` (:func:`~jaxcomm.optim.periodic.worker_axes`).
  ``block_learning_rate`` is a float or an optax schedule of the block.
  """
  rate = check_learning_rate("block_learning_rate", block_learning_rate)

  def init(params) -> BlockMomentumState:
    return BlockMomentumState(update=optax.tree.zeros_like(params),
                              count=jnp.zeros((), jnp.int32))

  def update(pseudo_gradient, state: BlockMomentumState, params=None):
    del params
    eta = 1 - 1 / device_count(worker_axes("bmuf")) if momentum is None else momentum
    lookahead = eta if nesterov else 0.0
    zeta = rate(state.count)
    new = jax.tree.map(lambda delta, previous: eta * previous - zeta * delta,
                       pseudo_gradient, state.update)
    steps = jax.tree.map(lambda now, previous: (1 + lookahead) * now - lookahead * previous,
                         new, state.update)
    return steps, BlockMomentumState(update=new, count=state.count + 1)

  return optax.GradientTransformation(init, update)


def bmuf(inner: optax.GradientTransformation, period: int, *, momentum: float | None = None,
         block_learning_rate: optax.ScalarOrSchedule = 1.0, nesterov: bool = True,
         sync: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
  """BMUF: ``period`` local steps of ``inner``, average, then a block-momentum step.

  Every ``period`` steps the devices average their models (through ``sync``, which may
  compress the pseudo-gradients with error feedback), the block update is filtered with
  momentum, ``Delta = momentum Delta_prev + block_learning_rate (mean_i theta_i - W_g)``,
  ``W_g <- W_g + Delta``, and every device restarts from ``W_g`` (classical) or
  ``W_g + momentum Delta`` (Nesterov). ``momentum = 0, block_learning_rate = 1`` is local SGD
  exactly. The defaults are the paper's, ``momentum = 1 - 1/N`` for ``N`` workers (devices;
  hosts under ``shard_over``) and ``block_learning_rate = 1``: averaging ``N`` models moves
  about ``1/N`` as far as ``N`` sequential blocks would, and the filter's gain
  ``1/(1 - momentum) = N`` makes up for it. Compared with :func:`jaxcomm.optim.slowmo`
  (which generalizes it), the momentum is of model updates rather than of
  learning-rate-normalized gradients, and the Nesterov variant moves the starting point
  rather than the global model.

  State: :class:`~jaxcomm.optim.periodic.PeriodicState` whose ``outer`` holds a
  :class:`BlockMomentumState` (replicated).

  Bytes per device per step: those of ``sync`` for all parameters divided by ``period``
  (dense two-level: ``2(G-1)/G D / period`` intra-host, ``2(H-1)/H D/G / period``
  inter-host for ``D`` parameter bytes, ``G`` devices per host, ``H`` hosts).

  Args:
    inner: the device-local optimizer, e.g. ``optax.sgd(0.1, momentum=0.9)``.
    period: ``tau >= 1`` local steps per block.
    momentum: block momentum ``eta`` in ``[0, 1)``; ``None``: ``1 - 1/N`` for ``N`` workers.
    block_learning_rate: ``zeta > 0``, a float or an optax schedule of the block.
    nesterov: Nesterov block momentum (BMUF-NBM) or classical (BMUF-CBM).
    sync: averaging transformation (default dense :func:`jaxcomm.compressed_allreduce`).

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    Chen & Huo, "Scalable training of deep learning machines by incremental block training
    with intra-block parallel optimization and blockwise model-update filtering", ICASSP 2016.
  """
  check_int_range("period", period, 1)
  if momentum is not None:
    momentum = check_unit_interval("momentum", momentum)
  block_learning_rate = check_learning_rate("block_learning_rate", block_learning_rate)
  nesterov = check_bool("nesterov", nesterov)
  return periodic_averaging(inner, block_momentum(momentum, block_learning_rate, nesterov),
                            period, sync=sync)
