"""Core compressors (identity, top-k, sign, k-bit) and error feedback: exact properties."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxcomm
from jaxcomm._src.compress.base import decode_and_sum, sum_stacked
from jaxcomm.compress import pack_bits, packed_nbytes, unpack_bits

CORE = {
    "identity": jaxcomm.identity(),
    "topk": jaxcomm.topk(0.05),
    "topk_bf16": jaxcomm.topk(k=7, value_dtype=jnp.bfloat16),
    "sign": jaxcomm.sign(),
    "sign_chunked": jaxcomm.sign(chunk=16),
    "int8": jaxcomm.quantize(8),
    "int8_nearest_chunked": jaxcomm.quantize(8, stochastic=False, chunk=32),
}


def _roundtrip(compressor, x, seed=0):
  state = compressor.init(x.shape, x.dtype)
  payload, _ = jax.jit(compressor.encode)(x, state, jax.random.PRNGKey(seed))
  return payload, compressor.decode(payload, x.shape)


def test_wire_bytes_formulas():
  shape = (1000,)
  assert jaxcomm.identity().wire_bytes(shape, jnp.float32) == 4000
  assert jaxcomm.topk(0.01).wire_bytes(shape, jnp.float32) == 10 * 8
  assert jaxcomm.topk(0.01, value_dtype=jnp.bfloat16).wire_bytes(shape, jnp.float32) == 10 * 6
  assert jaxcomm.topk(0.0001).wire_bytes(shape, jnp.float32) == 8  # k = max(1, floor(0.1))
  assert jaxcomm.sign().wire_bytes(shape, jnp.float32) == 125 + 4
  assert jaxcomm.sign(chunk=300).wire_bytes(shape, jnp.float32) == 125 + 4 * 4
  assert jaxcomm.quantize(8).wire_bytes(shape, jnp.float32) == 1000 + 4
  assert jaxcomm.quantize(3).wire_bytes(shape, jnp.float32) == 375 + 4


def test_topk_keeps_exactly_k_largest_and_is_a_contraction():
  x = jax.random.normal(jax.random.PRNGKey(2), (500,))
  compressor = jaxcomm.topk(0.1)
  payload, decoded = _roundtrip(compressor, x)
  assert payload.indices.shape == (50,)
  kept = np.sort(np.abs(np.asarray(x)))[-50:]
  np.testing.assert_allclose(np.sort(np.abs(np.asarray(payload.values))), kept)
  error = float(jnp.sum((decoded - x) ** 2))
  assert error <= (1 - 50 / 500) * float(jnp.sum(x**2)) + 1e-6


def test_topk_ties_go_to_the_lower_index():
  payload, _ = _roundtrip(jaxcomm.topk(k=3), jnp.ones(10))
  np.testing.assert_array_equal(np.sort(np.asarray(payload.indices)), [0, 1, 2])


def test_sign_error_identity_and_zero_goes_to_plus():
  x = jnp.array([0.0, -2.0, 1.0, 0.0, 3.0, -1.0, 0.5])
  _, decoded = _roundtrip(jaxcomm.sign(), x)
  scale = float(jnp.mean(jnp.abs(x)))
  np.testing.assert_allclose(decoded, np.where(np.asarray(x) >= 0, scale, -scale), rtol=1e-6)
  error = float(jnp.sum((decoded - x) ** 2))
  expected = float(jnp.sum(x**2) - jnp.sum(jnp.abs(x)) ** 2 / x.size)
  np.testing.assert_allclose(error, expected, rtol=1e-5)


def test_all_zero_input_gives_zeros_not_nan():
  for compressor in CORE.values():
    _, decoded = _roundtrip(compressor, jnp.zeros(9))
    chex.assert_trees_all_close(decoded, jnp.zeros(9))


def test_stochastic_quantization_is_unbiased():
  x = jax.random.normal(jax.random.PRNGKey(3), (64,))
  compressor = jaxcomm.quantize(2)  # 3 levels: large rounding noise, so bias would show
  encode = jax.jit(jax.vmap(lambda key: compressor.decode(
      compressor.encode(x, (), key)[0], x.shape)))
  samples = encode(jax.random.split(jax.random.PRNGKey(4), 20000))
  mean = jnp.mean(samples, axis=0)
  step = 2 * float(jnp.max(jnp.abs(x))) / 2
  # Each element's rounding noise has standard deviation <= step / 2.
  tolerance = 5 * (step / 2) / np.sqrt(20000)
  chex.assert_trees_all_close(mean, x, atol=tolerance)
  assert float(jnp.max(jnp.abs(samples[0] - x))) > 0.1  # really stochastic


def test_nearest_quantization_error_is_at_most_half_a_step():
  x = jax.random.normal(jax.random.PRNGKey(5), (333,))
  _, decoded = _roundtrip(jaxcomm.quantize(8, stochastic=False), x)
  step = 2 * float(jnp.max(jnp.abs(x))) / 254
  assert float(jnp.max(jnp.abs(decoded - x))) <= step / 2 * (1 + 1e-4)


@pytest.mark.parametrize("bound", [None, 3.0])
@pytest.mark.parametrize("make", [lambda: jaxcomm.topk(0.5), lambda: jaxcomm.topk(0.25),
                                  jaxcomm.sign])
def test_error_feedback_never_stores_non_finite_values(make, bound):
  # The bad entry sent or not (top-1 of 4 sends only the 4.0 unless the bad one is larger).
  compressor = jaxcomm.error_feedback(make(), bound=bound)
  encode = jax.jit(compressor.encode)
  state = compressor.init((4,), jnp.float32)
  _, state = encode(jnp.array([1.0, 2.0, 3.0, 4.0]), state, jax.random.PRNGKey(0))
  before = state.residual
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    for position in (1, 3):
      x = jnp.array([1.0, 2.0, 3.0, 4.0]).at[position].set(bad)
      _, state = encode(x, state, jax.random.PRNGKey(0))
      chex.assert_tree_all_finite(state.residual)
      chex.assert_trees_all_equal(state.residual, before)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), bound=st.sampled_from([0.5, 3.0, 1e6]),
       shrink=st.sampled_from([1.0, 0.1, 0.0]))
def test_bounded_error_feedback_scales_the_classic_residual_down_to_its_bound(seed, bound,
                                                                              shrink):
  """One step from a large residual with an input shrunk by ``shrink``: the bounded residual is
  the classic one times ``s = min(1, bound ||x|| / ||classic||)``, the payload is the same."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  residual = 5 * jax.random.t(keys[0], 2.0, (64,))
  x = shrink * jax.random.normal(keys[1], (64,))
  classic, bounded = jaxcomm.error_feedback(jaxcomm.topk(0.05)), jaxcomm.error_feedback(
      jaxcomm.topk(0.05), bound=bound)
  state = jaxcomm.compress.ErrorFeedbackState(residual, ())
  sent, plain = classic.encode(x, state, keys[0])
  sent_bounded, capped = bounded.encode(x, state, keys[0])
  chex.assert_trees_all_equal(sent, sent_bounded)
  limit = bound * float(jnp.linalg.norm(x))
  norm = float(jnp.linalg.norm(plain.residual))
  scale = min(1.0, limit / norm)
  chex.assert_trees_all_close(capped.residual, scale * plain.residual, rtol=1e-5, atol=1e-30)
  assert float(jnp.linalg.norm(capped.residual)) <= limit * (1 + 1e-5)


@pytest.mark.parametrize("devices,size,kept,chunk", [(1, 37, 5, None), (3, 300, 30, None),
                                                     (2, 300, 3, 7), (4, 130, 20, 64)])
def test_topk_decode_sum_equals_the_sum_of_dense_decodes(devices, size, kept, chunk):
  """Payloads of distinct positions and integer values: every order of addition is exact, so
  the scatter-add must equal the sum of the dense decodings for any number of devices; error
  feedback keeps the fast path."""
  rng = np.random.default_rng(size)
  compressor = jaxcomm.topk(0.5, chunk=chunk)
  if chunk is None:
    kept = min(kept, size)
    indices = np.stack([rng.permutation(size)[:kept] for _ in range(devices)]).astype(np.int32)
    payloads = jaxcomm.compress.TopKPayload(
        jnp.asarray(rng.integers(-1000, 1000, (devices, kept)), jnp.float32), indices)
  else:  # the last chunk is padded: positions past `size` must be dropped
    width = min(chunk, size)
    count, kept = -(-size // width), min(kept, width)
    indices = np.stack([[rng.permutation(width)[:kept] for _ in range(count)]
                        for _ in range(devices)]).astype(np.uint16)
    payloads = jaxcomm.compress.ChunkedTopKPayload(
        jnp.asarray(rng.integers(-1000, 1000, indices.shape), jnp.float32), indices)
  dense = jax.vmap(lambda payload: compressor.decode(payload, (size,)))(payloads)
  assert jaxcomm.error_feedback(compressor).decode_sum is compressor.decode_sum is not None
  total = decode_and_sum(compressor, payloads, (size,))
  chex.assert_type(total, jnp.float32)
  np.testing.assert_array_equal(total, np.asarray(dense).sum(axis=0))


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk", [None, 16])
def test_sign_decode_sum_equals_the_tree_of_dense_decodes_bit_for_bit(devices, chunk):
  """The pair table adds the same signed scales as sum_stacked adds the decoded rows: equal
  in every bit (signed zeros from zero scales and zero inputs included), any device count;
  error feedback and EF21 keep the fast path."""
  size = 1000
  compressor = jaxcomm.sign(chunk)
  x = jax.random.normal(jax.random.PRNGKey(devices), (devices, size)).at[:, :40].set(0.0)
  payloads = jax.vmap(lambda row: compressor.encode(row, (), None)[0])(x)
  payloads = payloads._replace(scales=payloads.scales.at[0, 0].set(0.0))
  for wrap in (jaxcomm.error_feedback, jaxcomm.compress.estimate_feedback):
    assert wrap(compressor).decode_sum is compressor.decode_sum is not None
  dense = jax.vmap(lambda payload: compressor.decode(payload, (size,)))(payloads)
  signs = np.unpackbits(np.asarray(payloads.bits), axis=1, bitorder="little")[:, :size]
  scales = np.repeat(np.asarray(payloads.scales), chunk or size, axis=1)[:, :size]
  np.testing.assert_array_equal(np.asarray(dense).view(np.uint32),
                                np.where(signs == 1, scales, -scales).view(np.uint32))
  total = jax.jit(lambda p: decode_and_sum(compressor, p, (size,)))(payloads)
  np.testing.assert_array_equal(np.asarray(total).view(np.uint32),
                                np.asarray(sum_stacked(dense)).view(np.uint32))


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", ["qsgd_buckets", "terngrad", "int4_chunked"])
def test_decode_and_sum_equals_the_batched_decodes_bit_for_bit(devices, name):
  """Decoded one payload at a time, the gathered payloads sum to the bits of the batched
  decode (``vmap``) summed by ``sum_stacked``, with a partial last chunk and, for QSGD, the
  norms reaching the decode through a bitcast of bytes, as a gather delivers them."""
  compressor = {"qsgd_buckets": jaxcomm.compress.qsgd(16), "terngrad": jaxcomm.compress.terngrad(),
                "int4_chunked": jaxcomm.quantize(4, chunk=64)}[name]
  size = 1300
  x = jax.random.normal(jax.random.PRNGKey(devices), (devices, size)).at[:, :40].set(0.0)
  keys = jax.random.split(jax.random.PRNGKey(5), devices)
  payloads = jax.vmap(lambda row, key: compressor.encode(row, (), key)[0])(x, keys)
  as_bytes = jax.tree.map(lambda leaf: jax.lax.bitcast_convert_type(leaf, jnp.uint8)
                          if leaf.dtype == jnp.float32 else leaf, payloads)
  from_bytes = lambda p: jax.tree.map(  # noqa: E731
      lambda leaf: jax.lax.bitcast_convert_type(leaf, jnp.float32) if leaf.ndim == 3 else leaf, p)
  batched = jax.jit(lambda p: sum_stacked(jax.vmap(
      lambda payload: compressor.decode(payload, (size,)))(from_bytes(p))))(as_bytes)
  total = jax.jit(lambda p: decode_and_sum(compressor, from_bytes(p), (size,)))(as_bytes)
  np.testing.assert_array_equal(np.asarray(total).view(np.uint32),
                                np.asarray(batched).view(np.uint32))


def _with_special_values(size: int, seed: int) -> jax.Array:
  x = jax.random.normal(jax.random.PRNGKey(seed), (size,))
  return x.at[:6].set(jnp.array([-0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 3e38]))


@pytest.mark.parametrize("value_dtype", [jnp.float32, jnp.bfloat16])
def test_topk_subtract_decoded_is_the_dense_subtraction_bit_for_bit(value_dtype):
  """Infinities, NaN, signed zeros and values rounded to bfloat16, sent or not; error feedback
  keeps the fast path."""
  compressor = jaxcomm.topk(0.05, value_dtype=value_dtype)
  assert jaxcomm.error_feedback(compressor).subtract_decoded is compressor.subtract_decoded
  for seed, x in enumerate((_with_special_values(300, 0), -_with_special_values(300, 1),
                            jax.random.normal(jax.random.PRNGKey(2), (300,)))):
    payload, _ = _roundtrip(compressor, x, seed)
    dense = jax.jit(lambda x, p: x - compressor.decode(p, x.shape))(x, payload)
    fast = jax.jit(compressor.subtract_decoded)(x, payload)
    np.testing.assert_array_equal(fast, dense)
    np.testing.assert_array_equal(np.signbit(fast), np.signbit(dense))


@pytest.mark.parametrize("shared", [True, False])
def test_unscaled_randomk_subtract_decoded_is_the_dense_subtraction_bit_for_bit(shared):
  """Infinities, NaN and signed zeros, sent or not, at a density that sends most of the
  special values on some key; error feedback keeps the fast path."""
  compressor = jaxcomm.randomk(0.5, shared=shared, scale=False, seed=7)
  assert jaxcomm.error_feedback(compressor).subtract_decoded is compressor.subtract_decoded
  for seed in range(4):
    x = (_with_special_values(301, seed) if seed % 2 else
         -_with_special_values(301, seed)).reshape(7, 43)
    payload, _ = _roundtrip(compressor, x, seed)
    dense = jax.jit(lambda x, p: x - compressor.decode(p, x.shape))(x, payload)
    fast = jax.jit(compressor.subtract_decoded)(x, payload)
    np.testing.assert_array_equal(fast, dense)
    np.testing.assert_array_equal(np.signbit(fast), np.signbit(dense))


def test_scaled_randomk_keeps_the_dense_subtraction():
  # x - v * (d / k) in one fused kernel rounds once (an FMA), the dense path twice.
  assert jaxcomm.randomk(0.5).subtract_decoded is None


@pytest.mark.parametrize("make", [lambda: jaxcomm.topk(0.05), jaxcomm.sign])
def test_bounded_error_feedback_equals_the_dense_formula_bit_for_bit(make):
  """The residual against ``corrected - decode(payload)``, capped and then checked, as
  error feedback computed it before its fast paths; with non-finite inputs and a large
  residual (the cap active)."""
  inner, bound = make(), 3.0
  compressor = jaxcomm.error_feedback(inner, bound=bound)

  def reference(x, state, key):
    corrected = x + state.residual
    payload, _ = inner.encode(corrected, (), key)
    unsent = corrected - inner.decode(payload, x.shape)
    norm = jnp.linalg.norm(unsent)
    limit = bound * jnp.linalg.norm(x)
    unsent = unsent * jnp.minimum(1.0, limit / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
    bad = jnp.isnan(jnp.sum(unsent * 0.0))
    return payload, jnp.where(bad, state.residual, unsent)

  residual = 5 * jax.random.t(jax.random.PRNGKey(7), 2.0, (300,))
  state = jaxcomm.compress.ErrorFeedbackState(residual, ())
  key = jax.random.PRNGKey(0)
  for x in (0.1 * jax.random.normal(key, (300,)), _with_special_values(300, 3),
            jnp.zeros(300), jnp.full(300, 1e30)):
    sent, expected = jax.jit(reference)(x, state, key)
    payload, new_state = jax.jit(compressor.encode)(x, state, key)
    if jax.default_backend() == "cpu":
      chex.assert_trees_all_equal(payload, sent)
      np.testing.assert_array_equal(new_state.residual, expected)
    else:
      # XLA's GPU compiler fuses each program in its own way: a reduction (sign's scale) may
      # sum in another order, and a product and a difference may contract into one fused
      # multiply-add, so floats agree to within ulps of the operands' magnitude; the selected
      # indices and packed bits exactly.
      for got, want in zip(jax.tree.leaves(payload), jax.tree.leaves(sent)):
        if jnp.issubdtype(got.dtype, jnp.floating):
          np.testing.assert_allclose(got, want, rtol=4 * np.finfo(np.float32).eps)
        else:
          np.testing.assert_array_equal(got, want)
      finite = jnp.where(jnp.isfinite(x + residual), jnp.abs(x + residual), 0.0)
      atol = 4 * np.finfo(np.float32).eps * float(jnp.max(finite))
      np.testing.assert_allclose(new_state.residual, expected, rtol=0, atol=atol)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 40), integer=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sum_stacked_equals_the_sum_over_the_leading_axis(rows, width, integer, seed):
  rng = np.random.default_rng(seed)
  stacked = (rng.integers(-2**20, 2**20, (rows, width, 3)).astype(np.int32) if integer
             else rng.standard_normal((rows, width, 3)).astype(np.float32))
  total = sum_stacked(jnp.asarray(stacked))
  chex.assert_shape(total, (width, 3))
  assert total.dtype == stacked.dtype
  if integer:
    np.testing.assert_array_equal(total, stacked.sum(axis=0))
  else:
    np.testing.assert_allclose(total, stacked.astype(np.float64).sum(axis=0), rtol=1e-5,
                               atol=1e-5 * rows)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 61])
def test_bit_packing_is_exact(bits, count):
  codes = np.random.default_rng(bits * 100 + count).integers(0, 2**bits, count).astype(np.uint8)
  packed = pack_bits(jnp.asarray(codes), bits)
  chex.assert_shape(packed, (packed_nbytes(count, bits),))
  assert packed.dtype == jnp.uint8
  np.testing.assert_array_equal(unpack_bits(packed, bits, count), codes)


def test_sign_packs_eight_signs_per_byte_little_endian():
  payload, _ = _roundtrip(jaxcomm.sign(), jnp.array([1.0, -1, -1, -1, -1, -1, -1, 1, 1]))
  np.testing.assert_array_equal(payload.bits, [0b10000001, 0b00000001])


def test_compressors_work_under_vmap():
  x = jax.random.normal(jax.random.PRNGKey(6), (3, 40))
  for compressor in CORE.values():
    payloads, _ = jax.vmap(compressor.encode, in_axes=(0, None, None))(
        x, compressor.init((40,), jnp.float32), jax.random.PRNGKey(0))
    decoded = jax.vmap(lambda p: compressor.decode(p, (40,)))(payloads)
    chex.assert_shape(decoded, (3, 40))


@pytest.mark.parametrize("factory, match", [
    (lambda: jaxcomm.topk(0.0), "density"),
    (lambda: jaxcomm.topk(-0.5), "density"),
    (lambda: jaxcomm.topk(1.5), "density"),
    (lambda: jaxcomm.topk(), "exactly one"),
    (lambda: jaxcomm.topk(k=0), "k must be"),
    (lambda: jaxcomm.topk(0.1, value_dtype=jnp.int8), "value_dtype"),
    (lambda: jaxcomm.quantize(0), "bits"),
    (lambda: jaxcomm.quantize(9), "bits"),
    (lambda: jaxcomm.quantize(8, chunk=0), "chunk"),
    (lambda: jaxcomm.sign(chunk=-1), "chunk"),
    (lambda: jaxcomm.error_feedback("topk"), "compressor"),
    (lambda: jaxcomm.error_feedback(jaxcomm.topk(0.1), bound=0.0), "bound"),
    (lambda: jaxcomm.error_feedback(jaxcomm.topk(0.1), bound="3"), "bound"),
])
def test_bad_configuration_raises_at_construction(factory, match):
  with pytest.raises((ValueError, TypeError), match=match):
    factory()


def test_integer_gradients_are_rejected():
  compressor = jaxcomm.error_feedback(jaxcomm.topk(0.5))
  with pytest.raises(TypeError, match="x must be a float32"):
    compressor.encode(jnp.arange(4), compressor.init((4,), jnp.int32), jax.random.PRNGKey(0))


@pytest.mark.parametrize("make", [jaxcomm.topk, jaxcomm.randomk])
def test_the_former_density_keyword_warns_naming_the_new_one(make):
  with pytest.warns(DeprecationWarning, match="fraction= is deprecated: use density="):
    assert make(fraction=0.25).name == make(0.25).name
  with pytest.raises(TypeError, match="fraction was renamed density: pass density only"):
    make(0.25, fraction=0.25)


def test_selective_former_topk_keyword_warns_and_is_checked_as_the_new_one():
  with pytest.warns(DeprecationWarning, match="topk_fraction= is deprecated: use topk_density="):
    jaxcomm.compress.selective(0.1, 0.5, topk_fraction=0.1)
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="topk_density"):
    jaxcomm.compress.selective(0.1, 0.5, topk_fraction=0.0)
