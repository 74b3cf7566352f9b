"""QSGD's encode: one pass over the input on the CPU, codes that fit, unbiased with buckets.

Fixed keys and inputs; the statistical check's tolerance is several standard errors.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compress import qsgd, unpack_bits
from jaxcomm._src.compress import chunks

KEY = jax.random.PRNGKey(11)


@pytest.mark.parametrize("bucket", [None, 512])
def test_encode_keeps_no_float_temporary_of_the_input_size(bucket):
  """Compiled for the CPU, the encode's temporaries are the uint8 codes (one byte per element)
  and at most a step of float32 for the norms' loop: the ratios ``|x| * s / norm`` are fused
  into the codes, not written out as float32 (a 64 MiB temporary at 16M, page-faulted on
  every call). Whole steps: a partial last one copies slices of the input for the norms."""
  size = 16 * chunks.NORM_STEP
  encode = jax.jit(lambda x, key: qsgd(15, bucket=bucket).encode(x, (), key)[0])
  compiled = encode.lower(jax.ShapeDtypeStruct((size,), jnp.float32), KEY).compile()
  temporary = compiled.memory_analysis().temp_size_in_bytes
  assert temporary <= size + 4 * chunks.NORM_STEP, temporary


@pytest.mark.parametrize("levels", [1, 15, 127])
def test_codes_fit_for_one_hot_and_non_finite_inputs(levels):
  """A one-hot bucket's ratio ``|x| * (s / |x|)`` can round above ``s``: its level is clipped
  to ``s``. Infinite ratios (an infinity under a NaN norm, which scales by ``s``) saturate
  to ``s`` too, and a bucket holding a NaN or an infinity decodes to NaN, not to a finite
  gradient."""
  bits = math.ceil(math.log2(levels + 1)) + 1
  one_hot = jnp.zeros(1000).at[3].set(-7.3e-3).at[600].set(3.1e5)
  hostile = jnp.array([jnp.nan, -jnp.inf, 1.0, -2.0, jnp.inf, 1.0, -0.0, 3.0, 0.5, -1.5, 0.0, 2.0])
  for x, bucket in ((one_hot, 512), (hostile, None), (hostile, 4)):
    compressor = qsgd(levels, bucket=bucket)
    payload, _ = jax.jit(compressor.encode)(x, (), KEY)
    codes = np.asarray(unpack_bits(payload.codes, bits, x.shape[0]))
    assert (codes & ((1 << (bits - 1)) - 1)).max() <= levels
    decoded = np.asarray(compressor.decode(payload, x.shape))
    if x is one_hot:
      np.testing.assert_array_equal(codes[[3, 600]], [(1 << (bits - 1)) | levels, levels])
      np.testing.assert_allclose(decoded[[3, 600]], np.asarray(x)[[3, 600]], rtol=1e-6)
    else:
      finite_buckets = 8 if bucket else 0  # the third bucket of 4 is finite
      assert np.all(np.isnan(decoded[:finite_buckets or None]))
      np.testing.assert_array_equal(np.isfinite(decoded[finite_buckets:]), bool(finite_buckets))


def test_bucketed_qsgd_is_unbiased_over_several_buckets():
  """2,000 decodes of a 4,096-element input in buckets of 512 whose scales span 5 decades,
  each draw with its own key: per bucket, and over the input weighted by the signs, the summed
  error of the mean decode is within 5 standard errors of zero (the variance of each element's
  rounding, ``step^2 p (1 - p)``, from the ratios the encode computes)."""
  levels, bucket, draws = 15, 512, 2000
  x = jax.random.normal(jax.random.PRNGKey(2), (4096,)) * jnp.repeat(jnp.logspace(-3, 2, 8), bucket)
  compressor = qsgd(levels, bucket=bucket)

  @jax.jit
  def decoded(keys):
    return jax.vmap(lambda key: compressor.decode(compressor.encode(x, (), key)[0], x.shape))(keys)

  samples = np.asarray(decoded(jax.random.split(KEY, draws)), np.float64)
  norms = np.asarray(compressor.encode(x, (), KEY)[0].norm, np.float64)
  step = np.repeat(norms / levels, bucket)
  ratio = np.abs(np.asarray(x, np.float64)) / step
  variance = step**2 * (ratio - np.floor(ratio)) * (1 - ratio + np.floor(ratio)) / draws
  error = samples.mean(axis=0) - np.asarray(x, np.float64)
  per_bucket = error.reshape(-1, bucket).sum(axis=1) / np.sqrt(variance.reshape(-1, bucket).sum(axis=1))
  assert np.all(np.abs(per_bucket) < 5), per_bucket
  along_signs = np.sum(error * np.sign(x)) / np.sqrt(np.sum(variance))
  assert abs(along_signs) < 5, along_signs
