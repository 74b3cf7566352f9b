"""Strategies (dense, linear, gather, two-phase), N-level topologies and bucketing.

The invariants every strategy shares are in test_engine_spec.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting
from jaxcomm.collectives import init_states, level, pack, plan_buckets, unpack
from update_helpers import update_fn
import fast_random

AXES = ("host", "local")


def _run_levels(mesh, levels, shape, steps=1):
  """Jitted: apply hierarchical_allreduce ``steps`` times to the same per-device input.

  The steps are a ``lax.scan``, so the program holds one copy of the collective whatever
  ``steps`` is (an unrolled loop of 40 took about a minute to compile).
  """
  axes = tuple(mesh.axis_names)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axes),), out_specs=P())
  def run(x):
    def one_step(states, step):
      mean, states = jaxcomm.collectives.hierarchical_allreduce(x[0], levels, states,
                                                                jax.random.PRNGKey(step))
      return states, mean

    states = init_states(levels, int(np.prod(shape)), x.dtype)
    return jax.lax.scan(one_step, states, jnp.arange(steps))[1]

  return run


def test_dense_level_in_bfloat16():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  levels = (level("local", dtype=jnp.bfloat16), level("host"))
  x = fast_random.normal(jax.random.PRNGKey(1), (8, 64))
  (mean,) = _run_levels(mesh, levels, (64,))(x)
  chex.assert_trees_all_close(mean, jnp.mean(x, 0), atol=2e-2)
  assert float(jnp.max(jnp.abs(mean - jnp.mean(x, 0)))) > 0  # really rounded to bf16


def test_linear_shared_randomk_sums_payloads_exactly():
  """psum of shared-index payloads == random-k of the sum: exact mean at the kept indices."""
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  compressor = jaxcomm.compress.randomk(0.25, shared=True, scale=False)
  levels = (level("local"), level("host", compressor, strategy="linear", feedback=False))
  x = fast_random.normal(jax.random.PRNGKey(2), (8, 64))
  (mean,) = _run_levels(mesh, levels, (64,))(x)
  kept = np.asarray(mean) != 0
  assert kept.sum() == 2 * 8  # k = 8 of each device's 32-element shard, 2 shards
  np.testing.assert_allclose(np.asarray(mean)[kept], np.asarray(jnp.mean(x, 0))[kept],
                             rtol=1e-5, atol=1e-6)
  report = accounting.measure(_run_levels(mesh, levels, (64,)), x, mesh=mesh)
  (host_op,) = [op for op in report.collectives if op.axes == ("host",)]
  assert host_op.kind == "all-reduce" and host_op.result_bytes == 8 * 4


@pytest.mark.parametrize("compressor", [jaxcomm.topk(0.25), jaxcomm.sign()],
                         ids=["topk", "sign"])
def test_two_phase_error_feedback_converges_to_the_mean(compressor):
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  levels = (level("local"), level("host", compressor, strategy="two_phase"))
  x = fast_random.normal(jax.random.PRNGKey(3), (8, 96))
  outputs = _run_levels(mesh, levels, (96,), steps=40)(x)
  target = jnp.mean(x, 0)
  one_step = float(jnp.linalg.norm(outputs[0] - target))
  averaged = float(jnp.linalg.norm(jnp.mean(outputs, 0) - target))
  assert averaged < 0.15 * one_step, (averaged, one_step)


def test_two_phase_bytes_stay_near_twice_the_payload_while_gather_grows():
  x = fast_random.normal(jax.random.PRNGKey(4), (8, 4096))
  host_bytes = {}
  for hosts, local in [(2, 4), (4, 2), (8, 1)]:
    mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
    for strategy in ("gather", "two_phase"):
      levels = (level("local"), level("host", jaxcomm.sign(), strategy=strategy))
      report = accounting.measure(_run_levels(mesh, levels, (4096,)), x, mesh=mesh)
      host_bytes[hosts, strategy] = report.link_bytes()["host"]
  for hosts, local in [(2, 4), (4, 2), (8, 1)]:
    shard = 4096 // local
    payload = shard // 8 + 4
    assert host_bytes[hosts, "gather"] == (hosts - 1) * payload
    chunk_payload = shard // hosts // 8 + 4
    assert host_bytes[hosts, "two_phase"] == pytest.approx(2 * (hosts - 1) * chunk_payload)
  assert host_bytes[8, "two_phase"] < 0.3 * host_bytes[8, "gather"]


def test_three_levels_nest_compressed_exchanges():
  mesh = jax.make_mesh((2, 2, 2), ("pod", "host", "local"), axis_types=(AxisType.Auto,) * 3)
  x = fast_random.normal(jax.random.PRNGKey(5), (8, 40))
  exact = (level("local"), level("host", jaxcomm.identity()), level("pod", jaxcomm.identity()))
  (mean,) = _run_levels(mesh, exact, (40,))(x)
  chex.assert_trees_all_close(mean, jnp.mean(x, 0), atol=1e-6)
  # Their bytes: test_engine_spec.py::test_three_level_cost_equals_the_compiled_bytes.


def test_buckets_pack_exactly_and_respect_the_size_limit():
  leaves = [jnp.arange(6.0).reshape(2, 3), jnp.ones(5), jnp.zeros((), jnp.float32),
            jnp.ones(3, jnp.bfloat16), jnp.full((4, 4), 2.0)]
  buckets = plan_buckets(leaves, bucket_bytes=48)
  assert sorted(i for b in buckets for i in b.leaves) == list(range(5))
  assert all(b.size * jnp.dtype(b.dtype).itemsize <= 64 for b in buckets)
  assert all(len({leaves[i].dtype for i in b.leaves}) == 1 for b in buckets)
  for bucket in buckets:
    for i, piece in zip(bucket.leaves, unpack(pack(leaves, bucket), bucket)):
      chex.assert_trees_all_equal(piece, leaves[i])
  assert [b.leaves for b in plan_buckets(leaves, None)] == [(i,) for i in range(5)]


def test_bucketing_issues_fewer_collectives_with_the_same_result():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {f"w{i}": jnp.zeros((16, 8)) for i in range(6)}
  grads = jax.tree.map(lambda p: fast_random.normal(jax.random.PRNGKey(6), (8, *p.shape)), params)
  results, counts = [], []
  for bucket_bytes in (None, 1 << 20):
    tx = jaxcomm.compressed_allreduce(jaxcomm.identity(), feedback=False,
                                      bucket_bytes=bucket_bytes)
    state, step = update_fn(tx, params, mesh)
    results.append(step(grads, state)[0])
    counts.append(accounting.measure(step, grads, state, mesh=mesh).count("reduce-scatter"))
  assert counts == [6, 1]
  chex.assert_trees_all_close(results[0], results[1], atol=1e-6)
  chex.assert_trees_all_close(results[0], jax.tree.map(lambda g: jnp.mean(g, 0), grads),
                              atol=1e-6)


@pytest.mark.parametrize("factory, match", [
    (lambda: level("host", jaxcomm.topk(0.1), strategy="allgather"), "strategy must be one of"),
    (lambda: level("host", jaxcomm.topk(0.1), strategy="linear"), "needs a linear compressor"),
    (lambda: level("host", strategy="gather"), "needs a compressor"),
    (lambda: level("host", jaxcomm.compress.randomk(0.1), strategy="two_phase"), "stateless"),
    (lambda: level("host", jaxcomm.topk(0.1), dtype=jnp.bfloat16), "dense levels only"),
    (lambda: level("host", dtype=jnp.int8), "dtype must be one of"),
    (lambda: level(""), "axis"),
    (lambda: level("host", jaxcomm.sign(), gather="ring"), "gather must be one of"),
    (lambda: jaxcomm.compressed_allreduce(jaxcomm.topk(0.1), bucket_bytes=0), "bucket_bytes"),
    (lambda: jaxcomm.compressed_allreduce(jaxcomm.topk(0.1), bucket_bytes=-5), "bucket_bytes"),
    (lambda: jaxcomm.compressed_allreduce(jaxcomm.topk(0.1), strategy="psum"), "strategy"),
    (lambda: jaxcomm.compressed_allreduce(levels=[level("a"), level("a")]), "distinct"),
    (lambda: jaxcomm.compressed_allreduce(jaxcomm.topk(0.1), levels=[level("a")]), "either"),
    (lambda: jaxcomm.compressed_allreduce(levels=["host"]), "levels must be"),
])
def test_bad_topologies_raise_at_construction(factory, match):
  with pytest.raises((ValueError, TypeError), match=match):
    factory()


def test_levels_with_an_axis_missing_from_the_mesh_raise_in_init():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(levels=[level("local"), level("pod", jaxcomm.sign())])
  with pytest.raises(ValueError, match="mesh axis 'pod' is not available"):
    jaxcomm.optim.sharded_init(tx, {"w": jnp.zeros(4)}, mesh)


def test_training_with_two_phase_and_buckets_decreases_the_loss():
  from models.data import teacher_classification
  from models.mlp import classification_loss, init_mlp
  graphdef, params = init_mlp(16, [32], 4)
  inputs, labels = teacher_classification(1, 8 * 16 * 40, 16, 4)
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.sign(), strategy="two_phase",
                                                bucket_bytes=4096), optax.adam(3e-3))
  params = jax.device_put(params, NamedSharding(mesh, P()))  # as the step returns it
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  step = jaxcomm.optim.data_parallel_step(classification_loss(graphdef), tx, mesh, specs)
  losses = []
  for i in range(40):
    params, state, loss = step(params, state, (inputs[i * 128:(i + 1) * 128],
                                               labels[i * 128:(i + 1) * 128]))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5])


def test_every_device_ends_with_the_same_mean_under_stochastic_nested_compression():
  mesh = jax.make_mesh((2, 2, 2), ("pod", "host", "local"), axis_types=(AxisType.Auto,) * 3)
  levels = (level("local"), level("host", jaxcomm.quantize(2), feedback=False),
            level("pod", jaxcomm.quantize(2)))
  axes = ("pod", "host", "local")

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                     check_vma=False)
  def per_device(x):
    states = init_states(levels, 40, x.dtype)
    return jaxcomm.collectives.hierarchical_allreduce(x[0], levels, states, jax.random.PRNGKey(0))[0][None]

  means = per_device(fast_random.normal(jax.random.PRNGKey(7), (8, 40)))
  for row in means[1:]:
    chex.assert_trees_all_equal(row, means[0])


@pytest.mark.parametrize("strategy", ["gather", "two_phase"])
def test_psum_built_gather_gives_the_same_result_and_twice_the_bytes(strategy):
  mesh = jaxcomm.make_mesh(hosts=4, local=2)
  x = fast_random.normal(jax.random.PRNGKey(8), (8, 200))
  results, host_bytes = [], []
  for gather in ("all_gather", "psum"):
    levels = (level("local"), level("host", jaxcomm.topk(0.1), strategy=strategy, gather=gather))
    run = _run_levels(mesh, levels, (200,))
    results.append(run(x))
    host_bytes.append(accounting.measure(run, x, mesh=mesh).link_bytes()["host"])
  chex.assert_trees_all_equal(results[0], results[1])
  # Only the all-gather doubles; two-phase's all-to-all half is unchanged.
  growth = 2.0 if strategy == "gather" else 1.5
  assert host_bytes[1] == pytest.approx(growth * host_bytes[0], rel=0.05)


def test_psum_gather_round_trips_every_payload_dtype():
  mesh = jaxcomm.make_mesh(hosts=8, local=1)
  from jaxcomm._src.collectives.strategies import psum_gather

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(("host", "local")), out_specs=P(),
                     check_vma=False)
  def run(x):
    payload = {"f32": x[0], "u8": (x[0] * 10).astype(jnp.uint8)[:3],
               "bf16": x[0].astype(jnp.bfloat16), "i32": jnp.arange(5) + 7}
    return psum_gather(payload, "host")

  x = fast_random.uniform(jax.random.PRNGKey(9), (8, 7)) * 20
  gathered = run(x)
  chex.assert_trees_all_equal(gathered["f32"], x)
  chex.assert_trees_all_equal(gathered["u8"], (x * 10).astype(jnp.uint8)[:, :3])
  chex.assert_trees_all_equal(gathered["bf16"], x.astype(jnp.bfloat16))
  chex.assert_trees_all_equal(gathered["i32"], jnp.tile(jnp.arange(5) + 7, (8, 1)))


@pytest.mark.parametrize("value_dtype", [jnp.float32, jnp.bfloat16])
def test_two_phase_residuals_are_the_input_less_what_was_decoded(value_dtype):
  # Bit for bit `a - decode(encode(a))` for both residuals, however they are computed (top-k
  # scatters its values into the input); bfloat16 values leave their rounding behind.
  from jaxcomm._src.collectives.strategies import TwoPhaseState, two_phase_sum
  compressor = jaxcomm.topk(0.1, value_dtype=value_dtype)
  mesh = jax.make_mesh((2,), ("host",), axis_types=(AxisType.Explicit,))
  keys = jax.random.split(jax.random.PRNGKey(9), 3)
  shards = fast_random.normal(keys[0], (2, 100))
  workers = fast_random.normal(keys[1], (2, 100))
  servers = fast_random.normal(keys[2], (2, 50))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("host"), out_specs=P("host"))
  def run(shard, worker, server):
    _, state = two_phase_sum(shard[0], compressor, TwoPhaseState(worker[0], server[0]),
                             jax.random.PRNGKey(0), "host")
    return state.worker_residual[None], state.server_residual[None]

  def unsent(x):
    payload, _ = compressor.encode(x, (), jax.random.PRNGKey(0))
    return x - compressor.decode(payload, x.shape), compressor.decode(payload, x.shape)

  corrected = (shards + workers).reshape(2, 2, 50)  # (device, chunk, element)
  expected_workers = jnp.stack([jnp.concatenate([unsent(c)[0] for c in chunks])
                                for chunks in corrected])
  # Device j owns chunk j: the two devices' decoded chunks summed (exact for two), then its
  # server residual.
  owned = [(unsent(corrected[0, j])[1] + unsent(corrected[1, j])[1]) + servers[j]
           for j in range(2)]
  expected_servers = jnp.stack([unsent(o)[0] for o in owned])
  placed = [jax.device_put(a, NamedSharding(mesh, P("host"))) for a in (shards, workers, servers)]
  new_workers, new_servers = run(*placed)
  np.testing.assert_array_equal(np.asarray(new_workers), np.asarray(expected_workers))
  np.testing.assert_array_equal(np.asarray(new_servers), np.asarray(expected_servers))
  assert np.any(np.asarray(new_servers) != 0)


@pytest.mark.parametrize("compressor, exact", [(jaxcomm.topk(0.1), True),
                                               (jaxcomm.sign(), False)], ids=["topk", "sign"])
def test_two_phase_of_several_shards_crosses_once_with_each_shards_result(compressor, exact):
  # One all-to-all and one all-gather for all shards, each shard's sum and residuals as
  # alone. Top-k's are bit for bit; sign's scales are sums whose order XLA's fusion may
  # change (a rounding difference).
  from jaxcomm._src.collectives.strategies import TwoPhase, TwoPhaseState, two_phase_init
  mesh = jax.make_mesh((2,), ("host",), axis_types=(AxisType.Explicit,))
  sizes = (100, 7, 64)
  keys = jax.random.split(jax.random.PRNGKey(3), 2 * len(sizes))
  shards = [fast_random.normal(keys[i], (2, size)) for i, size in enumerate(sizes)]
  worker_residuals = [fast_random.normal(keys[len(sizes) + i], (2, -(-size // 2) * 2))
                      for i, size in enumerate(sizes)]
  shards, worker_residuals = jax.device_put((shards, worker_residuals),
                                            NamedSharding(mesh, P("host")))

  def run(together):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("host"), out_specs=P("host"))
    def exchange(shards, worker_residuals):
      items = [(shard[0], compressor,
                TwoPhaseState(residual[0], two_phase_init(shard.shape[1], 2).server_residual),
                jax.random.PRNGKey(i), True)
               for i, (shard, residual) in enumerate(zip(shards, worker_residuals))]
      if together:
        results = TwoPhase().apply_many(items, "host")
      else:
        results = [TwoPhase().apply(*item[:4], "host", True) for item in items]
      return jax.tree.map(lambda leaf: leaf[None], results)
    return exchange, exchange(shards, worker_residuals)

  exchange, together = run(True)
  _, alone = run(False)
  if exact:
    chex.assert_trees_all_equal(together, alone)
  else:
    chex.assert_trees_all_close(together, alone, rtol=1e-6)
  hlo = exchange.lower(shards, worker_residuals).compile().as_text()
  assert hlo.count(" all-to-all(") == 1
  assert hlo.count(" all-gather(") == 1
