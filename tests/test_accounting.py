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
  where = sorted((op.axes, tuple(index for _, index in op.branch)) for op in report.collectives)
  # lax.cond's false branch is index 0, its true branch index 1
  assert where == [(("host",), (0,)), (("host",), (2,)), (("host", "local"), ()),
                   (("local",), (2, 0)), (("local",), (2, 1))]
  assert report.link_bytes() == {"host": 64 + 64 + 112, "local": 96 + 96}
  # branch 0 on 1/4 of the calls, branch 2 on 1/2, branch 1 (no collectives) on the rest
  weighted = report.link_bytes(branch_weights={switch: [0.25, 0.25, 0.5]})
  assert weighted == {"host": 0.25 * 64 + 0.5 * 64 + 112, "local": 0.5 * (96 + 96)}
  # the cost model weighs each collective's time the same way
  links = {"host": "100gbe", "local": "nvlink4"}
  times = jaxcomm.costmodel.predict(report, links).per_collective
  weighted_times = jaxcomm.costmodel.predict(report, links, {switch: [0.25, 0.25, 0.5]})
  expected = [t * (0.25 if op.branch[:1] and op.branch[0][1] == 0 else
                   0.5 if op.branch else 1.0) for t, op in zip(times, report.collectives)]
  np.testing.assert_allclose(weighted_times.per_collective, expected, rtol=1e-12)
  with pytest.raises(ValueError, match="one weight for each of the 3 branches"):
    report.link_bytes(branch_weights={switch: [1.0, 0.0]})
  with pytest.raises(ValueError, match="branch_weights\\['nope'\\]"):
    report.link_bytes(branch_weights={"nope": [1.0]})
