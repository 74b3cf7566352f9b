"""Adam run per host whose second moment estimates the global mean gradient's, for
:func:`jaxcomm.optim.compress_updates` (``host_variance=True``).

A host's Adam sees its host mean ``g_h``, the mean over ``1/H`` of the global batch, whose
noise variance is ``H`` times the global mean's: ``E[g_h^2] = mu^2 + H sigma^2`` against
``E[g^2] = mu^2 + sigma^2`` (``sigma^2`` the global mean's variance). Adam's second moment is
inflated by it and every step shrinks; averaging the hosts' updates cancels the first moment's
extra noise (it is linear) but not the denominator's. On the GPT quality task the per-host
``sqrt(v)`` is about 1.2x the global one and the averaged step about 0.87x as long
(docs/quality.md, section 10). A host can estimate its mean's variance from its own devices
(``s^2 / G``, ``s^2`` their sample variance: an intra-host reduction) and subtract the excess:
``E[g^2] = E[g_h^2] - (1 - 1/H) Var[g_h]``, with no inter-host byte.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByHostAdamState(NamedTuple):
  """State of :func:`scale_by_host_adam`.

  Attributes:
    count: steps taken, int32 scalar.
    mu: first moment of the host mean gradient (shapes of the parameters).
    nu: second moment of the host mean gradient.
    noise: moving average (decay ``b2``) of the host mean's estimated variance.
  """
  count: jax.Array
  mu: Any
  nu: Any
  noise: Any


def scale_by_host_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
                       ) -> optax.GradientTransformationExtraArgs:
  """Adam on a host's mean gradient, its second moment corrected to the global mean's.

  ``update(g_h, state, params, *, host_variance, hosts)``: ``host_variance`` is the estimated
  variance of ``g_h`` (a pytree like ``g_h``, ``>= 0``), ``hosts`` the number ``H`` of hosts
  whose updates are averaged. With ``w`` the moving average of ``host_variance`` the step is
  ``m_hat / (sqrt(max(v_hat - (1 - 1/H) w_hat, v_hat / H)) + eps)``: the floor is the least
  ``E[g^2]`` can be (``(mu^2 + sigma^2 H) / H <= mu^2 + sigma^2``). With ``hosts=1`` or a zero
  variance it is ``optax.scale_by_adam(b1, b2, eps)``. Memory: three moments per parameter.

  Args:
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment and of the variance, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` raises ``TypeError`` without
    ``host_variance`` and ``hosts`` (use it inside ``compress_updates(...,
    host_variance=True)``).
  """
  for name, value in (("b1", b1), ("b2", b2)):
    if not 0 <= value < 1:
      raise ValueError(f"{name} must be in [0, 1), got {value}.")
  if not eps >= 0:
    raise ValueError(f"eps must be >= 0, got {eps}.")

  def init(params) -> ScaleByHostAdamState:
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
    return ScaleByHostAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros())

  def update(updates, state: ScaleByHostAdamState, params=None, *, host_variance=None,
             hosts=None, **extra_args):
    del params, extra_args
    if host_variance is None or hosts is None:
      raise TypeError("scale_by_host_adam.update needs host_variance= and hosts=: use it "
                      "inside jaxcomm.optim.compress_updates(..., host_variance=True).")
    count = optax.safe_increment(state.count)
    mu = optax.tree_utils.tree_update_moment(updates, state.mu, b1, 1)
    nu = optax.tree_utils.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
    noise = optax.tree_utils.tree_update_moment(host_variance, state.noise, b2, 1)
    m_hat = optax.tree_utils.tree_bias_correction(mu, b1, count)

    def step(m, v, w):
      v_global = jnp.maximum(v - (1 - 1 / hosts) * w, v / hosts) / (1 - b2 ** count)
      return m / (jnp.sqrt(v_global) + eps)

    return (jax.tree.map(step, m_hat, nu, noise),
            ScaleByHostAdamState(count=count, mu=mu, nu=nu, noise=noise))

  return optax.GradientTransformationExtraArgs(init, update)


def host_adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4
               ) -> optax.GradientTransformationExtraArgs:
  """``optax.adamw`` with :func:`scale_by_host_adam` in place of ``scale_by_adam``: the inner
  optimizer of ``compress_updates(host_adamw(lr), compressor, host_variance=True)``.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled weight decay (optax.adamw's default 1e-4), on every leaf.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> tx = jaxcomm.optim.compress_updates(jaxcomm.optim.host_adamw(3e-3), jaxcomm.sign(),
    ...                                     host_variance=True)  # doctest: +SKIP
  """
  return optax.chain(scale_by_host_adam(b1, b2, eps), optax.add_decayed_weights(weight_decay),
                     optax.scale_by_learning_rate(learning_rate))
