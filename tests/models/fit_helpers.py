"""Fits a model to one fixed batch with Adam on one device."""

import jax
import optax


def adam_losses(loss_fn, params, batch, steps: int, learning_rate: float = 1e-2) -> list[float]:
  """The loss before each of ``steps`` Adam steps on ``batch``."""
  tx = optax.adam(learning_rate)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  state, losses = tx.init(params), []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return losses
