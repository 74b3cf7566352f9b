"""1-bit Adam (Tang et al. 2021): dense Adam warm-up, then frozen variance and 1-bit momentum."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomm._src.accounting import warmup as warmup_phase
from jaxcomm._src.mesh_axes import require_axes, require_varying
from jaxcomm._src.collectives.hierarchical import hierarchical_allreduce, init_states, level
from jaxcomm._src.collectives.strategies import Strategy, TwoPhase
from jaxcomm._src.compress.sign import sign
from jaxcomm._src.keys import unread_key
from jaxcomm._src.optim import hsdp
from jaxcomm._src.topology import HOST_AXIS, LOCAL_AXIS
from jaxcomm._src.validation import (check_float, check_float_tree, check_int_range, check_learning_rate,
                                     check_unit_interval)


class OneBitAdamState(NamedTuple):
  """State of :func:`onebit_adam`.

  Attributes:
    count: int32 steps taken.
    mu: first moment, replicated (the averaged momentum).
    nu: second moment, replicated; frozen after the warm-up.
    residuals: per leaf, the slow level's error feedback (two-phase: worker and server
      residuals), device-local.
  """
  count: jax.Array
  mu: Any
  nu: Any
  residuals: tuple


def adam_setup(b1: float, b2: float, eps: float, fast_axis: str, slow_axis: str,
               strategy: str | Strategy | None) -> tuple:
  """Validated ``(b1, b2, eps, onebit_levels, dense_levels)`` of the 1-bit Adams: 1-bit
  levels are full precision over ``fast_axis`` and scaled sign over ``slow_axis`` with
  ``strategy`` (checked and resolved as by :func:`jaxcomm.collectives.level`); dense levels
  full precision over both."""
  if fast_axis == slow_axis:
    raise ValueError(f"fast_axis and slow_axis must differ, both are {fast_axis!r}.")
  return (check_unit_interval("b1", b1), check_unit_interval("b2", b2),
          check_float("eps", eps, inclusive=True),
          (level(fast_axis), level(slow_axis, sign(), strategy=strategy)),
          (level(fast_axis), level(slow_axis)))


def allreduce_leaves(leaves, states, levels, key):
  """The mean of every leaf over ``levels``, each with its own state and folded key."""
  outputs, new_states = [], []
  for index, (leaf, state) in enumerate(zip(leaves, states)):
    out, state = hierarchical_allreduce(leaf, levels, state, jax.random.fold_in(key, index))
    outputs.append(out)
    new_states.append(state)
  return outputs, tuple(new_states)


def _dense_moments(leaves, mu, nu, b1: float, b2: float, levels, residuals):
  """Warm-up: Adam's moments of the full-precision mean gradient; residuals untouched."""
  averaged, _ = allreduce_leaves(leaves, [((), ())] * len(leaves), levels, unread_key())
  new_mu = [b1 * m + (1 - b1) * g for m, g in zip(mu, averaged)]
  new_nu = [b2 * v + (1 - b2) * g * g for v, g in zip(nu, averaged)]
  return new_mu, new_nu, residuals


def _onebit_momentum(leaves, mu, nu, b1: float, levels, residuals):
  """After the warm-up: the 1-bit mean of the local momenta; the variance stays frozen."""
  local_momentum = [b1 * m + (1 - b1) * g for m, g in zip(mu, leaves)]
  new_mu, residuals = allreduce_leaves(local_momentum, residuals, levels, unread_key())
  return new_mu, list(nu), residuals


def onebit_adam(learning_rate: optax.ScalarOrSchedule, *, warmup_steps: int, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8, fast_axis: str = LOCAL_AXIS,
                slow_axis: str = HOST_AXIS, strategy: str | Strategy | None = TwoPhase()
                ) -> optax.GradientTransformation:
  """1-bit Adam over a ``(slow, fast)`` mesh, from per-device gradients to parameter updates.

  For the first ``warmup_steps`` steps: the gradient is averaged at full precision and Adam
  runs as usual. Afterwards the variance ``nu`` is frozen (the paper's observation: it
  stabilizes early, and freezing it makes Adam's update linear in the momentum); each device
  forms its own momentum ``m_i = b1 mu + (1 - b1) g_i`` and the momenta are averaged by the
  compressed allreduce: full precision over ``fast_axis``, scaled sign (1 bit per element)
  over ``slow_axis`` with the two-phase collective and worker and server error feedback. The
  averaged momentum becomes ``mu``; the update is ``-lr * mu_hat / (sqrt(nu_hat) + eps)``
  with ``nu_hat`` corrected at the step it froze. Coordinates whose variance is still zero
  when it freezes (they had no gradient during the warm-up) are not updated afterwards:
  1-bit momentum gives them a non-zero value that a zero variance would blow up; make the
  warm-up long enough for every parameter that matters to have been used.

  Bytes per device and step after the warm-up, for a leaf of ``D`` bytes (``d`` elements),
  ``G`` devices per host and ``H`` hosts: ``2 (G-1)/G D`` over the fast axis and about
  ``2 (ceil(d/G)/8 + 4 H)`` over the slow axis (two-phase 1-bit chunks), against
  ``2 (H-1)/H D/G`` at full precision during the warm-up.

  Args:
    learning_rate: a float or an optax schedule of the 0-based step.
    warmup_steps: dense Adam steps before compression, >= 1 (the variance must be learned).
    b1: first-moment decay, in [0, 1).
    b2: second-moment decay, in [0, 1).
    eps: added to the root of the variance.
    fast_axis: intra-host mesh axis.
    slow_axis: inter-host mesh axis.
    strategy: how the slow axis sums the 1-bit momenta, as for
      :func:`jaxcomm.compressed_allreduce`: ``TwoPhase()`` (the paper's compressed
      allreduce, default), ``Gather()``, their names, or ``None`` (resolved for scaled sign:
      ``Gather()``).

  Returns:
    An ``optax.GradientTransformation`` that takes this device's gradients (see
    :func:`jaxcomm.optim.local_grad`) and returns the same update on every device; create its state
    with :func:`jaxcomm.optim.sharded_init`.

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021.
  """
  schedule = check_learning_rate("learning_rate", learning_rate)
  warmup_steps = check_int_range("warmup_steps", warmup_steps, 1)
  b1, b2, eps, compressed_levels, dense_levels = adam_setup(b1, b2, eps, fast_axis, slow_axis,
                                                            strategy)
  axes = (fast_axis, slow_axis)

  def init(params) -> OneBitAdamState:
    require_axes(axes, "onebit_adam.init")
    check_float_tree(params, "params")
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return OneBitAdamState(
        count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros,
        residuals=tuple(init_states(compressed_levels, leaf.size, jnp.float32)
                        for leaf in jax.tree.leaves(params)))

  def update(grads, state: OneBitAdamState, params=None):
    del params
    require_axes(axes, "onebit_adam.update")
    require_varying(grads, axes, "onebit_adam.update")
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    mu, nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    count = state.count + 1
    dense = functools.partial(_dense_moments, leaves, mu, nu, b1, b2, dense_levels)
    onebit = functools.partial(_onebit_momentum, leaves, mu, nu, b1, compressed_levels)
    new_mu, new_nu, residuals = jax.lax.cond(count <= warmup_steps, warmup_phase(dense), onebit,
                                             state.residuals)
    frozen_at = jnp.minimum(count, warmup_steps).astype(jnp.float32)
    mu_hat = 1 - b1 ** count.astype(jnp.float32)
    nu_hat = 1 - b2 ** frozen_at
    # A coordinate whose variance is still 0 (no gradient during the whole warm-up, e.g. an
    # unused embedding row) would be divided by eps once 1-bit momentum, which sends every
    # coordinate as +-scale, makes its momentum non-zero: it is not updated instead.
    rate = schedule(state.count)
    updates = [jnp.where(v > 0, -rate * (m / mu_hat) / (jnp.sqrt(v / nu_hat) + eps), 0.0)
               for m, v in zip(new_mu, new_nu)]
    updates = [u.astype(g.dtype) for u, g in zip(updates, jax.tree.leaves(grads))]
    return treedef.unflatten(updates), OneBitAdamState(
        count=count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu),
        residuals=residuals)

  return hsdp.shard_aware(optax.GradientTransformation(init, update))
