"""Several arrays reduced in one engine call: the gather levels share one all-gather, the
two-phase levels one all-to-all and one all-gather, and every array's mean and state equal
what the engine returns for it alone, bit for bit."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting
from jaxcomm._src.collectives.hierarchical import hierarchical_allreduce_many
from jaxcomm._src.collectives.strategies import Gather, TwoPhase
from jaxcomm.collectives import hierarchical_allreduce, hierarchical_cost, init_states, level

AXES = ("host", "local")
SIZES = (1001, 37, 256, 64)  # uneven shards and payloads of several leaves and dtypes


def _topologies(implementation):
  gather = Gather(implementation)
  return [(level("local"), level("host", jaxcomm.sign(), strategy=gather)),
          (level("local"), level("host", jaxcomm.topk(0.1), strategy=gather)),
          (level("local"), level("host", jaxcomm.quantize(8), strategy=gather, feedback=False)),
          (level("local"), level("host", jaxcomm.identity(), strategy="linear"))]


def _run(mesh, topologies, together):
  """Jitted ``run(*xs_per_device) -> (means, states)``: one engine call, or one per array."""
  keys = [jax.random.fold_in(jax.random.PRNGKey(3), i) for i in range(len(SIZES))]

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=(P(), P(AXES)))
  def run(*xs):
    xs = [x[0] for x in xs]
    states = [init_states(levels, x.size, x.dtype) for x, levels in zip(xs, topologies)]
    # A first call fills the error-feedback residuals; the second starts from them.
    for _ in range(2):
      if together:
        means, states = hierarchical_allreduce_many(xs, topologies, states, keys)
      else:
        means, states = zip(*(hierarchical_allreduce(x, levels, state, key) for x, levels,
                              state, key in zip(xs, topologies, states, keys)))
      xs = [x + mean for x, mean in zip(xs, means)]
    return list(means), jax.tree.map(lambda leaf: leaf[None], list(states))

  return run


def _inputs():
  return [jax.random.normal(jax.random.PRNGKey(i), (8, size)) for i, size in enumerate(SIZES)]


def _two_phase_topologies(implementation):
  two_phase = TwoPhase(implementation)
  return [(level("local"), level("host", jaxcomm.topk(0.1), strategy=two_phase)),
          (level("local"), level("host", jaxcomm.quantize(8), strategy=two_phase,
                                 feedback=False)),
          (level("local"), level("host", jaxcomm.topk(0.2), strategy=two_phase)),
          (level("local"), level("host", jaxcomm.identity(), strategy="linear"))]


@pytest.mark.parametrize("implementation", ["all_gather", "psum"])
@pytest.mark.parametrize("topologies_of", [_topologies, _two_phase_topologies],
                         ids=["gather", "two_phase"])
def test_one_call_equals_one_call_per_array_exactly(topologies_of, implementation):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  topologies = topologies_of(implementation)
  together = _run(mesh, topologies, True)(*_inputs())
  alone = _run(mesh, topologies, False)(*_inputs())
  chex.assert_trees_all_equal(together, alone)


def test_gather_levels_send_one_collective_of_every_payload():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  topologies = _topologies("all_gather")
  shapes = [jax.ShapeDtypeStruct((8, size), jnp.float32) for size in SIZES]
  report = accounting.measure(_run(mesh, topologies, True), *shapes, mesh=mesh)
  gathers = [op for op in report.collectives if op.kind == "all-gather" and op.axes == ("host",)]
  assert len(gathers) == 2 and all(op.dtypes == ("u8",) for op in gathers)  # one per call
  payloads = sum(levels[1].compressor.wire_bytes((-(-size // 4),), jnp.float32)
                 for levels, size in zip(topologies[:3], SIZES))
  assert [op.bytes_per_device for op in gathers] == [(2 - 1) * payloads] * 2
  # Every byte is what the arrays reduced one by one send (the per-array cost formulas).
  alone = [hierarchical_cost(levels, size, dict(mesh.shape))
           for levels, size in zip(topologies, SIZES)]
  assert report.link_bytes() == pytest.approx(
      {axis: 2 * sum(cost[axis].nbytes for cost in alone) for axis in AXES}, rel=1e-12)


def test_two_phase_levels_send_one_all_to_all_and_one_all_gather_of_every_payload():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  topologies = _two_phase_topologies("all_gather")
  shapes = [jax.ShapeDtypeStruct((8, size), jnp.float32) for size in SIZES]
  report = accounting.measure(_run(mesh, topologies, True), *shapes, mesh=mesh)
  on_host = [op.kind for op in report.collectives if op.axes == ("host",)]
  # Per call: one all-to-all and one all-gather of the two-phase payloads, one all-reduce of
  # the linear level's.
  assert sorted(on_host) == sorted(["all-to-all", "all-gather", "all-reduce"] * 2)
  alone = [hierarchical_cost(levels, size, dict(mesh.shape))
           for levels, size in zip(topologies, SIZES)]
  assert report.link_bytes() == pytest.approx(
      {axis: 2 * sum(cost[axis].nbytes for cost in alone) for axis in AXES}, rel=1e-12)
