"""Staleness: tau-step delayed gradients, staleness-scaled learning rate, DC-ASGD."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm._src.optim.staleness import staleness
from lowcomm_helpers import batch, eval_loss, numpy_roundtrip, problem, sync_sgd, train

A = jnp.array([[2.0, 0.5], [0.5, 1.0], [0.3, -0.7]])
B = jnp.array([1.0, -2.0, 0.5])
loss = lambda w: 0.5 * jnp.sum(jnp.square(A @ w["w"] - B))
LR = 0.1


def run(tx, steps):
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  trajectory = [params]
  for _ in range(steps):
    params, state = step(params, state)
    trajectory.append(params)
  return trajectory, state


def reference(tau, lr, compensation=0.0):
  """w_{t+1} = w_t - lr g(w_{t-tau}), with zero updates while t < tau, in numpy."""
  a, b = np.asarray(A, np.float64), np.asarray(B, np.float64)
  ws = [np.zeros(2)]
  for t in range(12):
    if t < tau:
      ws.append(ws[-1])
      continue
    g = a.T @ (a @ ws[t - tau] - b)
    g = g + compensation * g * g * (ws[t] - ws[t - tau])
    ws.append(ws[t] - lr * g)
  return ws


def test_tau_zero_is_synchronous():
  sync = run(optax.sgd(LR), 12)[0]
  delayed = run(optax.chain(staleness(0, scaling="linear"), optax.sgd(LR)), 12)[0]
  chex.assert_trees_all_equal(sync, delayed)


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("linear", 1 / 4),
                                             ("sqrt", 0.5), ("exponential", 0.5 ** 3)])
def test_gradients_arrive_tau_steps_late_with_scaled_learning_rate(scaling, factor):
  trajectory = run(optax.chain(staleness(3, scaling=scaling, base=0.5), optax.sgd(LR)), 12)[0]
  expected = reference(3, LR * factor)
  np.testing.assert_allclose(np.stack([w["w"] for w in trajectory]), np.stack(expected),
                             rtol=1e-5, atol=1e-6)


def test_dc_asgd_with_lambda_zero_is_the_stale_update_and_lambda_compensates():
  stale = run(optax.chain(staleness(2), optax.sgd(LR)), 12)[0]
  zero = run(optax.chain(staleness(2, compensation=0.0), optax.sgd(LR)), 12)[0]
  chex.assert_trees_all_equal(stale, zero)
  compensated = run(optax.chain(staleness(2, compensation=0.5), optax.sgd(LR)), 12)[0]
  np.testing.assert_allclose(np.stack([w["w"] for w in compensated]),
                             np.stack(reference(2, LR, compensation=0.5)), rtol=1e-5, atol=1e-6)


def test_trains_the_mlp_close_to_synchronous_sgd_and_resumes_from_numpy():
  # eta = 0.1 sqrt(3): the staleness-scaled rate eta / sqrt(1 + tau) is the baseline's 0.1
  tx = optax.chain(jaxcomm.compressed_allreduce(),
                   staleness(2, scaling="sqrt", compensation=0.1), optax.sgd(0.1 * 3 ** 0.5))
  params, state, losses, step, specs = train(tx, 40)
  assert eval_loss(params) < eval_loss(sync_sgd(0.1, 40)[0]) + 0.1
  data, mesh = problem()[2:]
  two = lambda p, s: step(*step(p, s, batch(data, 40))[:2], batch(data, 41))[:2]
  chex.assert_trees_all_equal(two(params, state), two(params, numpy_roundtrip(state, specs, mesh)))


@pytest.mark.parametrize("kwargs, match", [
    ({"tau": -1}, "tau must be >= 0, got -1"),
    ({"tau": 1, "scaling": "cubic"}, "scaling must be one of .*'cubic'"),
    ({"tau": 1, "base": 1.5}, r"base must be in \(0, 1\], got 1.5"),
    ({"tau": 1, "compensation": -1.0}, "compensation must be a finite float >= 0, got -1.0"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    staleness(**kwargs)
