"""PowerSGD steps and fallback, majority vote, and construction-time validation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gram_schmidt_reference import gram_schmidt_float64
from jaxcomm.compress import (adaptive_threshold, back_project, cast, compose, count_sketch,
                              majority_vote, orthogonalize, powersgd, project, qsgd, quantize,
                              randomk, sign_vote, terngrad, threshold, topk)
from jaxcomm._src.compress.powersgd import from_matrix, initial_q, to_matrix


def test_orthogonalize_gives_orthonormal_columns_and_survives_rank_deficiency():
  p = jax.random.normal(jax.random.PRNGKey(0), (9, 3))
  q = orthogonalize(p)
  np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-5)
  deficient = orthogonalize(jnp.stack([p[:, 0], p[:, 0], jnp.zeros(9)], axis=1))
  chex.assert_tree_all_finite(deficient)
  np.testing.assert_allclose(deficient[:, 0], q[:, 0], atol=1e-6)
  np.testing.assert_array_equal(deficient[:, 2], 0.0)
  assert np.all(np.linalg.norm(deficient, axis=0) <= 1.0 + 1e-6)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), rank=st.integers(1, 4), seed=st.integers(0, 2**16),
                  batch=st.integers(1, 3))
# cond 1,044: orthogonal to 1.6e-5, beyond a fixed 1e-5 (the former form's result too).
@example(m=3, rank=3, seed=32540, batch=1)
def test_orthogonalize_is_gram_schmidt_up_to_rounding(m, rank, seed, batch):
  """Batched columns against Gram-Schmidt's in float64 (a random matrix with at least as many
  rows as columns), and each matrix of a batch as alone. With fewer rows than
  columns, the columns past the ``m``-th are rounding noise scaled to norm at most 1, which a
  batched and a single product need not round alike (on GPUs they do not): only the first ``m``
  are compared there."""
  p = jax.random.normal(jax.random.PRNGKey(seed), (batch, m, rank))
  q = np.asarray(orthogonalize(p))
  assert q.shape == (batch, m, rank)
  independent = min(m, rank)
  for index in range(batch):
    alone = np.asarray(orthogonalize(p[index]))
    np.testing.assert_allclose(q[index][:, :independent], alone[:, :independent], atol=1e-6)
    if m >= rank:
      # Gram-Schmidt's error and its loss of orthogonality grow with the condition number
      # (about cond * eps for the modified form); a random square matrix can have cond ~ 1,000.
      cond = np.linalg.cond(np.asarray(p[index]))
      np.testing.assert_allclose(q[index], gram_schmidt_float64(np.asarray(p[index])),
                                 atol=max(2e-4, 16 * cond * np.finfo(np.float32).eps))
      np.testing.assert_allclose(q[index].T @ q[index], np.eye(rank),
                                 atol=max(1e-5, 4 * cond * np.finfo(np.float32).eps))
    assert np.all(np.linalg.norm(q[index], axis=0) <= 1.0 + 1e-6)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [(0, 0), (4, 1), (8, 2), (3, 2)])
def test_orthogonalize_propagates_non_finite_entries(value, position):
  """A NaN or Inf anywhere in ``p`` leaves one in the result, and so in ``M^T P`` for any
  finite ``M``: the collective's check of the approximation relies on it."""
  p = jax.random.normal(jax.random.PRNGKey(1), (9, 3)).at[position].set(value)
  result = orthogonalize(p)
  assert not np.all(np.isfinite(np.asarray(result)))
  assert not np.all(np.isfinite(np.asarray(jnp.ones((5, 9)) @ result)))


@settings(max_examples=12, deadline=None)
@given(blocks=st.integers(2, 5), extra=st.sampled_from([0, 0, 37]), m=st.integers(1, 70),
       rank=st.integers(1, 4), batch=st.sampled_from([(), (2,)]), seed=st.integers(0, 2**16))
def test_projection_of_many_rows_equals_the_float64_product(blocks, extra, m, rank, batch, seed):
  """``project_rows`` at ``n`` multiples of 256 (summed over blocks of 256 rows until session
  20) and others, against float64, and against the plain float32 product up to rounding."""
  from jaxcomm._src.compress.powersgd import project_rows
  n = blocks * 256 + extra
  # Normal inputs from numpy, and the projection and the plain product in one compilation: each
  # example's new shapes cost one compilation instead of four (two of jax.random.normal).
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal(batch + (n, m)).astype(np.float32)
  q = rng.standard_normal(batch + (n, rank)).astype(np.float32)
  expected = np.einsum("...ko,...kr->...or", np.asarray(rows, np.float64),
                       np.asarray(q, np.float64))
  got, plain = (np.asarray(result) for result in jax.jit(lambda rows, q: (
      project_rows(rows, q), jnp.einsum("...ko,...kr->...or", rows, q, precision="highest")))(
          rows, q))
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(got, plain, rtol=1e-4, atol=1e-3)


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from([(512, 256), (3, 3, 64, 32), (700, 30), (8, 16), (20,), (4, 4)]),
       rank=st.integers(1, 4), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 2**16))
def test_powersgd_subtract_decoded_is_x_minus_decode_bit_for_bit(shape, rank, dtype, seed):
  """The fused ``x - P Q^T`` of error feedback equals ``x - decode(payload)`` exactly, and the
  decode equals the factors' product up to rounding."""
  compressor = powersgd(rank)
  x = jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype).astype(jnp.float32)
  payload, _ = jax.jit(lambda x, s: compressor.encode(x, s, None))(
      x, compressor.init(shape, jnp.float32))
  fused = jax.jit(compressor.subtract_decoded)(x, payload)
  plain = jax.jit(lambda x, p: x - compressor.decode(p, x.shape))(x, payload)
  np.testing.assert_array_equal(fused, plain)
  if len(shape) >= 2 and compressor.wire_bytes(shape, jnp.float32) < 4 * x.size:
    product = from_matrix(jnp.matmul(payload.p, payload.q.T, precision="highest"), shape)
    np.testing.assert_allclose(compressor.decode(payload, shape), product, rtol=1e-5, atol=1e-5)


def test_conv_kernel_matrix_view_round_trips():
  kernel = jnp.arange(3 * 3 * 4 * 8, dtype=jnp.float32).reshape(3, 3, 4, 8)
  matrix = to_matrix(kernel)
  chex.assert_shape(matrix, (8, 36))
  np.testing.assert_array_equal(matrix[5], kernel[..., 5].reshape(-1))
  np.testing.assert_array_equal(from_matrix(matrix, kernel.shape), kernel)


def test_powersgd_recovers_rank_one_contracts_and_falls_back():
  compressor = powersgd(1)
  u, v = jnp.arange(1.0, 9.0), jnp.linspace(-1.0, 1.0, 12)
  rank_one = jnp.outer(v, u)  # (rest=12, out=8): the matrix view is u v^T
  state = compressor.init(rank_one.shape, jnp.float32)
  payload, state = compressor.encode(rank_one, state, None)
  assert compressor.wire_bytes(rank_one.shape, jnp.float32) == 4 * (8 + 12)
  np.testing.assert_allclose(compressor.decode(payload, rank_one.shape), rank_one, atol=1e-4)
  full = jax.random.normal(jax.random.PRNGKey(1), (12, 8))
  payload, _ = compressor.encode(full, state, None)
  error = jnp.sum(jnp.square(compressor.decode(payload, full.shape) - full))
  assert float(error) <= float(jnp.sum(jnp.square(full))) * (1 + 1e-5)
  small = powersgd(4, min_compression_rate=2.0)
  assert small.init((4, 4), jnp.float32) == () and small.init((7,), jnp.float32) == ()
  dense, _ = small.encode(full[:4, :4], (), None)
  np.testing.assert_array_equal(small.decode(dense, (4, 4)), full[:4, :4])


def test_powersgd_zero_gradient_keeps_the_warm_start():
  compressor = powersgd(2)
  state = compressor.init((20, 12), jnp.float32)
  payload, after = compressor.encode(jnp.zeros((20, 12)), state, None)
  chex.assert_trees_all_equal(after.q, state.q)
  np.testing.assert_array_equal(compressor.decode(payload, (20, 12)), 0.0)
  np.testing.assert_array_equal(state.q, initial_q(jax.random.PRNGKey(0), (20, 12), 2))


def test_powersgd_steps_with_psum_average_over_devices():
  u = jnp.arange(1.0, 7.0)
  grads = jnp.stack([jnp.outer(u, jnp.linspace(0, 1, 10)), jnp.outer(u, jnp.linspace(2, 0, 10))])
  q0 = initial_q(jax.random.PRNGKey(0), (10, 6), 1)  # the (out=6, rest=10) view of a (10, 6) tensor

  def device(matrix):
    p = orthogonalize(jax.lax.pmean(project(matrix, q0), "devices"))
    q = jax.lax.pmean(back_project(matrix, p), "devices")
    return p @ q.T

  out = jax.vmap(device, axis_name="devices")(grads)
  np.testing.assert_allclose(out[0], grads.mean(0), atol=1e-4)
  np.testing.assert_allclose(out[1], out[0])


def test_majority_vote_packs_bits_and_ties_give_zero():
  compressor = sign_vote()
  votes = jnp.array([[1.0, -1.0, 1.0, -2.0, 0.0],
                     [1.0, 1.0, -1.0, -2.0, -3.0],
                     [-1.0, 1.0, -1.0, 5.0, -1.0],
                     [1.0, -1.0, -1.0, -1.0, 2.0]])
  payloads, _ = jax.vmap(compressor.encode, in_axes=(0, None, None))(votes, (), None)
  assert payloads.bits.dtype == jnp.uint8 and payloads.bits.shape == (4, 1)
  np.testing.assert_array_equal(majority_vote(payloads, (5,)), [1.0, 0.0, -1.0, -1.0, 0.0])
  three = jax.tree.map(lambda leaf: leaf[:3], payloads)
  np.testing.assert_array_equal(majority_vote(three, (5,)), [1.0, 1.0, -1.0, -1.0, -1.0])


BAD_CONFIGS = [
    (lambda: qsgd(0), ValueError, "levels"),
    (lambda: qsgd(128), ValueError, "levels"),
    (lambda: qsgd(4, bucket=0), ValueError, "bucket"),
    (lambda: quantize(9), ValueError, "bits"),
    (lambda: quantize(0), ValueError, "bits"),
    (lambda: powersgd(0), ValueError, "rank"),
    (lambda: powersgd(1, epsilon=-1.0), ValueError, "epsilon"),
    (lambda: powersgd(1, min_compression_rate=0.0), ValueError, "min_compression_rate"),
    (lambda: count_sketch(0), ValueError, "width"),
    (lambda: count_sketch(8, 0), ValueError, "depth"),
    (lambda: count_sketch(8, heavy=1.5), ValueError, "heavy"),
    (lambda: randomk(0.0), ValueError, "density"),
    (lambda: randomk(1.5), ValueError, "density"),
    (lambda: randomk(0.1, shared=1), TypeError, "shared"),
    (lambda: topk(0.0), ValueError, "density"),
    (lambda: topk(k=0), ValueError, "k"),
    (lambda: threshold(0.0), ValueError, "value"),
    (lambda: threshold(1.0, capacity=0.0), ValueError, "capacity"),
    (lambda: adaptive_threshold(0.5, capacity=0.1), ValueError, "capacity"),
    (lambda: adaptive_threshold(0.1, sample=2.0), ValueError, "sample"),
    (lambda: cast(jnp.int8), ValueError, "dtype"),
    (lambda: cast(jnp.float16, axis_size=0), ValueError, "axis_size"),
    (lambda: cast(jnp.float8_e4m3fn, axis_size=2, scaled=True), ValueError, "axis_size"),
    (lambda: terngrad(shared_scale=3), TypeError, "shared_scale"),
    (lambda: terngrad(bucket=0), ValueError, "bucket must be >= 1, got 0"),
    (lambda: terngrad(bucket=2.5), TypeError, "bucket must be an int, got 2.5"),
    (lambda: terngrad(bucket=True), TypeError, "bucket"),
    (lambda: terngrad(clip=-1), ValueError, r"clip must be a finite float > 0, got -1"),
    (lambda: terngrad(clip=0.0), ValueError, "clip"),
    (lambda: terngrad(clip=float("inf")), ValueError, "clip"),
    (lambda: terngrad(clip="2.5"), TypeError, "clip must be a float, got '2.5'"),
    (lambda: compose(topk(0.1), "int8"), TypeError, "quantizer"),
]


@pytest.mark.parametrize("make, error, parameter", BAD_CONFIGS)
def test_bad_configuration_names_the_parameter(make, error, parameter):
  with pytest.raises(error, match=parameter):
    make()


def test_compose_rejects_a_sparsifier_without_values():
  with pytest.raises(TypeError, match="values"):
    compose(qsgd(4), quantize(8)).init((8,), jnp.float32)
