"""Deep Gradient Compression: degenerate case, masking, warm-up, training, resume, bytes,
errors; flat over every device and across hosts after a dense mean over the fast axis."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm.collectives import Dense, Gather, TwoPhase
from jaxcomm._src.compress.topk import topk_count
from jaxcomm._src.optim.dgc import dgc
from lowcomm_helpers import (DEVICES, batch, eval_loss, numpy_roundtrip, problem, sync_sgd,
                             train)
from update_helpers import measure_update

LR = 0.1


# Strategies as values, as names (the aliases compressed_allreduce accepts) and None
# (resolved for top-k: gather).
TOPOLOGIES = [(None, None), (TwoPhase(), None), (Gather(), "local"), ("two_phase", "local")]


@functools.cache
def _momentum_sgd():
  """Parameters after 3 steps of dense momentum SGD: run once for every topology below."""
  return train(optax.chain(jaxcomm.compressed_allreduce(), optax.sgd(LR, momentum=0.9)), 3)[0]


@pytest.mark.parametrize("strategy, fast_axis", TOPOLOGIES)
def test_density_one_without_masking_is_momentum_sgd(strategy, fast_axis):
  expected = _momentum_sgd()
  tx = optax.chain(dgc(1.0, momentum_masking=False, strategy=strategy, fast_axis=fast_axis),
                   optax.sgd(LR))
  chex.assert_trees_all_close(train(tx, 3)[0], expected, atol=1e-6)


def _zero_fraction(tree):
  """Per leaf, the fraction of zeros in each device's slice (devices stacked first)."""
  return [np.mean(np.asarray(x).reshape(DEVICES, -1) == 0, axis=1)
          for x in jax.tree.leaves(tree)]


def test_warmup_density_then_final_density_and_momentum_masking():
  _, params, _, _ = problem()
  sizes = [x.size for x in jax.tree.leaves(params)]
  state = train(dgc(0.1, warmup_densities=(0.5,), warmup_stage_steps=1), 1)[1]
  for fraction, size in zip(_zero_fraction(state.velocity), sizes):
    np.testing.assert_allclose(fraction, (size // 2) / size)  # sent half: zeroed in v
  for u, v in zip(jax.tree.leaves(state.momentum), jax.tree.leaves(state.velocity)):
    np.testing.assert_array_equal(np.asarray(u) == 0, np.asarray(v) == 0)  # masked where sent
  state = train(dgc(0.1), 1)[1]
  for fraction, size in zip(_zero_fraction(state.velocity), sizes):
    np.testing.assert_allclose(fraction, max(1, int(0.1 * size)) / size)


# Both strategies and both axis layouts (the exactness test above covers every pair).
@pytest.mark.parametrize("strategy, fast_axis", [("gather", None), ("two_phase", "local")])
def test_trains_the_mlp_close_to_dense_and_resumes_from_numpy(strategy, fast_axis):
  tx = optax.chain(dgc(0.05, warmup_stage_steps=4, clip_norm=10.0, strategy=strategy,
                       fast_axis=fast_axis), optax.sgd(LR))
  params, state, losses, step, specs = train(tx, 60)
  assert eval_loss(params) < eval_loss(sync_sgd(LR, 60)[0]) + 0.1, losses
  data, mesh = problem()[2:]
  two = lambda p, s: step(*step(p, s, batch(data, 60))[:2], batch(data, 61))[:2]
  chex.assert_trees_all_equal(two(params, state), two(params, numpy_roundtrip(state, specs, mesh)))


@pytest.mark.parametrize("hosts, local", [(2, 4), (4, 2)])
def test_across_hosts_only_the_top_k_of_each_shard_crosses_hosts(hosts, local):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  params = {"w": jnp.zeros((300, 40)), "b": jnp.zeros(42)}
  density = 0.01
  hier = measure_update(dgc(density, fast_axis="local"), params, mesh)
  flat = measure_update(dgc(density), params, mesh)
  shards = [-(-p.size // local) for p in jax.tree.leaves(params)]
  k_shards = sum(topk_count((size,), density, None) for size in shards)
  assert hier.link_bytes()["host"] == hier.bytes_per_axes()[("host",)] \
      == (hosts - 1) * 8 * k_shards
  # Dense reduce-scatter and all-gather of the zero-padded leaves inside the host.
  assert hier.link_bytes()["local"] == pytest.approx(2 * (local - 1) / local * 4 * local
                                                     * sum(shards))
  k_leaves = sum(topk_count(p.shape, density, None) for p in jax.tree.leaves(params))
  assert flat.link_bytes()["host"] == (hosts * local - 1) * 8 * k_leaves
  assert hier.link_bytes()["host"] < flat.link_bytes()["host"]


@pytest.mark.parametrize("fast_axis, error, match", [
    ("", TypeError, "fast_axis must be a non-empty mesh axis name or None, got ''"),
    (("local",), TypeError, "fast_axis must be a non-empty mesh axis name or None"),
])
def test_bad_fast_axis_raises_at_construction(fast_axis, error, match):
  with pytest.raises(error, match=match):
    dgc(fast_axis=fast_axis)


def test_fast_axis_missing_from_the_mesh_or_alone_in_it_raises():
  params = problem()[1]
  with pytest.raises(ValueError, match="dgc.init: mesh axis 'gpu' is not available"):
    jaxcomm.optim.sharded_init(dgc(fast_axis="gpu"), params, problem()[3])
  one_axis = jax.make_mesh((DEVICES,), ("local",), axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(ValueError, match="fast_axis='local' is the only mesh axis"):
    jaxcomm.optim.sharded_init(dgc(fast_axis="local"), params, one_axis)


@pytest.mark.parametrize("kwargs, match", [
    ({"density": 0.0}, r"density must be in \(0, 1\], got 0.0"),
    ({"density": 1.5}, r"density must be in \(0, 1\], got 1.5"),
    ({"warmup_densities": (0.25, 2.0)}, r"warmup_densities must be in \(0, 1\], got 2.0"),
    ({"warmup_stage_steps": -1}, "warmup_stage_steps must be >= 0, got -1"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
    ({"strategy": "linear"}, "strategy='linear' needs a linear compressor"),
    ({"strategy": Dense()}, "strategy='dense' sends full precision and takes no compressor"),
    ({"strategy": "ring"}, "strategy must be one of dense, linear, gather, two_phase"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    dgc(**kwargs)
