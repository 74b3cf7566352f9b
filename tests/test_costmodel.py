"""Alpha-beta cost model: the formulas, a compiled program's report, bad input, monotonicity."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting, costmodel
from jaxcomm.accounting import Collective, CommReport, Cost
from jaxcomm.links import Link
from update_helpers import measure_update

AXES = ("host", "local")
# Powers of two, so every expected time below is exact in binary floating point.
SLOW = Link("slow", bandwidth_bytes_per_s=4.0, latency_s=1.0)      # beta = 1/4
FAST = Link("fast", bandwidth_bytes_per_s=64.0, latency_s=0.125)   # beta = 1/64
LINKS = {"host": SLOW, "local": FAST}


def test_formulas_on_hand_computed_cases():
  # n = 4, D = 64 bytes, alpha = 1/2, beta = 1/4.
  spec = Link("x", bandwidth_bytes_per_s=4.0, latency_s=0.5)
  assert costmodel.all_reduce_time(64, 4, spec) == 2 * 3 * 0.5 + 2 * 3 / 4 * 64 / 4 == 27.0
  assert costmodel.all_gather_time(64, 4, spec) == 3 * 0.5 + 3 / 4 * 64 / 4 == 13.5
  assert costmodel.reduce_scatter_time(64, 4, spec) == 13.5
  assert costmodel.all_to_all_time(64, 4, spec) == 13.5
  assert costmodel.ppermute_time(64, spec) == 0.5 + 64 / 4 == 16.5


def test_one_device_costs_nothing():
  for formula in (costmodel.all_reduce_time, costmodel.all_gather_time,
                  costmodel.reduce_scatter_time, costmodel.all_to_all_time):
    assert formula(1e9, 1, "1gbe") == 0.0


def test_preset_names_are_accepted():
  assert costmodel.all_reduce_time(1e6, 2, "100gbe") == costmodel.all_reduce_time(
      1e6, 2, jaxcomm.links.ETHERNET_100G)


def _program_report():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES),
                     check_vma=False)
  def program(x):  # 64 float32 per device: 256 bytes.
    summed = jax.lax.psum(x, "local")
    flat = jax.lax.psum(x * 2, AXES)
    gathered = jax.lax.all_gather(x, "host", tiled=True)
    scattered = jax.lax.psum_scatter(x * 3, "local", tiled=True)
    swapped = jax.lax.all_to_all(x * 4, "local", 0, 0, tiled=True)
    shifted = jax.lax.ppermute(x * 5, "host", [(0, 1), (1, 0)])
    return summed + flat + gathered[:64] + jnp.tile(scattered, 4) + swapped + shifted

  return accounting.measure(program, jnp.ones(8 * 64), mesh=mesh)


@pytest.fixture(scope="module")
def report():
  return _program_report()


def test_compiled_program_matches_hand_computed_times(report):
  expected = {
      # kind, axes: steps * alpha + bytes per device * beta
      ("all-reduce", ("local",)): 2 * 3 * 0.125 + 2 * 3 / 4 * 256 / 64,          # 6.75
      ("all-reduce", AXES): 2 * 7 * 1.0 + 2 * 7 / 8 * 256 / 4,                   # 126 (slow link)
      ("all-gather", ("host",)): 1 * 1.0 + 1 / 2 * 512 / 4,                      # 65
      ("reduce-scatter", ("local",)): 3 * 0.125 + 3 / 4 * (4 * 64) / 64,         # 3.375
      ("all-to-all", ("local",)): 3 * 0.125 + 3 / 4 * 256 / 64,                  # 3.375
      ("collective-permute", ("host",)): 1.0 + 256 / 4,                          # 65
  }
  times = costmodel.predict(report, LINKS)
  got = {(op.kind, op.axes): seconds
         for op, seconds in zip(report.collectives, times.per_collective)}
  assert got == expected
  assert times.per_axis == {"host": 126 + 65 + 65, "local": 6.75 + 3.375 + 3.375}
  assert times.total == 269.5


def test_bytes_term_is_the_accounting_bytes(report):
  zero_latency = Link("b", bandwidth_bytes_per_s=1.0, latency_s=0.0)
  for op in report.collectives:
    assert costmodel.collective_time(op, zero_latency) == op.bytes_per_device


def test_per_axis_charges_like_link_bytes(report):
  # With no latency, each axis's time is its link_bytes times its beta.
  links = {"host": SLOW._replace(latency_s=0.0), "local": FAST._replace(latency_s=0.0)}
  link_bytes = report.link_bytes(costmodel.slowest_first(links))
  times = costmodel.predict(report, links).per_axis
  assert times == {axis: link_bytes[axis] * links[axis].beta for axis in AXES}


def test_multi_axis_collective_goes_to_the_slowest_link(report):
  # Swap which link is slow: the flat all-reduce follows the slow link to 'local'.
  swapped = costmodel.predict(report, {"host": FAST, "local": SLOW})
  flat = 2 * 7 * 1.0 + 2 * 7 / 8 * 256 / 4
  local_only = 2 * 3 * 1.0 + 2 * 3 / 4 * 256 / 4 + 2 * (3 * 1.0 + 3 / 4 * 256 / 4)
  assert swapped.per_axis["local"] == flat + local_only


def test_step_time_overlap():
  report = CommReport((Collective("all-reduce", ("host",), 2, 8, 8.0, ("f32",)),), AXES)
  links = {"host": Link("l", 1.0, 1.0)}  # all-reduce of 8 bytes over 2: 2 + 8 = 10 s.
  assert costmodel.predict(report, links).total == 10.0
  assert costmodel.step_time(4.0, report, links) == 14.0
  assert costmodel.step_time(4.0, report, links, overlap=0.25) == 11.5
  assert costmodel.step_time(4.0, report, links, overlap=1.0) == 10.0   # max(compute, comm)
  assert costmodel.step_time(30.0, report, links, overlap=1.0) == 30.0


def test_permute_without_senders_and_without_axes_costs_nothing():
  idle = Collective("collective-permute", (), 2, 64, 0.0, ("f32",))
  assert costmodel.collective_time(idle, SLOW) == 0.0
  times = costmodel.predict(CommReport((idle,), AXES), {})
  assert times.total == 0.0 and times.per_collective == (0.0,)


def test_slowest_first_orders_by_bandwidth_then_latency():
  links = {"a": Link("a", 10.0, 1.0), "b": Link("b", 1.0, 0.0), "c": Link("c", 10.0, 2.0)}
  assert costmodel.slowest_first(links) == ("b", "c", "a")
  assert costmodel.slowest_first({"local": "nvlink4", "host": "1gbe"}) == ("host", "local")


@pytest.mark.parametrize("call, message", [
    (lambda r: costmodel.predict(r, {"host": SLOW}), "no link for mesh axis 'local'"),
    (lambda r: costmodel.predict(r, LINKS | {"hosts": SLOW}), "'hosts', which is not a mesh axis"),
    (lambda r: costmodel.predict(r, {"host": "2gbe", "local": FAST}), "unknown link '2gbe'"),
    (lambda r: costmodel.step_time(-1.0, r, LINKS), "compute_seconds must be a real number >= 0"),
    (lambda r: costmodel.step_time(1.0, r, LINKS, overlap=1.5), r"overlap must be a fraction in \[0, 1\], got 1.5"),
    (lambda r: costmodel.all_reduce_time(-8, 2, SLOW), "nbytes must be a real number >= 0, got -8"),
    (lambda r: costmodel.all_gather_time(8, 0, SLOW), "devices must be an int >= 1, got 0"),
    (lambda r: costmodel.all_to_all_time(8, 2.5, SLOW), "devices must be an int >= 1, got 2.5"),
])
def test_bad_input_errors(report, call, message):
  with pytest.raises(ValueError, match=message):
    call(report)


def test_link_of_the_wrong_type_is_a_type_error():
  with pytest.raises(TypeError, match="expected a jaxcomm.links.Link or a preset name, got 12.5"):
    costmodel.ppermute_time(8, 12.5)


KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@given(kind=st.sampled_from(KINDS), n=st.integers(2, 64), size=st.integers(0, 2**40),
       bandwidth=st.floats(1e3, 1e13), factor=st.floats(1.0, 1e3),
       latency=st.floats(0.0, 1e-2))
def test_more_bandwidth_never_increases_time(kind, n, size, bandwidth, factor, latency):
  op = Collective(kind, ("host",), n, size, float(size), ("f32",))
  slower = Link("s", bandwidth, latency)
  faster = Link("f", bandwidth * factor, latency)
  assert costmodel.collective_time(op, faster) <= costmodel.collective_time(op, slower)


_LINK = st.builds(Link, st.just("l"), st.floats(1.0, 1e12), st.floats(0.0, 1.0))


@given(links=st.fixed_dictionaries({"host": _LINK, "local": _LINK}),
       factor=st.floats(1.0, 1e6), axis=st.sampled_from(AXES))
def test_more_bandwidth_on_any_axis_never_increases_a_programs_time(report, links, factor, axis):
  # Holds even when raising one link's bandwidth makes the other one the slowest.
  faster = dict(links)
  faster[axis] = links[axis]._replace(
      bandwidth_bytes_per_s=links[axis].bandwidth_bytes_per_s * factor)
  assert costmodel.predict(report, faster).total <= costmodel.predict(report, links).total


def test_multi_axis_collective_waits_for_the_slower_step():
  # Higher bandwidth but far higher latency on 'local': the flat ring is slower there.
  op = Collective("all-reduce", AXES, 8, 256, 448.0, ("f32",))
  links = {"host": Link("h", 4.0, 0.0), "local": Link("l", 8.0, 100.0)}
  times = costmodel.predict(CommReport((op,), AXES), links)
  assert times.per_axis == {"host": 0.0, "local": 2 * 7 * 100.0 + 448 / 8}


def _two_bytes_per_element(shape, dtype):
  del dtype
  return 2 * shape[0]


@pytest.mark.parametrize("wire_bytes, strategy, slow_steps, slow_bytes, slow_seconds", [
    # Leaves of 10 and 3 elements on 2 hosts x 4 devices: shards of 3 and 1 elements.
    # Full precision: all-reduce of 12 + 4 bytes over 2 hosts: 2 + 2 steps, 12/2*2 + 4/2*2.
    (None, "gather", 4, 16.0, 4 * 1.0 + 16 / 4),
    # Gather of payloads of 6 and 2 bytes in one all-gather: 1 step, (H-1) c = 6 + 2 bytes.
    (_two_bytes_per_element, "gather", 1, 8.0, 1 * 1.0 + 8 / 4),
    # Two-phase: chunks of ceil(3/2) = 2 and 1 elements (4 and 2 bytes); one all-to-all and
    # one all-gather for both leaves: 1 + 1 steps, 2 (H-1) (4 + 2) bytes.
    (_two_bytes_per_element, "two_phase", 2, 12.0, 2 * 1.0 + 12 / 4),
])
def test_project_on_hand_computed_cases(wire_bytes, strategy, slow_steps, slow_bytes,
                                        slow_seconds):
  got = costmodel.project([(10,), (3,)], 2, 4, FAST, SLOW, wire_bytes, strategy=strategy)
  # Fast: reduce-scatter + all-gather of the padded 48- and 16-byte leaves over 4 devices.
  assert got.fast_steps == 4 * 3 and got.fast_bytes == 2 * (3 / 4 * 48 + 3 / 4 * 16) == 96.0
  assert got.fast_seconds == 12 * 0.125 + 96 / 64 == 3.0
  assert (got.slow_steps, got.slow_bytes, got.slow_seconds) == (slow_steps, slow_bytes,
                                                                slow_seconds)
  assert got.total_seconds == 3.0 + slow_seconds
  traffic = costmodel.traffic([(10,), (3,)], 2, 4, wire_bytes, strategy=strategy)
  assert traffic == (Cost(12, 96.0), Cost(slow_steps, slow_bytes))
  assert traffic.seconds(FAST, SLOW) == got.total_seconds


def test_project_one_host_sends_nothing_between_hosts():
  got = costmodel.project([(1000,)], 1, 8, "nvlink4", "1gbe", jaxcomm.sign().wire_bytes)
  assert (got.slow_bytes, got.slow_seconds) == (0.0, 0.0)


@pytest.mark.parametrize("compressor", [jaxcomm.topk(0.01), jaxcomm.sign()],
                         ids=["topk", "sign"])
def test_project_bytes_match_a_compiled_hierarchical_step(compressor):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.zeros((300, 40)), "b": jnp.zeros(41)}
  # The projection models the gradient traffic, not the 4-byte nonfinite='skip' agreement.
  tx = jaxcomm.compressed_allreduce(compressor, nonfinite="propagate")
  measured = measure_update(tx, params, mesh).link_bytes()
  projected = costmodel.project([p.shape for p in params.values()], 2, 4, FAST, SLOW,
                                compressor.wire_bytes)
  assert (projected.slow_bytes, projected.fast_bytes) == (measured["host"], measured["local"])


@pytest.mark.parametrize("name, leaves, parameters", [
    ("llama-7b", 32 * 9 + 3, 6_738_415_616),
    ("llama-13b", 40 * 9 + 3, 13_015_864_320),
    ("llama2-70b", 80 * 9 + 3, 68_976_648_192),
])
def test_transformer_shapes_give_the_published_parameter_counts(name, leaves, parameters):
  shapes = costmodel.transformer_gradient_shapes(name)
  assert len(shapes) == leaves
  assert sum(np.prod(shape, dtype=np.int64) for shape in shapes.values()) == parameters


def test_grouped_query_attention_shrinks_key_and_value():
  shapes = costmodel.transformer_gradient_shapes("llama2-70b")
  assert shapes["layers.0.attention.wk"] == (8192, 1024)
  assert shapes["layers.79.mlp.w2"] == (28672, 8192)


@pytest.mark.parametrize("call, message", [
    (lambda: costmodel.project([(8,)], 2, 4, FAST, SLOW, strategy="ring"),
     "strategy must be one of dense, linear, gather, two_phase, a strategy value"),
    (lambda: costmodel.project([(8,)], 0, 4, FAST, SLOW), "hosts must be an int >= 1, got 0"),
    (lambda: costmodel.project([(8,)], 2, 4, "nvlink5", SLOW), "unknown link 'nvlink5'"),
    (lambda: costmodel.transformer_gradient_shapes("gpt-5"),
     "unknown model 'gpt-5'; known models: llama-7b, llama-13b, llama2-70b"),
])
def test_project_bad_input_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_projection_script_prints_one_table_per_slow_link(capsys):
  from benchmarks import costmodel_projection
  assert costmodel_projection.main(["--slow", "100gbe,1gbe", "--hosts", "4"]) == 0
  out = capsys.readouterr().out
  assert out.count("llama-7b on 4 hosts x 8 devices") == 2
  shapes = costmodel.transformer_gradient_shapes("llama-7b").values()
  sign = costmodel.project(shapes, 4, 8, "nvlink4", "1gbe", jaxcomm.sign().wire_bytes,
                           strategy="two_phase")
  assert f"{sign.total_seconds:>9.3f}" in out.split("\n\n")[1].split("sign two-phase")[1]
  for label in ("fp32 flat ring", "fp32-hier", "top-1% gather", "int8 two-phase"):
    assert out.count(f"\n{label} ") == 2
