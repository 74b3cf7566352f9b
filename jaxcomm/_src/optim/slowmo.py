"""SlowMo: slow momentum on the pseudo-gradient of periodically averaged local models."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.optim.periodic import periodic_averaging
from jaxcomm._src.validation import check_int_range, check_learning_rate, check_unit_interval


class SlowMomentumState(NamedTuple):
  """State of :func:`slow_momentum`.

  Attributes:
    momentum: the slow momentum buffer ``u``, parameter-shaped, replicated.
    count: int32 number of outer steps taken.
  """
  momentum: optax.Updates
  count: jax.Array


def slow_momentum(base_learning_rate: optax.ScalarOrSchedule, beta: float,
                  alpha: optax.ScalarOrSchedule, period: int) -> optax.GradientTransformation:
  """The outer step of SlowMo on the averaged pseudo-gradient ``Delta``.

  ``d = Delta / gamma_t``; ``u = beta u + d``; step ``= -alpha gamma_t u``, with ``gamma_t``
  the base (inner) learning rate at the inner step of this synchronization
  (``outer_count * period``). Dividing by ``gamma_t`` makes ``u`` a momentum of gradients,
  not of learning-rate-scaled steps, as in the paper.

  Args:
    base_learning_rate: the inner optimizer's learning rate, a float or an optax schedule of
      the inner step.
    beta: slow momentum in ``[0, 1)``.
    alpha: slow learning rate ``> 0``, a float or an optax schedule of the outer step.
    period: inner steps per outer step.
  """
  schedule = check_learning_rate("base_learning_rate", base_learning_rate)
  slow_rate = check_learning_rate("alpha", alpha)

  def init(params) -> SlowMomentumState:
    return SlowMomentumState(momentum=jax.tree.map(jnp.zeros_like, params),
                             count=jnp.zeros((), jnp.int32))

  def update(delta, state: SlowMomentumState, params=None):
    del params
    gamma = schedule(state.count * period)
    momentum = jax.tree.map(lambda u, d: beta * u + d / gamma, state.momentum, delta)
    steps = jax.tree.map(lambda u: -slow_rate(state.count) * gamma * u, momentum)
    return steps, SlowMomentumState(momentum=momentum, count=state.count + 1)

  return optax.GradientTransformation(init, update)


def slowmo(inner: optax.GradientTransformation, period: int,
           base_learning_rate: float | optax.Schedule, *, beta: float = 0.5,
           alpha: optax.ScalarOrSchedule = 1.0,
           sync: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
  """SlowMo: ``period`` local steps of ``inner``, average, then a slow momentum step.

  Every ``period`` steps: ``d = (theta_sync - mean_i theta_i) / gamma``,
  ``u = beta u + d``, ``theta_sync = theta_sync - alpha gamma u``, and every device restarts
  from ``theta_sync``. The inner optimizer's own buffers stay local (the paper's variant
  without buffer averaging). ``beta = 0, alpha = 1`` is local SGD (up to the rounding of
  ``gamma (Delta / gamma)``).

  State: :class:`~jaxcomm.optim.periodic.PeriodicState` whose ``outer`` holds a
  :class:`SlowMomentumState` (replicated).

  Bytes per device per step: those of ``sync`` for all parameters divided by ``period``.

  Args:
    inner: the base optimizer, e.g. ``optax.sgd(0.1, momentum=0.9)``.
    period: ``H >= 1`` local steps between averagings (``tau`` in the paper).
    base_learning_rate: ``gamma``, the base optimizer's learning rate (float or schedule).
    beta: slow momentum in ``[0, 1)``.
    alpha: slow learning rate ``> 0``, a float or an optax schedule of the outer step.
    sync: averaging transformation (default dense :func:`jaxcomm.compressed_allreduce`).

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    Wang, Tantia, Ballas & Rabbat, "SlowMo: Improving Communication-Efficient Distributed SGD
    with Slow Momentum", ICLR 2020.
  """
  check_int_range("period", period, 1)
  beta = check_unit_interval("beta", beta)
  alpha = check_learning_rate("alpha", alpha)
  return periodic_averaging(inner, slow_momentum(base_learning_rate, beta, alpha, period),
                            period, sync=sync)
