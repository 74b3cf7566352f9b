"""A strategy that cannot carry the compressor asked for is an error at construction."""

import chex
import jax
import pytest

import jaxcomm
from jaxcomm._src.collectives import strategies
from jaxcomm.collectives import Dense, Gather, Linear, TwoPhase, TwoPhaseState, level


@pytest.mark.parametrize("build", [
    lambda c: jaxcomm.compressed_allreduce(c, strategy="dense"),
    lambda c: level("host", c, strategy="dense"),
])
@pytest.mark.parametrize("compressor", [jaxcomm.topk(0.01), jaxcomm.quantize(8),
                                        jaxcomm.identity()])
def test_dense_with_a_compressor_raises_instead_of_running_gather(build, compressor):
  with pytest.raises(ValueError, match=r"strategy='dense' sends full precision and takes no "
                     r"compressor; got " + compressor.name.replace("(", r"\(").replace(")", r"\)")):
    build(compressor)


@pytest.mark.parametrize("name, value", [("dense", Dense()), ("gather", Gather()),
                                         ("two_phase", TwoPhase()), ("linear", Linear())])
def test_a_strategy_name_resolves_to_its_value(name, value):
  compressor = None if name == "dense" else jaxcomm.identity()
  assert level("host", compressor, strategy=name).strategy == value


def test_a_dense_implementation_out_of_range_raises_at_construction():
  with pytest.raises(ValueError, match=r"Dense\(implementation=...\) must be one of "
                     r"reduce_scatter, psum or None; got 'ring'"):
    level("local", strategy=Dense(implementation="ring"))


def test_a_dense_level_reduce_scatters_in_one_process():
  """The psum-built way in is the preference only for CPU jobs of several processes."""
  assert strategies.scatter_implementation(None) == "reduce_scatter"
  assert strategies.scatter_implementation("psum") == "psum"


def test_an_unknown_strategy_names_the_allowed_ones():
  with pytest.raises(ValueError, match=r"strategy must be one of dense, linear, gather, "
                     r"two_phase, a strategy value .* got 'ring'"):
    level("host", jaxcomm.identity(), strategy="ring")


@pytest.mark.parametrize("build", [
    lambda c: level("host", c),
    lambda c: jaxcomm.compressed_allreduce(levels=[level("local"), level("host", c)]),
    lambda c: jaxcomm.compressed_allreduce(jaxcomm.policy(jaxcomm.topk(0.1), rules=[("w", c)])),
])
def test_a_matrix_compressor_on_a_flattened_level_raises(build):
  with pytest.raises(ValueError, match=r"powersgd\(2\) factorizes each gradient matrix"):
    build(jaxcomm.powersgd(2))


def test_compressed_allreduce_takes_a_strategy_value_as_its_name():
  by_value = jaxcomm.compressed_allreduce(jaxcomm.sign(), strategy=TwoPhase())
  by_name = jaxcomm.compressed_allreduce(jaxcomm.sign(), strategy="two_phase")
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  params = {"w": jax.numpy.zeros((8, 5))}
  states = [jaxcomm.optim.sharded_init(tx, params, mesh)[0] for tx in (by_value, by_name)]
  chex.assert_trees_all_equal_structs(*states)
  assert isinstance(states[0].level_states[0][1], TwoPhaseState)
