"""TernGrad's scalers: per bucket (unbiased, the stated variance bucket by bucket, exact bytes,
partial last buckets, agreed over an axis) and clipped at ``c`` standard deviations (the
default, biased)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compress import payload_nbytes, terngrad
from jaxcomm._src.collectives.strategies import over_axis
from jaxcomm._src.compress.base import combining
from jaxcomm._src.optim.compressed_allreduce import _feedback_for

SAMPLES = 4000
# 13 elements in buckets of 5: a partial last bucket; one outlier in the first bucket.
X = jnp.asarray(np.random.default_rng(3).standard_normal(13), jnp.float32).at[2].set(
    40.0).at[7].set(0.0)


def _decoded(compressor, x, samples=SAMPLES):
  """``samples`` decodes of ``compressor`` on ``x``, one key each (one compilation)."""
  def one(key):
    return compressor.decode(compressor.encode(x, (), key)[0], x.shape)
  return np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(5), samples)),
                    np.float64)


def _bucket_max(x, bucket):
  x = np.abs(np.asarray(x, np.float64))
  return np.array([x[start:start + bucket].max() for start in range(0, x.size, bucket)])


def test_bucketed_scalers_are_each_buckets_max_and_the_codes_ternary():
  compressor = terngrad(bucket=5, clip=None)
  payload, _ = compressor.encode(X, (), jax.random.PRNGKey(0))
  np.testing.assert_array_equal(payload.scaler, _bucket_max(X, 5))
  decoded = np.asarray(compressor.decode(payload, X.shape))
  scale = np.repeat(_bucket_max(X, 5), 5)[:13]
  assert set(np.unique(decoded / scale)) <= {-1.0, 0.0, 1.0}


@pytest.mark.parametrize("bucket", [None, 5, 1])
def test_unbiased_with_the_variance_of_each_bucket(bucket):
  compressor = terngrad(bucket=bucket, clip=None)
  assert compressor.unbiased
  decoded = _decoded(compressor, X)
  x = np.asarray(X, np.float64)
  mean, std = decoded.mean(0), decoded.std(0)
  # Five standard errors per element with fixed seeds: deterministic.
  np.testing.assert_array_less(np.abs(mean - x), 5.0 * std / np.sqrt(SAMPLES) + 1e-6)
  scale = np.repeat(_bucket_max(X, bucket or 13), bucket or 13)[:13]
  variance = np.sum(np.abs(x) * (scale - np.abs(x)))
  measured = np.mean(np.sum((decoded - x) ** 2, axis=1))
  np.testing.assert_allclose(measured, variance, rtol=0.1)


def test_buckets_keep_one_outlier_from_inflating_the_others():
  x = np.asarray(X, np.float64)
  tensor = np.mean(np.sum((_decoded(terngrad(clip=None), X) - x) ** 2, axis=1))
  bucketed = np.mean(np.sum((_decoded(terngrad(bucket=5, clip=None), X) - x) ** 2, axis=1))
  assert bucketed < 0.5 * tensor


@pytest.mark.parametrize("size, bucket", [(1, 512), (13, 5), (1000, 512), (1024, 512),
                                          (1001, None), (7, 1)])
def test_wire_bytes_are_the_payloads_and_the_formula(size, bucket):
  compressor = terngrad(bucket=bucket)
  x = jnp.linspace(-1.0, 1.0, size)
  payload, _ = compressor.encode(x, (), jax.random.PRNGKey(0))
  buckets = 1 if bucket is None else -(-size // bucket)
  assert payload_nbytes(payload) == compressor.wire_bytes((size,), jnp.float32)
  assert payload_nbytes(payload) == -(-size // 4) + 4 * buckets


def test_shared_scale_agrees_on_every_buckets_scaler_under_a_named_axis():
  compressor = terngrad(bucket=5, clip=None, shared_scale=True)
  inputs = jnp.stack([X, -3.0 * X[::-1]])

  def encode(x, key):
    with combining(over_axis("devices")):
      return compressor.encode(x, (), key)[0]

  payloads = jax.vmap(encode, in_axes=(0, None), axis_name="devices")(
      inputs, jax.random.PRNGKey(0))
  agreed = np.maximum(_bucket_max(inputs[0], 5), _bucket_max(inputs[1], 5))
  np.testing.assert_allclose(payloads.scaler, np.stack([agreed, agreed]), rtol=1e-6)
  decoded = jax.vmap(lambda p: compressor.decode(p, X.shape))(payloads)
  scale = np.repeat(agreed, 5)[:13]
  assert set(np.unique(np.asarray(decoded) / scale)) <= {-1.0, 0.0, 1.0}


def test_clip_bounds_the_scaler_at_c_standard_deviations_and_is_biased():
  compressor = terngrad()  # the default: clip=2.5
  assert not compressor.unbiased
  payload, _ = compressor.encode(X, (), jax.random.PRNGKey(0))
  sigma = float(jnp.sqrt(jnp.mean(jnp.square(X))))
  np.testing.assert_allclose(payload.scaler, [2.5 * sigma], rtol=1e-6)
  # The outlier is sent at most at the bound; the unclipped entries stay unbiased.
  decoded = _decoded(compressor, X)
  assert decoded[:, 2].max() <= 2.5 * sigma * (1 + 1e-6)
  inside = np.abs(np.asarray(X)) < 2.5 * sigma
  np.testing.assert_array_less(np.abs(decoded.mean(0) - np.asarray(X))[inside],
                               5.0 * decoded.std(0)[inside] / np.sqrt(SAMPLES) + 1e-6)


def test_clip_keeps_constant_and_one_element_tensors():
  # sigma about zero: a constant tensor is not clipped to zero, as a std about the mean would.
  for x in (jnp.full((6,), -0.5), jnp.array([3.0])):
    decoded = _decoded(terngrad(clip=2.5), x, samples=2000)
    chex.assert_trees_all_close(decoded.mean(0), np.asarray(x), rtol=0.1)


def test_clip_makes_compressed_allreduce_choose_error_feedback():
  assert _feedback_for("auto", terngrad(clip=None)) == "residual"
  assert _feedback_for("auto", terngrad(bucket=512, clip=None)) == "residual"
  assert _feedback_for("auto", terngrad()) in ("estimate", "bounded")


def test_names_state_the_settings():
  assert terngrad(bucket=None, clip=None).name == "terngrad()"
  assert terngrad().name == "terngrad(clip=2.5)"
  assert terngrad(bucket=64, clip=2.5, shared_scale=True).name == (
      "terngrad(bucket=64, clip=2.5, shared_scale=True)")
