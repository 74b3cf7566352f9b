"""Bytes on the wire from compiled HLO, against the closed-form formulas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting
from update_helpers import measure_update

AXES = ("host", "local")


def _step(mesh, compressor, params, **kwargs):
  # Payload formulas only: nonfinite='skip' adds a 4-byte agreement (tests/reliability).
  tx = jaxcomm.compressed_allreduce(compressor, nonfinite="propagate", **kwargs)
  return measure_update(tx, params, mesh)


@pytest.mark.parametrize("hosts, local", [(2, 4), (4, 2)])
def test_topk_inter_host_bytes_equal_the_payload_formula(hosts, local):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  params = {"w": jnp.zeros((300, 40)), "b": jnp.zeros(40)}
  report = _step(mesh, jaxcomm.topk(0.01), params, strategy="gather")
  k_w = int(0.01 * (12000 // local))
  k_b = max(1, int(0.01 * (40 // local)))
  assert report.link_bytes()["host"] == (hosts - 1) * 8 * (k_w + k_b)
  assert report.bytes_per_axes()[("host",)] == (hosts - 1) * 8 * (k_w + k_b)


def test_dense_intra_host_bytes_follow_the_ring_formula():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.zeros((256, 64))}
  report = _step(mesh, jaxcomm.sign(), params)
  data_bytes = 256 * 64 * 4
  # reduce-scatter + all-gather over the fast axis = ring all-reduce.
  assert report.link_bytes()["local"] == pytest.approx(2 * 3 / 4 * data_bytes)
  assert report.count("reduce-scatter") == 1
  sign_payload = -(-(256 * 64 // 4) // 8) + 4
  assert report.link_bytes()["host"] == pytest.approx((2 - 1) * sign_payload)


def test_every_collective_kind_and_group_format():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES),
                     check_vma=False)
  def program(x):
    total = jax.lax.psum(x, AXES)
    swapped = jax.lax.all_to_all(x.reshape(4, -1), "local", 0, 0, tiled=True).reshape(-1)
    shifted = jax.lax.ppermute(x, "host", [(0, 1), (1, 0)])
    gathered = jax.lax.all_gather(x.astype(jnp.uint8), "local", tiled=True)
    return total + swapped + shifted + gathered[:16]

  report = accounting.measure(program, jnp.ones(8 * 16), mesh=mesh)
  by_kind = {op.kind: op for op in report.collectives}
  assert by_kind["all-reduce"].axes == AXES
  assert by_kind["all-reduce"].bytes_per_device == pytest.approx(2 * 7 / 8 * 64)
  assert by_kind["all-to-all"].axes == ("local",)
  assert by_kind["all-to-all"].bytes_per_device == pytest.approx(3 / 4 * 64)
  assert by_kind["collective-permute"].axes == ("host",)
  assert by_kind["collective-permute"].bytes_per_device == 64
  assert by_kind["all-gather"].dtypes == ("u8",)
  assert by_kind["all-gather"].bytes_per_device == pytest.approx(3 / 4 * 64)
  assert report.link_bytes() == pytest.approx({"host": 2 * 7 / 8 * 64 + 64, "local": 96})


def test_iota_replica_groups_map_to_axes():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  line = ("%ar = f32[16]{0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), "
          "use_global_device_ids=true, to_apply=%add")
  (op,) = accounting.report_from_hlo(line, mesh).collectives
  assert op.axes == ("host",)
  assert op.group_size == 2
  line = line.replace("[4,2]<=[2,4]T(1,0)", "[2,4]<=[8]")
  (op,) = accounting.report_from_hlo(line, mesh).collectives
  assert op.axes == ("local",)


def test_groups_that_match_no_axes_are_an_error():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  line = ("%ar = f32[4]{0} all-reduce(%p), replica_groups={{0,5},{1,4},{2,7},{3,6}}, "
          "to_apply=%add")
  with pytest.raises(ValueError, match="do not match"):
    accounting.report_from_hlo(line, mesh)


def test_collectives_know_their_branch_and_branches_can_be_weighted():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(),
                     check_vma=False)  # branches psum over different axes
  def step(x, index):
    host = lambda y: jax.lax.psum(y, "host")  # 2 (2-1)/2 * 64 = 64 bytes
    local = lambda y: jax.lax.psum(y, "local")  # 2 (4-1)/4 * 64 = 96 bytes
    nested = lambda y: jax.lax.cond(jnp.sum(y) > 0, local, lambda z: 3 * local(z), host(y))
    y = jax.lax.switch(index, [host, lambda y: 2 * y, nested], x)
    return jax.lax.psum(y, AXES)  # unconditional: 2 (8-1)/8 * 64 = 112 bytes

  report = accounting.measure(step, jnp.ones((8, 16)), 0, mesh=mesh)
  (switch, branches), = report.conditionals().items()
  assert branches == 3
  (inner, inner_branches), = [(n, b) for n, b in report.branch_counts if n != switch]
  assert inner_branches == 2
  where = sorted((op.axes, tuple(index for _, index in op.branch)) for op in report.collectives)
  # lax.cond's false branch is index 0, its true branch index 1
  assert where == [(("host",), (0,)), (("host",), (2,)), (("host", "local"), ()),
                   (("local",), (2, 0)), (("local",), (2, 1))]
  # Mutually exclusive branches are never added: unmarked ones need weights.
  with pytest.raises(ValueError, match=f"conditional '{switch}' has collectives in branches "
                     r"\[0, 2\]"):
    report.link_bytes()
  # branch 0 on 1/4 of the calls, branch 2 on 1/2, branch 1 (no collectives) on the rest
  weights = {switch: [0.25, 0.25, 0.5], inner: [0.5, 0.5]}
  weighted = report.link_bytes(branch_weights=weights)
  assert weighted == {"host": 0.25 * 64 + 0.5 * 64 + 112, "local": 0.5 * (0.5 * 96 + 0.5 * 96)}
  assert report.branch_bytes(branch_weights=weights) == {
      (switch, 0, "branch"): {"host": 64, "local": 0},
      (switch, 2, "branch"): {"host": 64, "local": 0.5 * 96 + 0.5 * 96},
      (inner, 0, "branch"): {"host": 0, "local": 96},
      (inner, 1, "branch"): {"host": 0, "local": 96}}
  # the cost model weighs each collective's time the same way
  links = {"host": "100gbe", "local": "nvlink4"}
  times = jaxcomm.costmodel.predict(report, links, {switch: [1, 1, 1], inner: [1, 1]})
  weighted_times = jaxcomm.costmodel.predict(report, links, weights)
  # a nested collective runs when both its branches are taken: 0.5 * 0.5
  expected = [t * {(): 1.0, (0,): 0.25, (2,): 0.5, (2, 0): 0.25, (2, 1): 0.25}[
      tuple(index for _, index in op.branch)]
              for t, op in zip(times.per_collective, report.collectives)]
  np.testing.assert_allclose(weighted_times.per_collective, expected, rtol=1e-12)
  with pytest.raises(ValueError, match="one weight for each of the 3 branches"):
    report.link_bytes(branch_weights={switch: [1.0, 0.0]})
  with pytest.raises(ValueError, match="branch_weights\\['nope'\\]"):
    report.link_bytes(branch_weights={"nope": [1.0]})


def test_a_warmup_branch_is_left_out_of_the_steady_state():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), P()), out_specs=P(AXES),
                     check_vma=False)
  def step(x, count):
    dense = lambda y: jax.lax.psum(y, "host")  # 2 (2-1)/2 * 64 = 64 bytes
    small = lambda y: jax.lax.psum(y[:4], "host").sum() + y  # 16 bytes
    return jax.lax.cond(count < 10, accounting.warmup(dense), small, x)

  report = accounting.measure(step, jnp.ones(8 * 16), 0, mesh=mesh)
  (cond, _), = report.conditionals().items()
  assert report.link_bytes() == {"host": 16, "local": 0}
  assert report.branch_bytes() == {(cond, 0, "branch"): {"host": 16, "local": 0},
                                   (cond, 1, "warmup"): {"host": 64, "local": 0}}
  assert report.link_bytes(branch_weights={cond: [0.9, 0.1]}) == {"host": 0.9 * 16 + 0.1 * 64,
                                                                  "local": 0}


def _steady_and_warmup(tx, params, mesh):
  """Inter-host bytes of the steady state and of the one warm-up branch."""
  report = measure_update(tx, params, mesh)
  (warmup,) = [value["host"] for (_, _, label), value in report.branch_bytes().items()
               if label == "warmup"]
  return report.link_bytes()["host"], warmup


def test_powersgd_warmup_reports_its_steady_state():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  m, n, bias, rank = 48, 32, 32, 2
  params = {"w": jnp.zeros((m, n)), "b": jnp.zeros(bias)}
  steady, warmup = _steady_and_warmup(jaxcomm.powersgd_allreduce(rank, warmup_steps=10), params,
                                      mesh)
  ring = 2 * (2 - 1) / 2
  # The (out, rest) = (n, m) matrix: P (n x r), this device's m / 4 rows of Q, the dense bias
  assert steady == pytest.approx(ring * 4 * (rank * (n + m // 4) + bias))
  assert warmup == pytest.approx(ring * 4 * (m // 4 * n + bias))  # its rows dense
  no_warmup = measure_update(jaxcomm.powersgd_allreduce(rank), params, mesh)
  assert no_warmup.conditionals() == {} and no_warmup.link_bytes()["host"] == steady


def test_dgc_warmup_reports_its_steady_state():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.zeros((64, 32))}
  tx = jaxcomm.dgc(0.01, warmup_stage_steps=5, fast_axis="local")
  report = measure_update(tx, params, mesh)
  (switch, branches), = report.conditionals().items()
  rows = {(index, label): value["host"] for (name, index, label), value
          in report.branch_bytes().items() if name == switch}
  last = branches - 1  # the final density's stage; the others are warm-up densities
  assert sorted(rows) == [(index, "warmup") for index in range(last)] + [(last, "branch")]
  assert report.link_bytes()["host"] == rows[last, "branch"] < sum(rows.values())
  no_warmup = measure_update(jaxcomm.dgc(0.01, fast_axis="local"), params, mesh)
  assert report.link_bytes() == no_warmup.link_bytes()


def test_onebit_adam_reports_its_compressed_steady_state():
  from jaxcomm._src.optim.onebit_adam import adam_setup
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
  steady, warmup = _steady_and_warmup(jaxcomm.onebit_adam(1e-3, warmup_steps=10), params, mesh)
  *_, compressed_levels, dense_levels = adam_setup(0.9, 0.999, 1e-8, "local", "host",
                                                  jaxcomm.collectives.TwoPhase())
  for levels, expected in ((compressed_levels, steady), (dense_levels, warmup)):
    reference = measure_update(jaxcomm.compressed_allreduce(levels=levels, nonfinite="propagate"),
                               params, mesh)
    assert reference.link_bytes()["host"] == pytest.approx(expected)
  assert steady < warmup / 10
