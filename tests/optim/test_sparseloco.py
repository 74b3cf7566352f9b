"""SparseLoCo: the payload, the dense identity, bytes per step, branch selectors, quality."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.optim.diloco import diloco
from jaxcomm._src.optim.local_training import to_device_local
from jaxcomm._src.optim.sparseloco import (chunk_layout, decode, elias_fano_bits, encode,
                                           fast_mean, index_bits, pack_positions,
                                           pack_sorted_positions, payload_bytes, sparse_sync,
                                           sparseloco, unpack_positions,
                                           unpack_sorted_positions)
from lowcomm_helpers import AXES, eval_loss, train
from test_branches import branch_selectors, traced_step
from update_helpers import apply_fn, update_fn
import fast_random

HOSTS, LOCAL = 2, 4
INNER = functools.partial(optax.adam, 3e-3)


def dense_reference(period):
  """DiLoCo without outer momentum on the host-averaged inner steps."""
  return diloco(optax.chain(fast_mean("local"), INNER()), period, outer=optax.sgd(1.0))


def chosen_per_block(error, layout):
  """numpy reference: per chunk, the flat positions (inside the chunk) of the top ``m`` of
  |error| in each ``v``-element block."""
  rows = np.pad(np.asarray(error), (0, layout.count * layout.width - error.size))
  rows = rows.reshape(layout.count, layout.blocks, layout.block)
  top = np.argsort(-np.abs(rows), axis=2, kind="stable")[..., :layout.kept]
  return rows.reshape(layout.count, -1), (
      top + layout.block * np.arange(layout.blocks)[:, None]).reshape(layout.count, -1)


@pytest.mark.parametrize("bits, block, positions", [
    (1, None, "fixed"), (2, None, "fixed"), (4, None, "fixed"), (32, None, "fixed"),
    (2, 8, "elias-fano")])
def test_payload_is_the_blockwise_topk_on_a_packed_grid(bits, block, positions):
  error = fast_random.normal(jax.random.PRNGKey(bits), (300,))
  chunk, density = 64, 0.1 if block is None else 0.25
  payload, sent = encode(error, chunk, density, bits, block, positions)
  assert sum(leaf.nbytes for leaf in payload) == payload_bytes(300, chunk, density, bits, block,
                                                               positions)
  layout = chunk_layout(300, chunk, density, block)
  assert payload.indices.dtype == jnp.uint8
  if positions == "fixed":  # 6-bit positions in 64-element chunks
    b = 6 if block is None else index_bits(block)
    assert payload.indices.size == -(-layout.sent * b // 8)
  else:  # 2 of each 8: 2 low bits each, 1 + 2 unary bits per block
    assert elias_fano_bits(8, 2) == (2, 3)
    assert payload.indices.size == -(-layout.sent * 2 // 8) + -(-(layout.sent // 2) * 3 // 8)
  np.testing.assert_array_equal(
      decode(payload, 300, chunk, density, bits, block, positions), sent)
  rows, chosen = chosen_per_block(error, layout)
  decoded = np.pad(np.asarray(sent), (0, rows.size - 300)).reshape(rows.shape)
  for start, row, out, kept in zip(range(0, rows.size, layout.width), rows, decoded, chosen):
    assert set(np.flatnonzero(out)) <= set(kept)
    kept = kept[start + kept < 300]  # what was chosen in the padding is not decoded
    scale = np.abs(row[kept]).max()
    if bits == 32:
      np.testing.assert_array_equal(out[kept], row[kept])
    else:  # nearest of 2**bits levels on [-scale, scale]
      levels = np.linspace(-scale, scale, 2**bits)
      nearest = levels[np.argmin(np.abs(row[kept, None] - levels), axis=1)]
      np.testing.assert_allclose(out[kept], nearest, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(size=st.integers(1, 200), block=st.sampled_from([None, 1, 2, 4, 16]),
       chunks_per=st.integers(1, 4), kept=st.integers(1, 4), seed=st.integers(0, 2**16),
       positions=st.sampled_from(["fixed", "elias-fano"]))
def test_float32_payload_round_trips_exactly_the_top_of_every_block(size, block, chunks_per,
                                                                     kept, seed, positions):
  chunk = (block or 8) * chunks_per
  density = min(kept, block or chunk) / (block or chunk)
  error = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
  layout = chunk_layout(size, chunk, density, block)
  payload, sent = jax.jit(encode, static_argnums=(1, 2, 3, 4, 5))(error, chunk, density, 32,
                                                                  block, positions)
  assert sum(leaf.nbytes for leaf in payload) == payload_bytes(size, chunk, density, 32, block,
                                                               positions)
  rows, chosen = chosen_per_block(error, layout)
  expected = np.zeros_like(rows)
  np.put_along_axis(expected, chosen, np.take_along_axis(rows, chosen, axis=1), axis=1)
  np.testing.assert_array_equal(np.asarray(sent), expected.reshape(-1)[:size])


@settings(max_examples=10, deadline=None)
@given(block=st.integers(1, 5000), groups=st.integers(1, 3), data=st.data())
def test_sorted_positions_round_trip_elias_fano(block, groups, data):
  kept = data.draw(st.integers(1, min(block, 40)))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  positions = np.sort(np.stack([rng.choice(block, kept, replace=False)
                                for _ in range(groups)]), axis=1)
  low, unary = elias_fano_bits(block, kept)
  assert low == int(np.floor(np.log2(block / kept))) and unary == ((block - 1) >> low) + kept
  packed = jax.jit(pack_sorted_positions, static_argnums=1)(jnp.asarray(positions), block)
  assert packed.dtype == jnp.uint8
  assert packed.size == -(-groups * kept * low // 8) + -(-groups * unary // 8)
  unpack = jax.jit(unpack_sorted_positions, static_argnums=(1, 2, 3))
  np.testing.assert_array_equal(unpack(packed, block, groups, kept), positions.reshape(-1))


@pytest.mark.parametrize("width", [1, 2, 7, 256, 257, 4096, 5000, 65536])
def test_positions_round_trip_at_ceil_log2_width_bits(width):
  positions = jax.random.randint(jax.random.PRNGKey(width), (37,), 0, width)
  packed = pack_positions(positions, width)
  assert index_bits(width) == max(1, int(np.ceil(np.log2(width))))
  assert packed.dtype == jnp.uint8 and packed.size == -(-37 * index_bits(width) // 8)
  np.testing.assert_array_equal(unpack_positions(packed, width, 37), positions)


def test_density_one_at_32_bits_is_diloco_without_outer_momentum():
  expected = train(dense_reference(4), 8, local=True)[0]
  params = train(sparseloco(INNER(), 4, density=1.0, bits=32, chunk=64), 8, local=True)[0]
  chex.assert_trees_all_close(params, expected, atol=1e-6)


def test_error_buffer_keeps_exactly_what_was_not_sent():
  mesh = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  params = {"w": jnp.zeros((16, 20)), "b": jnp.zeros((20,))}
  state, update = update_fn(sparse_sync(0.1, 2, 0.5, 16, "local", "host"), params, mesh)
  deltas = {name: fast_random.normal(jax.random.PRNGKey(i), (HOSTS * LOCAL, *p.shape))
            for i, (name, p) in enumerate(sorted(params.items()))}
  out, state = update(deltas, state)
  for name, p in params.items():
    host_mean = np.asarray(deltas[name]).reshape(HOSTS, LOCAL, -1).mean(axis=1)
    error = np.asarray(state.error[name]).reshape(HOSTS, -1)[:, :p.size]
    # sent_h = Delta_h - e_h, and the output is the mean over hosts of what they sent
    np.testing.assert_allclose(np.asarray(out[name]).reshape(-1),
                               (host_mean - error).mean(axis=0), atol=1e-6)
    assert np.all(np.count_nonzero(host_mean - error > 1e-7, axis=1) < 0.5 * p.size)


@pytest.mark.parametrize("block, positions", [(None, "fixed"), (4, "elias-fano")])
def test_bytes_per_step_match_the_formula(block, positions):
  mesh, period, chunk, density, bits = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL), 4, 16, 0.1, 2
  params = {"w": jnp.zeros((16, 20)), "b": jnp.zeros((20,))}
  tx = sparseloco(INNER(), period, density=density, bits=bits, chunk=chunk, block=block,
                  positions=positions)
  state, step = apply_fn(tx, to_device_local(params, mesh), mesh, P(AXES))
  grads = jax.tree.map(lambda p: jnp.zeros((HOSTS * LOCAL, *p.shape)), params)
  report = jaxcomm.accounting.measure(step, to_device_local(params, mesh), state, grads,
                                      mesh=mesh)
  (switch,) = report.conditionals()
  measured = report.link_bytes(branch_weights={switch: [1 - 1 / period, 1 / period]})
  shards = [-(-p.size // LOCAL) for p in params.values()]
  slow = sum((HOSTS - 1) * payload_bytes(s, chunk, density, bits, block, positions)
             for s in shards) / period
  fast = sum(2 * (LOCAL - 1) / LOCAL * 4 * p.size for p in params.values()) + sum(
      2 * (LOCAL - 1) * 4 * s for s in shards) / period
  assert measured == pytest.approx({"host": slow, "local": fast})


def test_outer_collectives_are_selected_by_replicated_values():
  selectors = branch_selectors(traced_step(sparseloco(INNER(), 4, chunk=16), True))
  guarded = [varying for varying, collective in selectors if collective]
  assert guarded and all(not varying for varying in guarded), selectors


def test_trains_the_mlp_close_to_its_dense_reference():
  reference = eval_loss(train(dense_reference(4), 60, local=True)[0], local=True)
  params, _, losses, _, _ = train(sparseloco(INNER(), 4, density=0.25, chunk=64), 60,
                                  local=True)
  assert eval_loss(params, local=True) < reference + 0.06, (losses, reference)
  assert losses[-1] < 0.6 * losses[0]


@pytest.mark.parametrize("kwargs, match", [
    ({"period": 0}, "period must be >= 1, got 0"),
    ({"density": 0.0}, r"density must be in \(0, 1\], got 0.0"),
    ({"density": 1.5}, r"density must be in \(0, 1\], got 1.5"),
    ({"bits": 0}, r"bits must be in \[1, 32\], got 0"),
    ({"bits": 16}, r"bits must be in \[1, 8\] or 32, got 16"),
    ({"beta": 1.0}, r"beta must be in \[0, 1\), got 1.0"),
    ({"alpha": 0.0}, "alpha must be a finite float > 0, got 0.0"),
    ({"chunk": 0}, r"chunk must be in \[1, 65536\], got 0"),
    ({"chunk": 65537}, r"chunk must be in \[1, 65536\], got 65537"),
    ({"block": 0}, r"block must be in \[1, 4096\], got 0"),
    ({"chunk": 64, "block": 128}, r"block must be in \[1, 64\], got 128"),
    ({"block": 3}, r"block must divide chunk \(4096\), got 3"),
    ({"block": 2.0}, r"block must be an int, got 2.0"),
    ({"positions": "gamma"}, r"positions must be one of \('fixed', 'elias-fano'\), got 'gamma'"),
    ({"fast_axis": "host"}, "fast_axis and slow_axis must differ"),
])
def test_bad_arguments_raise_at_construction_naming_parameter_and_value(kwargs, match):
  kwargs = {"period": 4, **kwargs}
  with pytest.raises((ValueError, TypeError), match=match):
    sparseloco(INNER(), kwargs.pop("period"), **kwargs)


def test_integer_leaves_are_refused_at_init_naming_the_leaf():
  mesh = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  params = to_device_local({"w": jnp.zeros((4, 4)), "n": jnp.zeros((4,), jnp.int32)}, mesh)
  with pytest.raises(TypeError, match=r"params\['n'\] must be a float32"):
    jaxcomm.optim.sharded_init(sparseloco(optax.sgd(0.1), 4), params, mesh, P(AXES))
