"""The planner: least modeled time within the error budget, and a policy that runs."""

import jax
import jax.numpy as jnp
import pytest

import jaxcomm
from update_helpers import update_fn

AXES = ("host", "local")


def _grads():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"big": {"kernel": jax.random.normal(keys[0], (256, 128))},
          "small": {"bias": jax.random.normal(keys[1], (16,))},
          "mid": {"kernel": jax.random.normal(keys[2], (64, 32))}}


def test_zero_error_budget_keeps_everything_at_full_precision():
  result = jaxcomm.plan(_grads(), hosts=4, local=2, slow_link="1gbe", max_error=0.0)
  assert all(leaf.compressor is None for leaf in result.leaves)
  assert result.seconds == pytest.approx(result.dense_seconds)


def test_a_slow_link_gets_compressed_leaves_within_the_budget():
  result = jaxcomm.plan(_grads(), hosts=4, local=2, slow_link="1gbe", max_error=0.5)
  big = next(leaf for leaf in result.leaves if leaf.path == "big/kernel")
  assert big.compressor is not None and big.relative_error <= 0.5
  assert all(leaf.relative_error <= 0.5 for leaf in result.leaves)
  assert result.seconds < 0.8 * result.dense_seconds
  assert "big/kernel" in result.describe()
  loose = jaxcomm.plan(_grads(), hosts=4, local=2, slow_link="1gbe", max_error=1.0)
  assert loose.seconds <= result.seconds  # a larger budget never costs time


@pytest.mark.parametrize("hosts, local", [(2, 4), (4, 2)])
def test_compressed_allreduce_runs_the_plan_and_sends_the_planned_bytes(hosts, local):
  grads = _grads()
  result = jaxcomm.plan(grads, hosts=hosts, local=local, slow_link="10gbe", max_error=0.9)
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  # The plan models the gradient exchange; leave out the non-finite agreement's 4-byte pmax.
  tx = jaxcomm.compressed_allreduce(result.policy, nonfinite="propagate")
  state, step = update_fn(tx, grads, mesh)
  stacked = jax.tree.map(lambda g: jnp.stack([g] * 8), grads)
  report = jaxcomm.accounting.measure(step, stacked, state, mesh=mesh)
  assert report.link_bytes()["host"] == pytest.approx(sum(l.slow_bytes for l in result.leaves))


@pytest.mark.parametrize("kwargs, match", [
    ({"hosts": 0}, "hosts"), ({"local": 1.5}, "local"), ({"max_error": 1.5}, "max_error"),
    ({"max_error": -0.1}, "max_error"), ({"slow_link": "carrier pigeon"}, "carrier"),
    ({"candidates": ["topk"]}, "candidates"),
])
def test_bad_arguments(kwargs, match):
  arguments = {"hosts": 2, "local": 4, "slow_link": "1gbe", **kwargs}
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomm.plan(_grads(), **arguments)


def test_planning_again_reuses_the_compiled_error_measurement():
  from jaxcomm._src import planner
  jaxcomm.plan(_grads(), hosts=4, local=2, slow_link="1gbe")
  compiled = planner._round_trip_errors._cache_size()
  jaxcomm.plan(_grads(), hosts=2, local=4, slow_link="10gbe", max_error=0.3, seed=1)
  assert planner._round_trip_errors._cache_size() == compiled
