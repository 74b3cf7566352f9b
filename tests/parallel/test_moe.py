"""Expert-parallel MoE against a dense single-device reference; bytes against the formulas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm import accounting
from jaxcomm.parallel import moe_layer, moe_reference
from jaxcomm._src.parallel.moe import capacity, host_rows
from jaxcomm.parallel import route as route_eagerly
from jaxcomm._src.topology import make_mesh

EXPERTS, D_MODEL, HIDDEN, TOP_K, FACTOR, TOKENS = 16, 8, 16, 2, 1.0, 24
ALL = ("host", "local")
route = jax.jit(route_eagerly, static_argnames=("top_k", "capacity_factor"))


def _layer(hosts, **kwargs):
  mesh = make_mesh(hosts=hosts, local=8 // hosts)
  config = dict(num_experts=EXPERTS, d_model=D_MODEL, hidden=HIDDEN, top_k=TOP_K,
                capacity_factor=FACTOR)
  return mesh, moe_layer(mesh, **{**config, **kwargs})


@functools.lru_cache
def _setup(hosts, hierarchical=False, dispatch_dtype=None, dedup=False, **kwargs):
  """``(mesh, layer, sharded apply)``, one per configuration, so tests share compilations."""
  mesh, layer = _layer(hosts, hierarchical=hierarchical, dispatch_dtype=dispatch_dtype,
                       dedup=dedup, **kwargs)
  return mesh, layer, _sharded(mesh, layer)


def _sharded(mesh, layer):
  def apply(params, x):
    y, stats = layer.apply(params, x)
    return y, jax.tree.map(lambda s: s[None], stats)
  return jax.jit(jax.shard_map(apply, mesh=mesh, in_specs=(layer.param_specs, P(ALL)),
                               out_specs=(P(ALL), P(ALL))))


def _dense(params, x):
  return moe_reference(params, x, num_groups=8, top_k=TOP_K, capacity_factor=FACTOR)


def _loss(fn, params, x):
  y, stats = fn(params, x)
  return jnp.sum(jnp.sin(y)) + 0.1 * jnp.mean(stats.aux_loss), (y, stats)


@functools.partial(jax.jit, static_argnums=0)
def _outputs_and_gradients(fn, params, x):
  """``(y, stats, (d params, d x))`` of ``fn`` under :func:`_loss`."""
  grads, (y, stats) = jax.grad(functools.partial(_loss, fn), argnums=(0, 1), has_aux=True)(
      params, x)
  return y, stats, grads


def _inputs(layer):
  params = layer.init(jax.random.key(0))
  return params, jax.random.normal(jax.random.key(1), (8 * TOKENS, D_MODEL))


def _relative_errors(got, want):
  return [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]


@pytest.mark.parametrize("hosts,hierarchical,dedup", [
    (1, False, False), (2, True, False), (4, True, False), (4, False, False),
    (1, True, True), (2, True, True), (4, True, True)])
def test_matches_dense_reference_forward_and_gradients(hosts, hierarchical, dedup):
  _, layer, sharded = _setup(hosts, hierarchical, dedup=dedup)
  params, x = _inputs(layer)
  y, stats, grads = _outputs_and_gradients(sharded, params, x)
  want_y, want_stats, want_grads = _outputs_and_gradients(_dense, params, x)
  assert int(jnp.sum(want_stats.dropped)) > 0          # the drops are exercised
  np.testing.assert_array_equal(stats.dropped, want_stats.dropped)
  np.testing.assert_allclose(stats.aux_loss, want_stats.aux_loss, rtol=1e-6)
  assert max(_relative_errors(y, want_y)) < 1e-5
  assert max(_relative_errors(grads, want_grads)) < 1e-5


@pytest.mark.parametrize("hosts,hierarchical,dispatch_dtype,dedup", [
    (2, False, None, False), (4, True, None, False), (2, True, "int8", False),
    (4, True, None, True), (2, True, "int8", True)])
def test_bytes_per_axis_equal_the_formulas(hosts, hierarchical, dispatch_dtype, dedup):
  mesh, layer, sharded = _setup(hosts, hierarchical, dispatch_dtype, dedup)
  params, x = _inputs(layer)
  per_exchange = layer.exchange_bytes(TOKENS)
  forward = accounting.measure(sharded, params, x, mesh=mesh)
  assert forward.bytes_per_axes() == layer.forward_bytes(TOKENS)
  # dedup's metadata: int32 row index + fp32 gate per slot of each host's experts, E C slots.
  slots = EXPERTS * capacity(TOKENS, EXPERTS, TOP_K, FACTOR)
  metadata = {("host",): (hosts - 1) / hosts * slots * 8} if dedup else {}
  assert forward.bytes_per_axes() == pytest.approx(
      {axes: 2 * b + metadata.get(axes, 0) for axes, b in per_exchange.items()})
  step = accounting.measure(_outputs_and_gradients, sharded, params, x, mesh=mesh)
  # Plus the replicated router's gradient all-reduce over every device: 2 (P-1)/P * d E * 4,
  # and with dedup the gates' cotangent (fp32 per slot) sent back over 'host'.
  extra = {("local",) if hosts == 1 else ALL: 2 * 7 / 8 * D_MODEL * EXPERTS * 4}
  if dedup:
    extra["host",] = 1.5 * metadata["host",]
  want = {axes: 4 * per_exchange.get(axes, 0) + extra.get(axes, 0)
          for axes in {*per_exchange, *extra}}
  assert step.bytes_per_axes() == pytest.approx(want)
  codes = ({"s8", "f32"} if dispatch_dtype else {"f32"}) | ({"s32"} if dedup else set())
  assert {dtype for op in forward.collectives for dtype in op.dtypes} == codes


def test_hierarchical_sends_the_same_inter_host_bytes_as_flat_in_fewer_messages():
  hosts, local = 2, 4
  charged, messages = {}, {}
  for hierarchical in (False, True):
    mesh, layer, sharded = _setup(hosts, hierarchical)
    report = accounting.measure(sharded, *_inputs(layer), mesh=mesh)
    slow = [op for op in report.collectives if "host" in op.axes]
    assert all(op.axes == (("host",) if hierarchical else ALL) for op in slow)
    charged[hierarchical] = report.link_bytes()["host"]
    # Of a collective over n devices spanning 'host', n (H-1)/H peers sit on other hosts.
    messages[hierarchical] = sum(op.group_size * (hosts - 1) // hosts for op in slow)
  # Each exchange sends (H-1)/H of the (E, C, d) buffer off the host, either way.
  size = EXPERTS * capacity(TOKENS, EXPERTS, TOP_K, FACTOR) * D_MODEL * 4
  assert charged[False] == charged[True] == 2 * (hosts - 1) / hosts * size
  assert messages[False] == local * messages[True] == 2 * local * (hosts - 1)


@pytest.mark.parametrize("hosts", [2, 4])
def test_dedup_sends_fewer_inter_host_bytes_than_flat_by_the_formula(hosts):
  # k = 4, capacity_factor = 1.5: C = 9 slots per expert, so R = min(T, (E/H) C) = T rows
  # per host carry what flat dispatch sends as (E/H) C slots.
  config = dict(top_k=4, capacity_factor=1.5)
  charged = {}
  for dedup in (False, True):
    mesh, layer, sharded = _setup(hosts, dedup, dedup=dedup, **config)
    report = accounting.measure(sharded, *_inputs(layer), mesh=mesh)
    charged[dedup] = report.link_bytes()["host"]
  slots = capacity(TOKENS, EXPERTS, 4, 1.5)
  per_host, rows = EXPERTS // hosts * slots, host_rows(TOKENS, EXPERTS, hosts, slots)
  assert rows == TOKENS < per_host
  # Per forward, (H-1) of the H destination blocks leave the host, twice (there and back).
  flat = 2 * (hosts - 1) * per_host * D_MODEL * 4
  dedup = (hosts - 1) * (2 * rows * D_MODEL * 4 + per_host * 8)   # + index and gate per slot
  assert charged == {False: pytest.approx(flat), True: pytest.approx(dedup)}
  assert charged[False] / charged[True] == pytest.approx(
      2 * per_host * D_MODEL / (2 * rows * D_MODEL + 2 * per_host)) and flat > dedup


@pytest.mark.parametrize("dedup", [False, True])
def test_int8_dispatch_is_close_and_its_gradients_flow(dedup):
  params, x = _inputs(_setup(2, True)[1])
  (y_int8, _, grads_int8), (y_exact, _, grads_exact) = (
      _outputs_and_gradients(_setup(2, True, dtype, dedup)[2], params, x)
      for dtype in ("int8", None))
  assert 0 < max(_relative_errors(y_int8, y_exact)) < 0.03
  for got, want in zip(jax.tree.leaves(grads_int8), jax.tree.leaves(grads_exact)):
    cosine = jnp.sum(got * want) / (jnp.linalg.norm(got) * jnp.linalg.norm(want))
    assert float(cosine) > 0.999


def test_dropped_count_on_a_hand_built_routing():
  # Router = identity, token = 10 * e_first + 5 * e_second: choices are known by construction.
  first, second = [0, 0, 0, 1], [1, 1, 2, 0]
  x = 10.0 * jax.nn.one_hot(jnp.array(first), 4) + 5.0 * jax.nn.one_hot(jnp.array(second), 4)
  routing = route(x, jnp.eye(4), top_k=2, capacity_factor=1.0)    # C = ceil(4 * 2 / 4) = 2
  # Expert 0 queue: t0, t1 (first choices) kept; t2 first choice and t3 second choice dropped.
  # Expert 1 queue: t3 (first) kept, then t0 (second) kept, t1 (second) dropped.
  kept = {(0, 0, 0), (1, 0, 1), (3, 1, 0), (0, 1, 1), (2, 2, 0)}
  want = np.zeros((4, 4, 2))
  for index in kept:
    want[index] = 1.0
  np.testing.assert_array_equal(routing.dispatch, want)
  assert int(routing.stats.dropped) == 3
  assert int(routing.stats.dropped_tokens) == 0
  gates = np.asarray(routing.combine).sum(-1)
  np.testing.assert_allclose(gates[0].sum(), 1.0, rtol=1e-6)    # both choices kept
  probs = jax.nn.softmax(x, -1)
  fraction = np.array([4, 3, 1, 0]) / 8
  np.testing.assert_allclose(routing.stats.aux_loss, 4 * np.sum(fraction * probs.mean(0)),
                             rtol=1e-6)


def test_top_1_drops_whole_tokens():
  x = jax.nn.one_hot(jnp.array([0, 0, 0, 1, 2, 2, 2, 2]), 4) * 10.0
  routing = route(x, jnp.eye(4), top_k=1, capacity_factor=1.0)    # C = 2
  assert int(routing.stats.dropped) == int(routing.stats.dropped_tokens) == 3
  np.testing.assert_array_equal(routing.dispatch.sum((1, 2)), [1, 1, 0, 1, 1, 1, 0, 0])


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(capacity_factor=0.0), ValueError, r"capacity_factor must be > 0; got .*=0.0"),
    (dict(capacity_factor=-1), ValueError, r"capacity_factor must be > 0"),
    (dict(capacity_factor="1"), TypeError, r"capacity_factor must be a number"),
    (dict(top_k=17), ValueError, r"top_k=17 must be <= num_experts=16"),
    (dict(top_k=0), ValueError, r"top_k must be >= 1; got top_k=0"),
    (dict(num_experts=12), ValueError, r"num_experts=12 is not divisible by the 8 devices"),
    (dict(expert_axes=("data",)), ValueError, r"expert_axes=\('data',\) must be distinct axes"),
    (dict(expert_axes="local", hierarchical=True), ValueError, r"hierarchical=True needs"),
    (dict(dispatch_dtype="fp4"), ValueError, r"dispatch_dtype='fp4' is unknown"),
    (dict(dedup=True), ValueError, r"dedup=True needs hierarchical=True"),
    (dict(d_model=2.5), TypeError, r"d_model must be an int"),
])
def test_bad_configuration_raises_naming_the_parameter(kwargs, error, match):
  with pytest.raises(error, match=match):
    _layer(2, **kwargs)


def test_bad_shapes_raise():
  mesh, layer = _layer(2)
  params, x = _inputs(layer)
  with pytest.raises(ValueError, match=r"tokens \(191, x.shape\[0\]\) must be divisible"):
    _dense(params, x[:-1])
  with pytest.raises(ValueError, match=r"d_model=8"):
    _sharded(mesh, layer)(params, x[:, :4])


def test_moe_lm_step_lowers_the_loss_and_keeps_experts_sharded():
  import optax
  from flax import nnx

  from models.moe_lm import MoETransformerLM, make_train_step
  from models.transformer import TransformerConfig

  mesh, layer = _layer(2, hierarchical=True, d_model=16, hidden=16, num_experts=8)
  config = TransformerConfig(vocab_size=32, d_model=16, num_heads=2, num_kv_heads=2,
                             num_layers=1, mlp_dim=16)
  model = MoETransformerLM(config, layer, rngs=nnx.Rngs(0))
  step = make_train_step(model, layer, mesh, optax.adam(1e-2))
  params, opt_state = step.init(model)
  tokens = jax.random.randint(jax.random.key(2), (8, 9), 0, 32)
  batch = tokens[:, :-1], tokens[:, 1:]
  before = float(step.evaluate(params, batch))
  for _ in range(5):
    params, opt_state, (loss, dropped) = step.update(params, opt_state, batch)
    jax.block_until_ready(loss)
  assert float(step.evaluate(params, batch)) < before - 0.1
  assert 0 <= float(dropped) < 1
  w_in = params["blocks"][0]["experts"]["w_in"][...]
  assert w_in.sharding.spec == layer.param_specs.w_in and w_in.shape[0] == 8
