"""The mathematical properties each compressor's docstring claims, checked with fixed seeds."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxcomm.compress import (adaptive_threshold, cast, compose, count_sketch, error_feedback,
                              identity, natural, pack_bits, packed_nbytes, payload_nbytes,
                              psum_payload, qsgd, quantize, randomk, shared_quantize, sign,
                              sum_payloads, terngrad, threshold, topk, unpack_bits)
from jaxcomm._src.collectives.strategies import over_axis
from jaxcomm._src.compress.base import AxisContext, combining
from jaxcomm._src.compress.sketch import median_of_rows, sketch_hashes

SIZE = 16
SAMPLES = 4000
X = jnp.asarray(np.random.default_rng(1).standard_normal(SIZE), jnp.float32).at[3].set(0.0)


@functools.lru_cache(maxsize=None)
def samples(compressor):
  """``SAMPLES`` decoded outputs of ``compressor`` on ``X``, one per key (one compilation)."""
  state = compressor.init(X.shape, X.dtype)

  @jax.jit
  def run(keys):
    def one(key):
      payload, _ = compressor.encode(X, state, key)
      return compressor.decode(payload, X.shape)
    return jax.vmap(one)(keys)

  return np.asarray(run(jax.random.split(jax.random.PRNGKey(7), SAMPLES)), np.float64)


def _l1(x):
  return float(jnp.sum(jnp.abs(x)))


def _sq(x):
  return float(jnp.sum(jnp.square(x)))


UNBIASED = {
    # name: (compressor, variance bound as a multiple of ||x||^2)
    "qsgd": (qsgd(4), min(SIZE / 16, math.sqrt(SIZE) / 4)),
    "qsgd_bucketed": (qsgd(2, bucket=5), min(5 / 4, math.sqrt(5) / 2)),
    "terngrad": (terngrad(clip=None), float(jnp.max(jnp.abs(X))) * _l1(X) / _sq(X) - 1.0),
    "natural": (natural(), 1.0 / 8.0),
    "int4": (quantize(4), SIZE * (2 * float(jnp.max(jnp.abs(X))) / 14) ** 2 / 4 / _sq(X)),
    "randomk": (randomk(0.25, shared=False), SIZE / 4 - 1.0),
    "randomk_shared": (randomk(0.25), SIZE / 4 - 1.0),
    "randomk_int8": (compose(randomk(0.5, shared=False), quantize(8)), None),
}
# Their unbiasedness is checked over shapes and seeds on the catalog's instances
# (tests/compress/test_catalog_properties.py); the others' here.
IN_CATALOG = {"qsgd", "qsgd_bucketed", "terngrad", "natural", "int4", "randomk_shared"}


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_unbiased_with_stated_variance(name):
  compressor, omega = UNBIASED[name]
  assert compressor.unbiased
  if name == "randomk_shared":
    # The shared key lives in the state: successive calls are the samples.
    def step(state, _):
      payload, state = compressor.encode(X, state, jax.random.PRNGKey(0))
      return state, compressor.decode(payload, X.shape)
    run = jax.jit(lambda state: jax.lax.scan(step, state, None, length=SAMPLES)[1])
    decoded = np.asarray(run(compressor.init(X.shape, X.dtype)), np.float64)
  else:
    decoded = samples(compressor)
  if name not in IN_CATALOG:
    mean, std = decoded.mean(0), decoded.std(0)
    bound = 5.0 * std / math.sqrt(decoded.shape[0]) + 1e-6
    np.testing.assert_array_less(np.abs(mean - np.asarray(X)), bound)
  if omega is not None:
    error = np.mean(np.sum((decoded - np.asarray(X)) ** 2, axis=1))
    assert error <= 1.1 * omega * _sq(X), (error, omega * _sq(X))


def test_topk_contraction_exact_and_chunked():
  for compressor, delta in ((topk(0.25), 4 / SIZE), (topk(0.25, chunk=8), 2 / 8),
                            (topk(k=3), 3 / SIZE)):
    payload, _ = compressor.encode(X, (), jax.random.PRNGKey(0))
    error = _sq(compressor.decode(payload, X.shape) - X)
    assert error <= (1 - delta) * _sq(X) + 1e-6, compressor.name
  chunked, _ = topk(0.25, chunk=8).encode(X, (), jax.random.PRNGKey(0))
  assert chunked.indices.dtype == jnp.uint16 and chunked.indices.shape == (2, 2)
  with pytest.raises(ValueError, match="chunk"):
    topk(0.1, chunk=65537)


def test_scaled_sign_error_identity():
  compressor = sign()
  payload, _ = compressor.encode(X, (), jax.random.PRNGKey(0))
  error = _sq(compressor.decode(payload, X.shape) - X)
  np.testing.assert_allclose(error, _sq(X) - _l1(X) ** 2 / SIZE, rtol=1e-5)


def test_unscaled_randomk_contracts_in_expectation():
  decoded = samples(randomk(0.25, shared=False, scale=False))
  error = np.mean(np.sum((decoded - np.asarray(X)) ** 2, axis=1))
  np.testing.assert_allclose(error, (1 - 4 / SIZE) * _sq(X), rtol=0.05)


def test_shared_randomk_is_linear_and_psum_matches():
  compressor = randomk(0.25)
  state = compressor.init(X.shape, X.dtype)
  inputs = jnp.stack([X, jnp.flip(X), 2.0 * X])
  payloads, states = jax.vmap(compressor.encode, in_axes=(0, None, None))(
      inputs, state, jax.random.PRNGKey(0))
  summed = sum_payloads(payloads)
  of_sum, _ = compressor.encode(inputs.sum(0), state, jax.random.PRNGKey(0))
  chex.assert_trees_all_close(summed, of_sum, rtol=1e-6)
  decoded = jax.vmap(lambda p: compressor.decode(p, X.shape))(payloads)
  np.testing.assert_allclose(compressor.decode(summed, X.shape), decoded.sum(0), rtol=1e-5,
                             atol=1e-6)
  psummed = jax.vmap(lambda p: psum_payload(p, "devices"), axis_name="devices")(payloads)
  chex.assert_trees_all_close(jax.tree.map(lambda leaf: leaf[1], psummed), summed)
  np.testing.assert_array_equal(states.key[0], states.key[2])


@pytest.mark.parametrize(
    "compressor", [identity(), cast(jnp.bfloat16), cast(jnp.float16, axis_size=3)],
    ids=lambda compressor: compressor.name)
def test_linear_casts_sum_like_their_inputs(compressor):
  assert compressor.linear
  inputs = jnp.stack([X, jnp.flip(X), -0.5 * X])
  payloads, _ = jax.vmap(compressor.encode, in_axes=(0, None, None))(inputs, (), None)
  decoded = jax.vmap(lambda p: compressor.decode(p, X.shape))(payloads)
  of_sum = compressor.decode(compressor.encode(inputs.sum(0), (), None)[0], X.shape)
  summed = compressor.decode(sum_payloads(payloads), X.shape)
  # Exact for identity; within the dtype's rounding of the sum for casts.
  tolerance = 4 * float(jnp.finfo(jnp.asarray(payloads).dtype).eps) * 3
  np.testing.assert_allclose(summed, decoded.sum(0), rtol=tolerance, atol=tolerance)
  np.testing.assert_allclose(summed, of_sum, rtol=tolerance, atol=tolerance)


def test_cast_guard_sums_without_overflow_and_saturates():
  big = jnp.full((4,), 60000.0)
  guarded, plain = cast(jnp.float16, axis_size=4), cast(jnp.float16)
  payloads = jnp.stack([guarded.encode(big, (), None)[0]] * 4)
  total = guarded.decode(jnp.sum(payloads, axis=0), (4,))
  np.testing.assert_allclose(total, 4 * big, rtol=1e-3)
  assert not jnp.all(jnp.isfinite(jnp.sum(jnp.stack([plain.encode(big, (), None)[0]] * 4), 0)))
  for dtype, limit in ((jnp.float16, 65504.0), (jnp.float8_e4m3fn, 448.0)):
    sent, _ = cast(dtype).encode(jnp.array([1e9, -1e9, jnp.nan]), (), None)
    np.testing.assert_array_equal(np.asarray(sent[:2], np.float32), [limit, -limit])
    assert np.isnan(np.float32(sent[2]))
  scaled = cast(jnp.float8_e4m3fn, scaled=True)
  small = 1e-4 * X
  payload, _ = scaled.encode(small, (), None)
  assert _sq(scaled.decode(payload, X.shape) - small) <= 0.01 * _sq(small)


def test_qsgd_wire_format():
  assert [qsgd(s).wire_bytes((8,), jnp.float32) for s in (1, 3, 16, 127)] == [6, 7, 10, 12]
  compressor = qsgd(3)
  payload, _ = compressor.encode(X, (), jax.random.PRNGKey(1))
  decoded = np.asarray(compressor.decode(payload, X.shape))
  levels = np.abs(decoded) * 3 / float(payload.norm[0])
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-5)
  assert np.all(np.round(levels) <= 3)
  np.testing.assert_array_equal(np.sign(decoded) * np.sign(X) >= 0, True)


def _over_devices(fn):
  """``fn`` run with the engine's axis context of the vmapped axis ``'devices'``."""
  def run(*args):
    with combining(over_axis("devices")):
      return fn(*args)
  return run


def test_terngrad_shared_scaler_under_a_named_axis():
  compressor = terngrad(clip=None, shared_scale=True)
  inputs = jnp.stack([X, 3.0 * X])
  payloads, _ = jax.vmap(_over_devices(compressor.encode), in_axes=(0, None, None),
                         axis_name="devices")(inputs, (), jax.random.PRNGKey(0))
  np.testing.assert_allclose(payloads.scaler[:, 0], 3.0 * float(jnp.max(jnp.abs(X))))
  decoded = jax.vmap(lambda p: compressor.decode(p, X.shape))(payloads)
  assert set(np.unique(np.asarray(decoded) / payloads.scaler[0, 0])) <= {-1.0, 0.0, 1.0}


def test_natural_sends_neighbouring_powers_of_two():
  compressor = natural()
  values = jnp.array([3.0, -0.75, 1.0, 0.0, 1e-40, 2e38], jnp.float32)
  decoded = jax.vmap(lambda key: compressor.decode(
      compressor.encode(values, (), key)[0], values.shape))(jax.random.split(
          jax.random.PRNGKey(0), 64))
  decoded = np.asarray(decoded)
  assert set(np.unique(decoded[:, 0])) == {2.0, 4.0}
  assert set(np.unique(decoded[:, 1])) == {-0.5, -1.0}
  np.testing.assert_array_equal(decoded[:, 2:4], [[1.0, 0.0]] * 64)
  assert set(np.unique(decoded[:, 4])) <= {0.0, 2.0**-126}
  assert np.all(np.isfinite(decoded[:, 5]))


def test_threshold_overflow_stays_in_the_residual():
  compressor = error_feedback(threshold(0.5, capacity=0.25))
  state = compressor.init(X.shape, X.dtype)
  payload, state = compressor.encode(X, state, jax.random.PRNGKey(0))
  above = int(jnp.sum(jnp.abs(X) >= 0.5))
  assert above > 4 and int(payload.count[0]) == 4
  sent = compressor.decode(payload, X.shape)
  np.testing.assert_allclose(sent + state.residual, X, atol=1e-6)
  kept = np.sort(np.abs(np.asarray(X)))[-4:]
  np.testing.assert_allclose(np.sort(np.abs(np.asarray(sent)))[-4:], kept)
  total = sent
  for _ in range(3):
    payload, state = compressor.encode(jnp.zeros_like(X), state, jax.random.PRNGKey(0))
    total = total + compressor.decode(payload, X.shape)
  np.testing.assert_allclose(total + state.residual, X, atol=1e-6)
  assert _sq(state.residual) < _sq(X) and float(jnp.max(jnp.abs(state.residual))) < 0.5


def test_adaptive_threshold_hits_the_density():
  x = jax.random.normal(jax.random.PRNGKey(2), (4096,))
  compressor = adaptive_threshold(0.05, sample=0.1)
  payload, _ = jax.jit(compressor.encode)(x, (), jax.random.PRNGKey(3))
  assert 0.03 * 4096 <= int(payload.count[0]) <= 0.08 * 4096


def test_composition_counts_bytes_exactly():
  compressor = compose(topk(0.01), quantize(4))
  shape = (1000,)
  assert compressor.wire_bytes(shape, jnp.float32) == 10 * 4 + (5 + 4)
  chunked = compose(topk(0.25, chunk=8), quantize(8, stochastic=False))
  assert chunked.wire_bytes((SIZE,), jnp.float32) == 4 * 2 + (4 + 4)
  payload, _ = chunked.encode(X, chunked.init(X.shape, X.dtype), jax.random.PRNGKey(0))
  reference, _ = topk(0.25, chunk=8).encode(X, (), None)
  np.testing.assert_allclose(chunked.decode(payload, X.shape),
                             topk(0.25, chunk=8).decode(reference, X.shape), atol=0.02)


def test_count_sketch_linear_and_recovers_heavy_hitters():
  size = 1000
  spikes = np.array([7, 100, 333, 512, 999])
  x = 0.01 * jax.random.normal(jax.random.PRNGKey(4), (size,))
  x = x.at[spikes].set(jnp.array([10.0, -8.0, 6.0, -12.0, 9.0]))
  # Width 512: a non-spike element whose median estimate is a spike's needs collisions with
  # spikes in 3 of the 5 rows, about 10 (5/512)^3 per element, so < 1% of keys fail.
  compressor = count_sketch(512, 5, heavy=5 / size)
  state = compressor.init((size,), jnp.float32)
  encode = jax.jit(lambda x: compressor.encode(x, state, None)[0])
  payload = encode(x)
  recovered = compressor.decode(payload, (size,))
  np.testing.assert_array_equal(np.nonzero(np.asarray(recovered))[0], spikes)
  np.testing.assert_allclose(recovered[spikes], x[spikes], atol=0.1)
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), payload, encode(jnp.flip(x)))
  chex.assert_trees_all_close(sum_payloads(stacked), encode(x + jnp.flip(x)), atol=1e-5)
  single_row = count_sketch(32, 1)
  state = single_row.init((size,), jnp.float32)
  first, second = single_row.encode(x, state, None)[0], single_row.encode(2 * x, state, None)[0]
  both = sum_payloads(jax.tree.map(lambda a, b: jnp.stack([a, b]), first, second))
  np.testing.assert_allclose(single_row.decode(both, (size,)),
                             single_row.decode(first, (size,)) + single_row.decode(second, (size,)),
                             atol=1e-5)


@pytest.mark.parametrize("size,width,depth,seed", [(1000, 64, 3, 0), (2501, 7, 1, 1),
                                                   (300, 512, 5, 2), (1200, 100, 33, 3),
                                                   (700, 50, 64, 4), (20000, 512, 5, 5),
                                                   (9000, 600, 8, 6), (5000, 512, 2, 7)])
def test_count_sketch_adds_each_block_rotated_with_signs(size, width, depth, seed):
  """Table and estimates against a dense reference of the documented hashes: element
  ``b width + p`` goes to bucket ``(p + shifts[j, b]) mod width`` of row ``j`` with the sign of
  bit ``j % 32`` of word ``j // 32``, and decodes to the median of its rows' signed buckets."""
  compressor = count_sketch(width, depth, seed=seed)
  x = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
  payload, _ = compressor.encode(jnp.asarray(x), compressor.init((size,), jnp.float32), None)
  blocks = -(-size // width)
  hashes = sketch_hashes(payload.key, 0, blocks, blocks, width, depth)
  element = np.arange(size)
  block, position = element // width, element % width
  table, estimates = np.zeros((depth, width)), np.zeros((depth, size))
  for row in range(depth):
    word = np.asarray(hashes.signs[row // 32]).reshape(-1)[:size]
    signs = np.where((word >> (row % 32)) & 1 == 1, 1.0, -1.0)
    buckets = (position + np.asarray(hashes.shifts[row])[block]) % width
    np.add.at(table[row], buckets, signs * x)
    estimates[row] = signs * np.asarray(payload.table[row], np.float64)[buckets]
  np.testing.assert_allclose(payload.table, table, rtol=1e-5, atol=1e-4)
  # Signs of rows 32 on come from a second word; medians of more than 32 rows are sorted (a
  # 528-step network for 33 rows ran out of memory compiling).
  np.testing.assert_allclose(compressor.decode(payload, (size,)), np.median(estimates, axis=0),
                             rtol=1e-5, atol=1e-5)
  if size <= width:  # one block: no collisions, an exact round trip
    np.testing.assert_allclose(compressor.decode(payload, (size,)), x, rtol=1e-6)


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@example(size=40000, heavy=0.01, levels=40, seed=1)  # largest_k's sampled path (>= 2^15)
@given(size=st.integers(1, 600), heavy=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
       levels=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_count_sketch_heavy_hitters_are_the_largest_estimates_ties_to_lower_positions(
    size, heavy, levels, seed):
  """With ``heavy``, the decode keeps exactly ``max(1, floor(heavy d))`` estimates: the
  largest magnitudes, ties to the lower position (as ``jax.lax.top_k``), the rest 0. One block
  (``d <= width``) decodes exactly, so the estimates are the input, here with many ties."""
  compressor = count_sketch(1 << 16, 3, heavy=heavy, seed=seed)
  x = np.random.default_rng(seed).integers(-levels, levels + 1, size).astype(np.float32)
  payload, _ = compressor.encode(jnp.asarray(x), compressor.init((size,), jnp.float32), None)
  kept = max(1, int(np.floor(heavy * size)))
  order = np.argsort(-np.abs(x), kind="stable")[:kept]
  expected = np.zeros(size, np.float32)
  expected[order] = x[order]
  np.testing.assert_array_equal(jax.jit(compressor.decode, static_argnums=1)(payload, (size,)),
                                expected)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(depth=st.sampled_from([1, 2, 5, 8, 31, 32, 33, 34, 64]), n=st.integers(1, 40),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_median_of_rows_network_and_sort_equal_numpy(depth, n, ties, seed):
  """The sorting network (up to ``NETWORK_DEPTH`` rows) and the sort (deeper) both return
  numpy's median exactly, ties included."""
  rows = np.random.default_rng(seed).standard_normal((depth, n)).astype(np.float32)
  if ties:
    rows = np.round(rows)
  got = jax.jit(median_of_rows)(jnp.asarray(rows))
  np.testing.assert_array_equal(got, np.median(rows, axis=0).astype(np.float32))


def test_count_sketch_draws_new_hashes_each_step_and_one_row_is_unbiased_over_steps():
  size, width, steps = 512, 64, 400
  x = jax.random.normal(jax.random.PRNGKey(5), (size,))
  compressor = count_sketch(width, 1)

  def step(state, _):
    payload, state = compressor.encode(x, state, None)
    return state, (payload.key, compressor.decode(payload, (size,)))

  _, (keys, estimates) = jax.jit(lambda s: jax.lax.scan(step, s, None, length=steps))(
      compressor.init((size,), jnp.float32))
  assert len({tuple(np.asarray(k)) for k in keys}) == steps
  # Each step's estimate has variance up to ||x||^2 / width per element: the mean of `steps`
  # independent draws is within 5 standard errors of x.
  bound = 5 * float(jnp.linalg.norm(x)) / np.sqrt(width * steps)
  assert float(jnp.max(jnp.abs(jnp.mean(estimates, 0) - x))) < bound


def test_shared_quantize_sums_in_int8_exactly_and_is_unbiased():
  compressor = shared_quantize()
  inputs = jnp.stack([X, jnp.flip(X), 3.0 * X, -X])
  keys = jax.random.split(jax.random.PRNGKey(0), 4)

  @_over_devices
  def device(x, key):
    payload, _ = compressor.encode(x, (), key)
    return payload, psum_payload(payload, "devices"), compressor.decode(payload, X.shape)

  payloads, psummed, decoded = jax.jit(jax.vmap(device, axis_name="devices"))(inputs, keys)
  assert payload_nbytes(jax.tree.map(lambda leaf: leaf[0], payloads)) == SIZE + 4
  assert compressor.wire_bytes(X.shape, jnp.float32) == SIZE + 4
  np.testing.assert_allclose(payloads.scale, 3.0 * float(jnp.max(jnp.abs(X))), rtol=1e-6)
  assert int(jnp.max(jnp.abs(payloads.codes.astype(jnp.int32)))) <= 127 // 4
  summed = sum_payloads(payloads)
  assert summed.codes.dtype == jnp.int8 and psummed.codes.dtype == jnp.int8
  chex.assert_trees_all_equal(jax.tree.map(lambda leaf: leaf[2], psummed), summed)
  with combining(AxisContext(size=4)):  # decoded on the grid of the 4 devices that encoded
    total = compressor.decode(summed, X.shape)
  np.testing.assert_allclose(total, decoded.sum(0), rtol=1e-6, atol=1e-6)
  single = jax.vmap(lambda key: jax.vmap(device, axis_name="devices")(X[None], key[None])[2][0])
  many = np.asarray(jax.jit(single)(jax.random.split(jax.random.PRNGKey(1), SAMPLES)))
  step = float(jnp.max(jnp.abs(X))) / 127  # one device: q = 127
  # Per element the rounding has standard deviation at most step / 2 (a skewed Bernoulli when
  # x sits near a grid point, so the bound, not the sample std, sets the tolerance).
  np.testing.assert_array_less(np.abs(many.mean(0) - np.asarray(X)),
                               5 * (step / 2) / math.sqrt(SAMPLES))
  assert np.mean(np.sum((many - np.asarray(X)) ** 2, axis=1)) <= SIZE * step**2 / 4


def test_shared_quantize_nonfinite_on_one_device_is_kept_out_of_every_residual():
  wrapped = error_feedback(shared_quantize())
  state = wrapped.init(X.shape, X.dtype)
  inputs = jnp.stack([X, X.at[0].set(jnp.nan)])
  _, states = jax.vmap(_over_devices(wrapped.encode), in_axes=(0, None, None),
                       axis_name="devices")(inputs, state, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(states.residual, 0.0)
  with pytest.raises(ValueError, match="at most 127 devices; the axis has 128"):
    with combining(AxisContext(size=128)):
      shared_quantize().encode(X, (), jax.random.PRNGKey(0))
  with pytest.raises(TypeError, match="stochastic"):
    shared_quantize(stochastic=1)


def test_error_feedback_around_a_linear_compressor_sums_the_corrected_inputs():
  wrapped = error_feedback(randomk(0.25))
  assert wrapped.linear and not wrapped.unbiased
  assert not error_feedback(topk(0.25)).linear
  state = wrapped.init(X.shape, X.dtype)
  residuals = jnp.stack([0.1 * X, -0.2 * jnp.flip(X)])
  inputs = jnp.stack([X, 2.0 * X])
  states = jax.vmap(lambda r: state._replace(residual=r))(residuals)
  payloads, _ = jax.vmap(wrapped.encode, in_axes=(0, 0, None))(inputs, states,
                                                                jax.random.PRNGKey(0))
  summed = wrapped.decode(sum_payloads(payloads), X.shape)
  direct, _ = randomk(0.25).encode((inputs + residuals).sum(0), state.inner, None)
  np.testing.assert_allclose(summed, randomk(0.25).decode(direct, X.shape), rtol=1e-5,
                             atol=1e-6)


def test_pack_unpack_round_trips_every_width_and_odd_count():
  rng = np.random.default_rng(3)
  cases = {(bits, count): rng.integers(0, 2**bits, count).astype(np.uint8)
           for bits in range(1, 9) for count in (1, 7, 13)}

  @jax.jit
  def round_trip(cases):
    return {case: (pack_bits(codes, case[0]), unpack_bits(pack_bits(codes, case[0]), *case))
            for case, codes in cases.items()}

  for (bits, count), (packed, unpacked) in round_trip(cases).items():
    assert packed.dtype == jnp.uint8 and packed.shape == (packed_nbytes(count, bits),)
    np.testing.assert_array_equal(unpacked, cases[bits, count])
  # Earlier codes take the lower bits of a byte.
  np.testing.assert_array_equal(pack_bits(jnp.array([1, 0, 0, 0, 0, 0, 0, 1]), 1), [0x81])
  np.testing.assert_array_equal(pack_bits(jnp.array([3, 0, 1]), 2), [0b010011])


def test_composed_errors_add_over_disjoint_supports():
  compressor = compose(topk(0.25), quantize(4, stochastic=False))
  payload, _ = compressor.encode(X, compressor.init(X.shape, X.dtype), jax.random.PRNGKey(0))
  sparse, _ = topk(0.25).encode(X, (), None)
  quantizer = quantize(4, stochastic=False)
  values = quantizer.decode(quantizer.encode(sparse.values, (), None)[0], sparse.values.shape)
  expected = _sq(topk(0.25).decode(sparse, X.shape) - X) + _sq(values - sparse.values)
  np.testing.assert_allclose(_sq(compressor.decode(payload, X.shape) - X), expected, rtol=1e-5)
