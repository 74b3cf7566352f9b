"""BMUF: the block-momentum recursion, local SGD as its zero-momentum case, training."""

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm._src.optim.bmuf import block_momentum, bmuf
from jaxcomm._src.optim.local_sgd import local_sgd

from lowcomm_helpers import eval_loss, train

LR = 0.1


@pytest.mark.parametrize("scheduled", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_block_momentum_follows_the_papers_recursion(nesterov, scheduled):
  eta = 0.75
  zeta = lambda block: 1.5 * 0.5 ** block if scheduled else 1.5
  rng = np.random.default_rng(0)
  tx = block_momentum(eta, optax.exponential_decay(1.5, 1, 0.5) if scheduled else 1.5, nesterov)
  start = rng.normal(size=5)
  state = tx.init(jnp.asarray(start))
  w_init = start.copy()          # where every device starts the block
  w_g, delta = start.copy(), np.zeros(5)
  for block in range(4):
    mean_local = w_init + rng.normal(size=5)  # mean of the devices' models after the block
    step, state = tx.update(jnp.asarray(w_init - mean_local), state)
    delta = eta * delta + zeta(block) * (mean_local - w_init)
    w_g = w_g + delta
    expected_init = w_g + eta * delta if nesterov else w_g
    np.testing.assert_allclose(w_init + np.asarray(step), expected_init, rtol=1e-5, atol=1e-5)
    w_init = expected_init


def test_zero_momentum_unit_block_rate_is_local_sgd():
  expected = train(local_sgd(optax.sgd(LR), 4), 8, local=True)[0]
  params = train(bmuf(optax.sgd(LR), 4, momentum=0.0), 8, local=True)[0]
  chex.assert_trees_all_close(params, expected, atol=1e-6)


def test_default_block_momentum_beats_local_sgd_on_the_mlp():
  # Averaging 8 models moves ~1/8 as far as 8 sequential blocks; the default 1 - 1/8 filter
  # makes up for it (measured: 0.67 against 0.85 for local SGD and synchronous SGD).
  steps = 60
  params, _, losses, *_ = train(bmuf(optax.sgd(LR), 4), steps, local=True)
  local = train(local_sgd(optax.sgd(LR), 4), steps, local=True)[0]
  assert eval_loss(params, local=True) < eval_loss(local, local=True) - 0.1, losses


@pytest.mark.parametrize("kwargs, match", [
    (dict(period=0, momentum=0.5), "period must be >= 1, got 0"),
    (dict(period=4, momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
    (dict(period=4, momentum=-0.1), "momentum must be a finite float >= 0, got -0.1"),
    (dict(period=4, momentum=0.5, block_learning_rate=0.0),
     "block_learning_rate must be a finite float > 0, got 0.0"),
    (dict(period=4, momentum=0.5, nesterov=1), "nesterov must be a bool, got 1"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    bmuf(optax.sgd(LR), **kwargs)
