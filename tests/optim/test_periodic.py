"""Local SGD, post-local SGD, DiLoCo, streaming DiLoCo, SlowMo, FedAvg and FedProx."""

import itertools

import chex
import jax
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm._src.optim.diloco import diloco
from jaxcomm._src.optim.fedavg import fedavg, fedprox
from jaxcomm._src.optim.local_sgd import local_sgd
from jaxcomm._src.optim.slowmo import slowmo
from jax.sharding import PartitionSpec as P

from lowcomm_helpers import (AXES, batch, consensus, eval_loss, numpy_roundtrip, problem,
                             sync_sgd, train)

LR = 0.1


def test_local_sgd_with_period_one_is_synchronous_sgd():
  expected = sync_sgd(LR, 3)[0]
  params = train(local_sgd(optax.sgd(LR), 1), 3, local=True)[0]
  chex.assert_trees_all_close(consensus(params, True), expected, atol=1e-6)


def test_diloco_with_period_one_and_plain_outer_sgd_is_synchronous():
  expected = sync_sgd(LR, 3)[0]
  params = train(diloco(optax.sgd(LR), 1, outer=optax.sgd(1.0)), 3, local=True)[0]
  chex.assert_trees_all_close(consensus(params, True), expected, atol=1e-6)


def test_slowmo_with_beta_zero_alpha_one_is_local_sgd():
  expected = train(local_sgd(optax.sgd(LR), 4), 8, local=True)[0]
  params = train(slowmo(optax.sgd(LR), 4, LR, beta=0.0, alpha=1.0), 8, local=True)[0]
  chex.assert_trees_all_close(params, expected, atol=1e-6)


def test_fedprox_with_mu_zero_is_fedavg_and_mu_pulls_clients_together():
  sizes = [1, 2, 3, 4, 5, 6, 7, 8]
  common = dict(client_sizes=sizes, clients_per_round=5, seed=3)
  expected = train(fedavg(optax.sgd(LR), 4, **common), 6, local=True)[0]
  params = train(fedprox(optax.sgd(LR), 4, 0.0, **common), 6, local=True)[0]
  chex.assert_trees_all_equal(params, expected)
  spread = lambda p: float(sum(np.sum(np.var(np.asarray(x).reshape(8, -1), axis=0))
                               for x in jax.tree.leaves(p)))
  proximal = train(fedprox(optax.sgd(LR), 4, 5.0, **common), 6, local=True)[0]
  assert spread(proximal) < 0.8 * spread(expected)


@pytest.mark.parametrize("make", [
    lambda rate: fedavg(optax.sgd(LR), 2, server_learning_rate=rate, client_sizes=range(1, 9),
                        clients_per_round=5),
    lambda rate: slowmo(optax.sgd(LR), 2, LR, alpha=rate),
], ids=["fedavg_server_learning_rate", "slowmo_alpha"])
def test_an_outer_learning_rate_may_be_a_schedule_of_the_round(make):
  halving = optax.exponential_decay(1.0, 1, 0.5, staircase=True)  # round 0: 1.0, round 1: 0.5
  runs = [train(make(rate), 2, local=True) for rate in (halving, 1.0)]
  chex.assert_trees_all_close(runs[0][0], runs[1][0], atol=1e-7)  # the first round alike
  data = problem()[2]
  second = []
  for params, state, _, step, _ in runs:
    for i in (2, 3):
      params, state, _ = step(params, state, batch(data, i))
      jax.block_until_ready(params)
    second.append(jax.tree.leaves(params)[0])
  assert not np.allclose(*second, atol=1e-5)  # the second round at half the rate


def test_fedavg_averages_a_sampled_subset_weighted_by_sample_count():
  sizes = np.arange(1.0, 9.0)
  clients = train(local_sgd(optax.sgd(LR), 100), 2, local=True)[0]  # each client's own w_k
  averaged = train(fedavg(optax.sgd(LR), 2, client_sizes=sizes, clients_per_round=3, seed=1),
                   2, local=True)[0]
  per_client = lambda tree: np.concatenate(
      [np.asarray(x).reshape(8, -1) for x in jax.tree.leaves(tree)], axis=1)
  w, result = per_client(clients), per_client(averaged)
  np.testing.assert_allclose(result, np.broadcast_to(result[0], result.shape), atol=1e-6)
  matches = [subset for subset in itertools.combinations(range(8), 3)
             if np.allclose(sizes[list(subset)] @ w[list(subset)] / sizes[list(subset)].sum(),
                            result[0], atol=1e-5)]
  assert len(matches) == 1, matches
  unweighted = w[list(matches[0])].mean(axis=0)
  assert not np.allclose(unweighted, result[0], atol=1e-5)


ALGORITHMS = {
    "local_sgd": lambda: local_sgd(optax.sgd(LR), 4, warmup_steps=4),
    "diloco": lambda: diloco(optax.adam(3e-3), 4),
    "diloco_sign_ef": lambda: diloco(optax.adam(3e-3), 4,
                                     sync=jaxcomm.compressed_allreduce(jaxcomm.sign())),
    "streaming_diloco": lambda: diloco(optax.adam(3e-3), 4, fragments=2, delay=1, mixing=0.5),
    "slowmo": lambda: slowmo(optax.sgd(LR), 4, LR, beta=0.5),
    "fedavg": lambda: fedavg(optax.sgd(LR), 4, client_sizes=range(1, 9), clients_per_round=6),
}
STEPS = 60
TOLERANCE = 0.1  # absolute, on a loss of about 0.5 after 60 steps


@pytest.fixture(scope="module")
def baseline_loss():
  return eval_loss(sync_sgd(LR, STEPS)[0])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_trains_the_mlp_close_to_synchronous_sgd_and_resumes_from_numpy(name, baseline_loss):
  tx = ALGORITHMS[name]()
  params, state, losses, step, specs = train(tx, STEPS, local=True)
  assert eval_loss(params, local=True) < baseline_loss + TOLERANCE, (losses, baseline_loss)
  assert losses[-1] < 0.8 * losses[0]
  data, mesh = problem()[2:]
  two_steps = lambda p, st: step(*step(p, st, batch(data, STEPS))[:2], batch(data, STEPS + 1))
  restored = numpy_roundtrip((params, state), (P(AXES), specs), mesh)
  chex.assert_trees_all_equal(two_steps(params, state)[:2], two_steps(*restored)[:2])


@pytest.mark.parametrize("make, match", [
    (lambda: local_sgd(optax.sgd(LR), 0), "period must be >= 1, got 0"),
    (lambda: local_sgd(optax.sgd(LR), 2, warmup_steps=-1), "warmup_steps must be >= 0, got -1"),
    (lambda: diloco(optax.sgd(LR), 1.5), "period must be an int, got 1.5"),
    (lambda: diloco(optax.sgd(LR), 6, fragments=4), "period must be a multiple of fragments"),
    (lambda: diloco(optax.sgd(LR), 8, fragments=2, delay=4), r"delay must be in \[0, 3\], got 4"),
    (lambda: diloco(optax.sgd(LR), 4, mixing=1.0), r"mixing must be in \[0, 1\), got 1.0"),
    (lambda: slowmo(optax.sgd(LR), 4, LR, beta=1.0), r"beta must be in \[0, 1\), got 1.0"),
    (lambda: slowmo(optax.sgd(LR), 4, LR, alpha=0.0), "alpha must be a finite float > 0"),
    (lambda: slowmo(optax.sgd(LR), 4, LR, alpha="1"), "alpha must be a float"),
    (lambda: fedavg(optax.sgd(LR), 2, client_sizes=[1, -2]), "client_sizes must be"),
    (lambda: fedavg(optax.sgd(LR), 2, clients_per_round=0), "clients_per_round must be >= 1"),
    (lambda: fedavg(optax.sgd(LR), 2, server_learning_rate="1"), "server_learning_rate must be"),
    (lambda: fedprox(optax.sgd(LR), 2, -0.1), "mu must be a finite float >= 0, got -0.1"),
    (lambda: fedavg(optax.sgd(LR), 2, seed=jax.random.split(jax.random.key(0), 2)),
     "seed must be an int seed, a jax.random.key"),
])
def test_bad_arguments_raise_at_construction_naming_parameter_and_value(make, match):
  with pytest.raises((ValueError, TypeError), match=match):
    make()
