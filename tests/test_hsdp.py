"""Hybrid sharded data parallelism: ``jaxcomm.data_parallel(..., shard_over='local')`` equals
the replicated step, moves the bytes of its formulas, keeps ``1/G`` of the state per device,
runs the compressors that work on shards and refuses the rest by name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxcomm

from hsdp_helpers import SHAPES, padded, powersgd_problem, problem, train


OPTIMIZERS = {"sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
              "adamw": lambda: optax.adamw(3e-2, weight_decay=0.1)}


@pytest.mark.parametrize("hosts,local", [(2, 4), (4, 2)])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_full_precision_hsdp_equals_the_replicated_step(hosts, local, opt):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  tx = lambda: optax.chain(jaxcomm.compressed_allreduce(), OPTIMIZERS[opt]())
  replicated, rep_state, rep_losses = train(tx(), mesh, None)
  sharded, state, losses = train(tx(), mesh, "local")
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-6)
  assert losses == pytest.approx(rep_losses, rel=1e-6)
  for leaf, shape in zip(jax.tree.leaves(state.params), jax.tree.leaves(
      SHAPES, is_leaf=lambda x: isinstance(x, tuple))):
    size = shape[0] * (shape[1] if len(shape) > 1 else 1)
    assert leaf.shape == (-(-size // local) * local,) and leaf.sharding.spec == P("local")
    assert not jnp.any(leaf[size:])  # the zero padding stays exactly zero
  moments = jax.tree.leaves(state.opt_state[1])
  assert all(m.sharding.spec == P("local") for m in moments if m.ndim)


class _Linear(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(0.3 * jax.random.normal(rngs.params(), (5, 3)))
    self.b = nnx.Param(jnp.zeros(3))


def test_an_nnx_module_trains_sharded_and_model_gathers_it_back():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  _, _, batch = problem()
  loss_fn = lambda m, batch: jnp.mean((batch[0] @ m.w + m.b - batch[1]) ** 2)
  trained = []
  for shard_over in (None, "local"):
    tx = optax.chain(jaxcomm.compressed_allreduce(), optax.adamw(3e-2))
    trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over=shard_over)
    state = trainer.init(_Linear(nnx.Rngs(0)))
    for _ in range(3):
      state, _ = trainer.step(state, batch)
    trained.append(trainer.model(state))
  assert isinstance(trained[1], _Linear) and trained[1].w.shape == (5, 3)
  chex.assert_trees_all_close(nnx.state(trained[1]), nnx.state(trained[0]), atol=1e-6)


def test_a_loss_with_a_key_gets_the_same_keys_as_the_replicated_step():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, base_loss, batch = problem()
  noisy = lambda p, batch, key: base_loss(p, batch) + jnp.mean(
      p["c"] * jax.random.normal(key, p["c"].shape))
  trained = []
  for shard_over in (None, "local"):
    tx = optax.chain(jaxcomm.compressed_allreduce(), optax.sgd(0.1))
    trainer = jaxcomm.data_parallel(noisy, tx, mesh, key=7, shard_over=shard_over)
    state = trainer.init(params)
    for _ in range(2):
      state, _ = trainer.step(state, batch)
    trained.append(trainer.model(state))
  chex.assert_trees_all_close(trained[1], trained[0], atol=1e-6)



@pytest.mark.parametrize("compressor", [None, "topk"])
def test_bytes_per_axis_equal_the_formulas(compressor):
  hosts, local = 2, 4
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  params, loss_fn, batch = problem()
  chooser = None if compressor is None else jaxcomm.topk(0.5)
  tx = optax.chain(jaxcomm.compressed_allreduce(chooser, strategy=None if chooser is None
                                                else "gather"), optax.sgd(0.1))
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over="local")
  state = trainer.init(params)
  report = jaxcomm.accounting.report_from_hlo(
      trainer.step.lower(state, batch).compile().as_text(), mesh).bytes_per_axes()
  sizes = [padded(leaf.size, local) for leaf in jax.tree.leaves(params)]
  gather = sum((local - 1) / local * 4 * d for d in sizes)  # parameter all-gather
  scatter = sum((local - 1) / local * 4 * d for d in sizes)  # its transpose: reduce-scatter
  assert report[("local",)] == pytest.approx(gather + scatter)
  shards = [d // local for d in sizes]
  if compressor is None:  # dense over the slow axis: reduce-scatter + all-gather of the shard
    slow = sum(2 * (hosts - 1) / hosts * 4 * padded(n, hosts) for n in shards)
  else:  # gather strategy: (H-1) payloads of the shard
    slow = sum((hosts - 1) * chooser.wire_bytes((n,), jnp.float32) for n in shards)
  assert report[("host",)] == pytest.approx(slow)
  scalars = 2 * 2 * (8 - 1) / 8 * 4  # the loss pmean and the non-finite pmax, 4 bytes each
  assert report[("host", "local")] == pytest.approx(scalars)
  assert set(report) == {("local",), ("host",), ("host", "local")}
  replicated = jaxcomm.data_parallel(loss_fn, tx, mesh)
  rep_state = replicated.init(params)
  rep_report = jaxcomm.accounting.report_from_hlo(
      replicated.step.lower(rep_state, batch).compile().as_text(), mesh).bytes_per_axes()
  assert report[("host",)] == pytest.approx(rep_report[("host",)])


def test_staleness_on_shards_keeps_its_history_per_shard_and_equals_its_replicated_run():
  """DC-ASGD (tau 2, lambda 0.1) after the allreduce: its history buffers, shaped
  (tau, shard) and made from shapes, are marked varying by on_shards.init because
  tx.update returns them varying; 4 steps equal the replicated run."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = lambda: optax.chain(jaxcomm.compressed_allreduce(),
                           jaxcomm.optim.staleness(2, compensation=0.1), optax.sgd(0.1))
  replicated, rep_state, rep_losses = train(tx(), mesh, None)
  sharded, state, losses = train(tx(), mesh, "local")
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-6)
  assert losses == pytest.approx(rep_losses, rel=1e-6) and losses[-1] < losses[0]
  assert state.opt_state[1].gradients["w"].sharding.spec == P("local")


# The count sketch (3 buckets per shard, one row) shares one hash key per shard size on every
# device: per leaf HSDP sketches the very shards the replicated path sketches (docs/hsdp.md,
# "Count sketch and PowerSGD on shards").
COMPRESSORS = {"topk_ef": lambda: jaxcomm.topk(0.5), "sign_ef": lambda: jaxcomm.sign(),
               "int8": lambda: jaxcomm.quantize(8),
               "sketch": lambda: jaxcomm.compress.count_sketch(3, 1, seed=5)}


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compressors_under_hsdp_equal_their_replicated_run(name):
  """The replicated path reduce-scatters each padded leaf over the fast axis and compresses
  the same 1/G shard across hosts with the same keys: HSDP must reproduce it."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = lambda: optax.chain(jaxcomm.compressed_allreduce(COMPRESSORS[name]()),
                           optax.sgd(0.1, momentum=0.9))
  replicated, rep_state, rep_losses = train(tx(), mesh, None, steps=3)
  sharded, state, losses = train(tx(), mesh, "local", steps=3)
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-5)
  assert losses[-1] < losses[0]


def test_a_policy_with_buckets_runs_on_shards():
  """Leaves packed into buckets of shards, top-k on the big leaf, sign on the rest."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  chooser = jaxcomm.policy(jaxcomm.sign(), rules=[(r"w", jaxcomm.topk(0.5))], min_bytes=0)
  tx = optax.chain(jaxcomm.compressed_allreduce(chooser, bucket_bytes=64,
                                                      feedback="residual"), optax.adamw(3e-2))
  trainer, state, losses = train(tx, mesh, "local", steps=4)
  assert all(jnp.isfinite(jnp.asarray(losses))) and losses[-1] < losses[0]
  assert jax.tree.leaves(trainer.model(state))[0].shape == SHAPES["b"]


def test_onebit_adam_runs_on_shards_and_equals_its_replicated_run():
  """Leaves divisible by G: with padding, the sharded momentum keeps its padded entries,
  which the sign scale of the last shard then sees (docs/hsdp.md)."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = lambda: jaxcomm.onebit_adam(1e-2, warmup_steps=2)
  shapes = {"w": (4, 3), "b": (4,), "c": (8,)}
  replicated, rep_state, _ = train(tx(), mesh, None, shapes=shapes)
  sharded, state, losses = train(tx(), mesh, "local", shapes=shapes)
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-5)


def test_powersgd_factorizes_column_blocks_equal_to_its_replicated_run():
  """w (16 x 8, PowerSGD's (out, rest) = 8 x 16 matrix, 16 columns over G = 4): factorized by
  column blocks, equal to the replicated PowerSGD; b (too small) dense in both; v (6 x 5: 6
  columns, not a multiple of 4) factorized replicated but sent dense on shards. Bytes per axis
  from the compiled HLO equal the formulas of ``hsdp.powersgd_on_shards``."""
  hosts, local, m, columns = 2, 4, 8, 16 // 4
  params, loss_fn, batch = powersgd_problem()
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  trained = {}
  for shard_over in (None, "local"):
    tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.powersgd(1)),
                     optax.sgd(0.1, momentum=0.9))
    trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over=shard_over)
    state = trainer.init(params)
    losses = []
    for _ in range(3):
      state, loss = trainer.step(state, batch)
      losses.append(float(loss))
    assert losses[-1] < losses[0]
    trained[shard_over] = trainer.model(state)
  chex.assert_trees_all_close({k: trained["local"][k] for k in "wb"},
                              {k: trained[None][k] for k in "wb"}, atol=1e-6)
  assert [type(leaf).__name__ for leaf in state.opt_state[0].inner.leaves] == [
      "tuple", "tuple", "PowerSGDLeafState"]  # b, v dense; w factorized
  assert state.opt_state[0].inner.leaves[2].q.sharding.spec == P("local")
  report = jaxcomm.accounting.report_from_hlo(
      trainer.step.lower(state, batch).compile().as_text(), mesh).bytes_per_axes()
  fast, slow = 2 * (local - 1) / local * 4, 2 * (hosts - 1) / hosts * 4
  padded_sizes = [padded(8, local), padded(30, local), padded(128, local)]
  # all-gather + reduce-scatter of each leaf; P (m x 1) summed over the host; the column
  # norm of Q (1 float) and the finite flag (int32) agreed in the host.
  assert report[("local",)] == pytest.approx(fast * sum(padded_sizes) + fast * m + fast + fast)
  # P and this device's rows of Q across hosts; b's and v's shards dense.
  assert report[("host",)] == pytest.approx(slow * (m + columns) + slow * (8 + 32) / local)
  assert report[("host", "local")] == pytest.approx(2 * 2 * (8 - 1) / 8 * 4)


PERIODIC = {"local_sgd": lambda: jaxcomm.local_sgd(optax.sgd(0.1, momentum=0.9), 2),
            "diloco": lambda: jaxcomm.diloco(optax.adamw(1e-2), 2),
            "slowmo": lambda: jaxcomm.optim.slowmo(optax.sgd(0.1), 2, 0.1),
            # momentum=None: 1 - 1/N for the N = 2 workers (hosts), not the 8 devices
            "bmuf": lambda: jaxcomm.optim.bmuf(optax.sgd(0.1), 2),
            # one client per host: weighted by the hosts' sample counts, or one sampled a round
            "fedprox": lambda: jaxcomm.optim.fedprox(optax.sgd(0.1), 2, 0.5,
                                                     client_sizes=(1.0, 3.0)),
            "fedavg_sampled": lambda: jaxcomm.optim.fedavg(optax.sgd(0.1), 2,
                                                           clients_per_round=1)}


def test_dgc_on_shards_equals_its_replicated_run():
  """dgc(fast_axis='local') already works on the host-mean 1/G shard of each padded leaf:
  under shard_over it skips its own reduce-scatter and all-gather and equals the replicated
  run (momentum, velocity and the two-phase server residual per shard; clipping on the
  host's norm). The gather strategy differs only inside the unchanged exchange."""
  strategy = "two_phase"
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = lambda: optax.chain(jaxcomm.dgc(0.5, fast_axis="local", strategy=strategy,
                                       clip_norm=1.0), optax.sgd(0.1))
  replicated, rep_state, _ = train(tx(), mesh, None, steps=3)
  sharded, state, losses = train(tx(), mesh, "local", steps=3)
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-6)
  assert losses[-1] < losses[0]


def _device_local_mean(tx, params, loss_fn, batches, mesh):
  """The mean model of ``tx`` run with every device its own worker (the device-local path)."""
  local = jaxcomm.optim.to_device_local(jax.tree.map(lambda x: x[None], params), mesh)
  opt_state, specs = jaxcomm.optim.sharded_init(tx, local, mesh, P(("host", "local")))
  step = jaxcomm.optim.local_training_step(
      lambda p, batch: loss_fn(jax.tree.map(lambda x: x[0], p), batch), tx, mesh, specs)
  for batch in batches:
    local, opt_state, _ = step(local, opt_state, batch)
  return jax.tree.map(lambda x: np.asarray(x).mean(axis=0), local)


def _hosts_as_workers(make, params, loss_fn, batches):
  """The reference: the same algorithm on a 2 x 1 mesh of device-local models, each device
  a whole host (its batch is the host's: the batch split over 2 devices, not 8)."""
  mesh = jaxcomm.make_mesh(hosts=2, local=1, devices=jax.devices()[:2])
  return _device_local_mean(make(), params, loss_fn, batches, mesh)


@pytest.mark.parametrize("name", sorted(PERIODIC))
def test_periodic_algorithms_keep_per_host_shards_and_equal_hosts_as_workers(name):
  """Local SGD, DiLoCo, SlowMo, BMUF, FedProx, FedAvg (period 2, 4 steps: two rounds) under
  shard_over: each host keeps its own flat shards (P(('host', 'local'))), a host's G devices
  together are one worker; the mean model equals the same algorithm run with one device per
  host holding the whole model."""
  params, loss_fn, (inputs, targets) = problem()
  batches = [(inputs * (1 + 0.1 * t), targets) for t in range(4)]
  trainer = jaxcomm.data_parallel(loss_fn, PERIODIC[name](), jaxcomm.make_mesh(hosts=2, local=4),
                                  shard_over="local")
  state = trainer.init(params)
  for batch in batches:
    state, _ = trainer.step(state, batch)
  assert state.params["w"].shape == (2 * 16,)
  assert state.params["w"].sharding.spec == P(("host", "local"))
  got = jax.tree.map(np.asarray, trainer.model(state))
  chex.assert_trees_all_close(got, _hosts_as_workers(PERIODIC[name], params, loss_fn, batches),
                              atol=1e-6)


def test_sparseloco_on_per_host_shards_equals_its_device_local_run():
  """SparseLoCo's hosts already split their pseudo-gradient into 1/G shards; under
  shard_over the shards are the model's, so it skips its fast-axis mean, reduce-scatter and
  all-gather and equals its device-local run on the same 2x4 mesh (period 2, 4 steps, 2-bit
  top-k chunks of the same shards)."""
  params, loss_fn, (inputs, targets) = problem()
  batches = [(inputs * (1 + 0.1 * t), targets) for t in range(4)]
  make = lambda: jaxcomm.sparseloco(optax.adamw(1e-2), 2, density=0.5)
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  trainer = jaxcomm.data_parallel(loss_fn, make(), mesh, shard_over="local")
  state = trainer.init(params)
  for batch in batches:
    state, _ = trainer.step(state, batch)
  assert state.params["w"].sharding.spec == P(("host", "local"))
  chex.assert_trees_all_close(jax.tree.map(np.asarray, trainer.model(state)),
                              _device_local_mean(make(), params, loss_fn, batches, mesh),
                              atol=1e-6)


def test_zero_one_adam_on_per_host_shards_equals_its_device_local_run():
  """0/1 Adam's workers are the hosts under shard_over: per-host parameter, momentum and
  anchor shards, the frozen variance sharded and replicated over hosts, and its 1-bit
  exchange of each device's shard across hosts. Each host's 4 devices get the same rows, so
  the device-local run on the same 2x4 mesh (every device a worker, full precision inside
  the host, sign across hosts on the same 1/G shards) must agree, through all four kinds of
  step (variance, 1-bit, local, synchronization) and padded leaves (15, 4, 7 elements)."""
  params, loss_fn, (inputs, targets) = problem()
  make = lambda: jaxcomm.zero_one_adam(1e-2, var_freeze_step=3, var_update_scaler=1,
                                       local_step_scaler=1, local_step_clipper=4)
  # rows 0-7 on host 0's four devices, rows 8-15 on host 1's
  host_rows = lambda x: jnp.concatenate([jnp.tile(x[:8], (4, 1)), jnp.tile(x[8:16], (4, 1))])
  batches = [(host_rows(inputs) * (1 + 0.1 * t), host_rows(targets)) for t in range(8)]
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  trainer = jaxcomm.data_parallel(loss_fn, make(), mesh, shard_over="local")
  state = trainer.init(params)
  for batch in batches:
    state, _ = trainer.step(state, batch)
  chex.assert_trees_all_equal(state.opt_state.steps_per_kind, jnp.array([2, 1, 3, 2]))
  assert state.params["w"].shape == (2 * 16,)
  for leaf in (state.params["w"], state.opt_state.mu["w"], state.opt_state.anchor["w"]):
    assert leaf.sharding.spec == P(("host", "local"))  # 1/G of a host's model per device
  nu = state.opt_state.nu["w"]
  assert nu.shape == (16,) and nu.sharding.spec == P("local")
  chex.assert_trees_all_close(jax.tree.map(np.asarray, trainer.model(state)),
                              _device_local_mean(make(), params, loss_fn, batches, mesh),
                              atol=1e-6)


def test_streaming_diloco_runs_on_per_host_shards():
  """Its 4-bit quantized sync quantizes each device's shard in its own chunk, not the
  whole leaf, so it is not compared; it trains."""
  tx = jaxcomm.streaming_diloco(optax.adamw(3e-2), 4, fragments=2)
  _, state, losses = train(tx, jaxcomm.make_mesh(hosts=2, local=4), "local", steps=8)
  assert state.params["w"].sharding.spec == P(("host", "local"))
  assert losses[-1] < losses[0]


REFUSED = {
    "dgc": (lambda: jaxcomm.dgc(0.5), "dgc needs fast_axis='local'"),
    "gradzip": (lambda: optax.chain(jaxcomm.compressed_allreduce(jaxcomm.compress.gradzip(1)),
                                    optax.sgd(0.1)), "whole-leaf matrix compressor"),
    "adafactor": (lambda: optax.chain(jaxcomm.compressed_allreduce(),
                                      optax.adafactor(1e-2, min_dim_size_to_factor=2)),
                  "adafactor"),
    "no_allreduce": (lambda: optax.adamw(1e-2), "differ across mesh axes"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_transformations_that_cannot_run_on_shards_are_refused_at_init(name):
  make, message = REFUSED[name]
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, loss_fn, _ = problem()
  trainer = jaxcomm.data_parallel(loss_fn, make(), mesh, shard_over="local")
  with pytest.raises(ValueError, match=message):
    trainer.init(params)


def test_a_compressed_level_over_the_sharded_axis_is_refused():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, loss_fn, _ = problem()
  levels = (jaxcomm.level("local", jaxcomm.quantize(8)), jaxcomm.level("host", jaxcomm.sign()))
  tx = optax.chain(jaxcomm.compressed_allreduce(levels=levels), optax.sgd(0.1))
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over="local")
  with pytest.raises(ValueError, match="already reduce-scattered"):
    trainer.init(params)


@pytest.mark.parametrize("axis", ["model", 3, ("local",)])
def test_shard_over_must_name_one_mesh_axis(axis):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  _, loss_fn, _ = problem()
  with pytest.raises(ValueError, match=r"shard_over must be the name of one axis.*\('host', "
                                       r"'local'\)"):
    jaxcomm.data_parallel(loss_fn, optax.sgd(0.1), mesh, shard_over=axis)


class _Annotated(nnx.Module):
  """Kernels annotated with ``nnx.with_partitioning``: one split by rows, one by columns."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(8, 12, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("local", None)))
    self.out = nnx.Linear(12, 4, rngs=rngs,
                          kernel_init=nnx.with_partitioning(init, (None, "local")))

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def test_nnx_partitioning_annotations_and_a_spec_tree_split_those_dimensions():
  """The annotated kernels are stored split along the named dimension, moments too;
  unannotated biases stay flat shards; with AdamW at full precision the run equals the
  replicated one. A PartitionSpec tree splits a plain pytree the same way."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  batch = (jax.random.normal(jax.random.key(0), (32, 8)),
           jax.random.normal(jax.random.key(1), (32, 4)))
  with jax.set_mesh(mesh):
    module = _Annotated(nnx.Rngs(0))
  loss_fn = lambda m, batch: jnp.mean((m(batch[0]) - batch[1]) ** 2)
  tx = lambda: optax.chain(jaxcomm.compressed_allreduce(), optax.adamw(3e-2))
  trained = {}
  for shard_over in (None, "local"):
    trainer = jaxcomm.data_parallel(loss_fn, tx(), mesh, shard_over=shard_over)
    state = trainer.init(nnx.clone(module))
    for _ in range(3):
      state, _ = trainer.step(state, batch)
    trained[shard_over] = nnx.state(trainer.model(state), nnx.Param)
  chex.assert_trees_all_close(trained["local"], trained[None], atol=1e-6)
  params = state.params
  assert params["hidden"]["kernel"].sharding.shard_shape((8, 12)) == (2, 12)
  assert params["out"]["kernel"].sharding.spec == P(None, "local")
  assert params["out"]["kernel"].sharding.shard_shape((12, 4)) == (12, 1)
  assert params["hidden"]["bias"].sharding.spec == P("local")  # flat shard
  mu = state.opt_state[1][0].mu["out"]["kernel"]
  assert mu.sharding.shard_shape(mu.shape) == (12, 1)  # the moment of this device's columns

  # The same split given as a PartitionSpec tree for a plain pytree.
  plain = {"w": 0.3 * jax.random.normal(jax.random.key(2), (8, 4)), "b": jnp.zeros(3)}
  trainer = jaxcomm.data_parallel(lambda p, batch: 0.0, tx(), mesh, shard_over="local")
  state = trainer.init(plain, specs={"w": P(None, "local"), "b": P()})
  assert state.params["w"].shape == (8, 4)
  assert state.params["w"].sharding.shard_shape((8, 4)) == (8, 1)
  assert state.params["b"].shape == (4,)  # flat, padded
  chex.assert_trees_all_equal(trainer.model(state), plain)


@pytest.mark.parametrize("specs,shard_over,message", [
    ({"w": P("model"), "b": P(), "c": P()}, "local", "names 'model', which the mesh lacks"),
    ({"w": P("host"), "b": P(), "c": P()}, "local", "replicated over the other axes"),
    ({"w": P("local", None), "b": P(), "c": P()}, "local", "which does not divide 5"),
    ({"w": P("local", "local"), "b": P(), "c": P()}, "local", "at most one of the 2"),
    ({"w": P()}, "local", "one PartitionSpec per parameter leaf"),
    ({"w": P(), "b": P(), "c": P()}, None, "needs data_parallel"),
])
def test_bad_parameter_specs_are_refused_naming_the_leaf(specs, shard_over, message):
  params, loss_fn, _ = problem()
  trainer = jaxcomm.data_parallel(loss_fn, optax.sgd(0.1), jaxcomm.make_mesh(hosts=2, local=4),
                                  shard_over=shard_over)
  with pytest.raises(ValueError, match=message):
    trainer.init(params, specs=specs)
