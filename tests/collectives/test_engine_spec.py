"""The topology engine's invariants, checked once for every strategy value.

* With the identity compressor every strategy returns the dense mean.
* Every strategy's ``cost`` (the formulas the cost model, the planner and the projections use)
  equals the bytes of the compiled HLO, per mesh axis.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting, costmodel
from jaxcomm.collectives import (Dense, Gather, Linear, TwoPhase, hierarchical_cost, init_states,
                                 level)
import fast_random

STRATEGIES = [Dense(), Dense(implementation="psum"), Linear(), Gather(), Gather("psum"),
              TwoPhase(), TwoPhase("psum")]
IDS = ["dense", "dense-psum", "linear", "gather", "gather-psum", "two_phase", "two_phase-psum"]


def _levels(strategy, compressor):
  """Dense inside hosts, ``strategy`` across them (full precision for :class:`Dense`)."""
  return (level("local"), level("host", None if isinstance(strategy, Dense) else compressor,
                                strategy=strategy))


def _allreduce(mesh, levels, size):
  axes = tuple(mesh.axis_names)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axes),), out_specs=P())
  def run(x):
    states = init_states(levels, size, x.dtype)
    return jaxcomm.collectives.hierarchical_allreduce(x[0], levels, states, jax.random.PRNGKey(0))[0]

  return run


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("hosts, local", [(4, 2), (8, 1)])
def test_every_strategy_with_the_identity_compressor_is_the_dense_mean(strategy, hosts, local):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  x = fast_random.normal(jax.random.PRNGKey(0), (8, 3, 7))
  mean = _allreduce(mesh, _levels(strategy, jaxcomm.identity()), 21)(x)
  chex.assert_trees_all_close(mean, jnp.mean(x, 0), atol=1e-6)


# Compressors covering one-leaf and several-leaf payloads, a replicated field that a psum does
# not send (shared random-k's key, shared int8's scale), integer codes (sign's packed bits,
# int8 summed without widening) and scales agreed over the axis (a pmax each; one of a vector
# for TernGrad's per-bucket scalers).
LINEAR = [jaxcomm.identity(), jaxcomm.compress.randomk(0.1, scale=False),
          jaxcomm.compress.shared_quantize()]
NONLINEAR = [jaxcomm.identity(), jaxcomm.topk(0.1), jaxcomm.sign(), jaxcomm.quantize(8),
             jaxcomm.compress.terngrad(shared_scale=True),
             jaxcomm.compress.terngrad(bucket=64, shared_scale=True)]
CASES = ([(Dense(), None), (Dense(implementation="psum"), None)]
         + [(Linear(), c) for c in LINEAR]
         + [(s, c) for s in (Gather(), TwoPhase()) for c in NONLINEAR]
         + [(Gather("psum"), jaxcomm.topk(0.1)), (TwoPhase("psum"), jaxcomm.sign())])


@pytest.mark.parametrize("strategy, compressor", CASES,
                         ids=[f"{type(s).__name__}{getattr(s, 'implementation', '') or ''}-"
                              f"{c.name if c else 'fp32'}" for s, c in CASES])
def test_cost_formula_equals_the_compiled_bytes(strategy, compressor):
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  size = 1001  # not a multiple of the devices: padding and uneven chunks count
  levels = _levels(strategy, compressor)
  x = jax.ShapeDtypeStruct((8, size), jnp.float32)
  measured = accounting.measure(_allreduce(mesh, levels, size), x, mesh=mesh).link_bytes()
  formula = hierarchical_cost(levels, size, dict(mesh.shape))
  assert {axis: c.nbytes for axis, c in formula.items()} == pytest.approx(measured, rel=1e-12)


def test_three_level_cost_equals_the_compiled_bytes():
  mesh = jax.make_mesh((2, 2, 2), ("pod", "host", "local"), axis_types=(AxisType.Auto,) * 3)
  levels = (level("local"), level("host", jaxcomm.quantize(8), feedback=False),
            level("pod", jaxcomm.topk(0.5)))
  x = jax.ShapeDtypeStruct((8, 40), jnp.float32)
  measured = accounting.measure(_allreduce(mesh, levels, 40), x, mesh=mesh).link_bytes()
  formula = hierarchical_cost(levels, 40, dict(mesh.shape))
  assert {axis: c.nbytes for axis, c in formula.items()} == pytest.approx(measured)


@pytest.mark.parametrize("compressor, strategy", [(jaxcomm.topk(0.01), "gather"),
                                                  (jaxcomm.sign(), "two_phase"),
                                                  (jaxcomm.identity(), "linear")])
def test_project_charges_the_slow_axis_what_the_strategy_costs(compressor, strategy):
  """The model-level projection is the per-level ``cost`` summed over the leaves, but for
  gather's all-gather and two-phase's all-to-all and all-gather, one each for all leaves."""
  shapes, hosts, local = [(300, 40), (41,)], 4, 8
  projected = costmodel.project(shapes, hosts, local, "nvlink4", "1gbe", compressor,
                                strategy=strategy)
  levels = (level("local"), level("host", compressor, strategy=strategy))
  sizes = {"host": hosts, "local": local}
  per_leaf = [hierarchical_cost(levels, int(np.prod(s)), sizes) for s in shapes]
  assert projected.slow_bytes == pytest.approx(sum(c["host"].nbytes for c in per_leaf))
  collectives = {"gather": 1, "two_phase": 2}.get(strategy, 0)
  shared = (len(shapes) - 1) * (hosts - 1) * collectives
  assert projected.slow_steps == sum(c["host"].steps for c in per_leaf) - shared


def test_a_multi_axis_all_to_all_is_timed_as_link_bytes_splits_it():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  axes = ("host", "local")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
  def exchange(x):
    return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)

  report = accounting.measure(exchange, jax.ShapeDtypeStruct((64, 16), jnp.float32), mesh=mesh)
  (op,) = report.collectives
  links = {"host": jaxcomm.links.link("1gbe"), "local": jaxcomm.links.link("nvlink4")}
  timed = costmodel.predict(report, links)
  split = report.link_bytes(costmodel.slowest_first(links))
  # 8 blocks of S/8 bytes: 4 peers over 'host', 3 over 'local'.
  assert split == pytest.approx({"host": 4 / 8 * op.result_bytes,
                                 "local": 3 / 8 * op.result_bytes})
  for axis in axes:
    peers = 4 if axis == "host" else 3
    assert timed.per_axis[axis] == pytest.approx(peers * links[axis].alpha
                                                 + split[axis] * links[axis].beta)
  assert timed.total == pytest.approx(sum(timed.per_axis.values()))
