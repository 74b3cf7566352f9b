"""GradZip sketching: wire bytes, linearity, the projection identity, unbiasedness, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm.compress import payload_nbytes, sum_payloads
from jaxcomm._src.compress.gradzip import GradZipState, gradzip, random_basis


def _encode(compressor, x, state=None):
  state = compressor.init(x.shape, jnp.float32) if state is None else state
  return compressor.encode(x, state, None)


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 24), n=st.integers(1, 24), rank=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_wire_bytes_formula_is_the_payload_and_shorter_side_is_projected(m, n, rank, seed):
  compressor = gradzip(rank, seed=seed)
  # matrix view (out=m, rest=n); numpy's draws (jax.random.normal compiles for each shape)
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((n, m)), jnp.float32)

  def encode_decode(x):  # one compilation an example, not one per operation
    payload, _ = _encode(compressor, x)
    return payload, compressor.decode(payload, x.shape)

  payload, decoded = jax.jit(encode_decode)(x)
  assert payload_nbytes(payload) == compressor.wire_bytes(x.shape, jnp.float32)
  projected = min(m, n) >= rank and m * n >= 2 * rank * max(m, n)
  assert compressor.wire_bytes(x.shape, jnp.float32) == (
      4 * rank * max(m, n) + 8 if projected else 4 * m * n)
  chex.assert_shape(decoded, x.shape)


def test_decode_is_the_orthogonal_projection_and_full_rank_is_exact():
  x = jax.random.normal(jax.random.PRNGKey(0), (30, 12))  # matrix view 12 x 30
  compressor = gradzip(3)
  decoded = compressor.decode(_encode(compressor, x)[0], x.shape)
  # ||M - M Pi||^2 = ||M||^2 - ||M Pi||^2 for an orthogonal projection Pi.
  np.testing.assert_allclose(jnp.sum((x - decoded) ** 2),
                             jnp.sum(x ** 2) - jnp.sum(decoded ** 2), rtol=1e-4)
  full = gradzip(12, min_compression_rate=1.0)
  np.testing.assert_allclose(full.decode(_encode(full, x)[0], x.shape), x, atol=1e-4)


def test_payloads_are_linear_with_the_shared_key():
  compressor = gradzip(2, seed=7)
  a, b = (jax.random.normal(jax.random.PRNGKey(i), (16, 10)) for i in range(2))
  pa, next_a = _encode(compressor, a)
  pb, next_b = _encode(compressor, b)
  chex.assert_trees_all_equal(next_a, next_b)  # every device draws the same next basis
  summed = sum_payloads(jax.tree.map(lambda u, v: jnp.stack([u, v]), pa, pb))
  pab, _ = _encode(compressor, a + b)
  chex.assert_trees_all_close(summed, pab, atol=1e-5)
  np.testing.assert_allclose(compressor.decode(summed, a.shape),
                             compressor.decode(pa, a.shape) + compressor.decode(pb, a.shape),
                             atol=1e-5)


def test_scaled_is_unbiased_and_unscaled_contracts_by_rank_over_short_side():
  x = jax.random.normal(jax.random.PRNGKey(3), (8, 6))  # matrix view 6 x 8: short side 6
  draws = 3000
  keys = jax.random.split(jax.random.PRNGKey(4), draws)

  def decoded(compressor):
    run = lambda key: compressor.decode(compressor.encode(x, GradZipState(key), None)[0],
                                        x.shape)
    return jax.vmap(run)(keys)

  scaled = decoded(gradzip(2, min_compression_rate=1.0, scale=True))
  norm = float(jnp.linalg.norm(x))
  # std of the mean of one entry <= sqrt((s/r - 1) / draws) ||x|| ~= 0.026 ||x||
  assert float(jnp.max(jnp.abs(scaled.mean(0) - x))) < 0.1 * norm
  plain = decoded(gradzip(2, min_compression_rate=1.0))
  contraction = float(jnp.mean(jnp.sum((plain - x) ** 2, axis=(1, 2)))) / norm ** 2
  assert abs(contraction - (1 - 2 / 6)) < 0.03


def test_same_key_same_basis_and_the_basis_is_orthonormal():
  key = jax.random.PRNGKey(5)
  basis = random_basis(key, 9, 4)
  np.testing.assert_allclose(basis.T @ basis, np.eye(4), atol=1e-5)
  np.testing.assert_array_equal(basis, random_basis(key, 9, 4))


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank must be >= 1, got 0"),
    (dict(rank=2.5), "rank must be an int, got 2.5"),
    (dict(min_compression_rate=0.0), "min_compression_rate must be a finite float > 0"),
    (dict(scale=1), "scale must be a bool, got 1"),
    (dict(seed=1.5), "seed must be an int seed, a jax.random.key"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    gradzip(**kwargs)
