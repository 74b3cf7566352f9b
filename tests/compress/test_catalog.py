"""Contract checks every compressor of the catalog must pass.

Wire bytes equal to the payload's real bytes and to the closed form; jit and vmap; float32,
bfloat16 and float16 inputs; 0-d, length-1 and odd shapes; all-zero inputs without NaN; and,
under error feedback, a non-finite input reported and kept out of the residual.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compress import (adaptive_threshold, cast, compose, count_sketch, error_feedback,
                              identity, natural, payload_nbytes, powersgd, qsgd, quantize,
                              randomk, sign, sign_vote, terngrad, threshold, topk)

CATALOG = {
    "identity": identity(),
    "cast_bf16": cast(jnp.bfloat16),
    "cast_fp16_guarded": cast(jnp.float16, axis_size=4),
    "cast_e4m3_scaled": cast(jnp.float8_e4m3fn, scaled=True),
    "cast_e5m2": cast(jnp.float8_e5m2),
    "int4": quantize(4),
    "int3_nearest_chunked": quantize(3, stochastic=False, chunk=5),
    "qsgd": qsgd(4),
    "qsgd_bucketed": qsgd(3, bucket=4),
    "terngrad": terngrad(),
    "terngrad_unclipped": terngrad(clip=None),
    "terngrad_bucketed": terngrad(bucket=4, clip=None),
    "terngrad_bucketed_clipped": terngrad(bucket=4, clip=1.5),
    "sign": sign(),
    "sign_vote": sign_vote(),
    "natural": natural(),
    "topk": topk(0.25),
    "topk_chunked": topk(0.25, chunk=8),
    "topk_approximate": topk(0.25, approximate=True),
    "randomk_shared": randomk(0.25),
    "randomk_private": randomk(0.25, shared=False, scale=False),
    "threshold": threshold(0.5, capacity=0.5),
    "adaptive_threshold": adaptive_threshold(0.25),
    "topk_int8": compose(topk(0.25), quantize(8)),
    "threshold_int4": compose(threshold(0.5, capacity=0.5), quantize(4, stochastic=False)),
    "powersgd": powersgd(1, min_compression_rate=1.0),
    "count_sketch": count_sketch(8, 3),
}
SHAPES = [(), (1,), (7,), (6, 5)]
NAMES = sorted(CATALOG)


VMAP_SHAPE = (6, 5)


def _roundtrip(compressor, x, key):
  state = compressor.init(x.shape, x.dtype)
  payload, state = compressor.encode(x, state, key)
  return payload, compressor.decode(payload, x.shape)


def _inputs():
  rng = np.random.default_rng(0)
  shapes = {f"shape{shape}": np.stack([rng.standard_normal(shape), np.zeros(shape)])
            for shape in SHAPES}
  return {key: value.astype(np.float32) for key, value in shapes.items()}


@functools.lru_cache(maxsize=None)
def probe(name):
  """Runs every contract case of one compressor in one compiled function (few compilations).

  Each shape is run under ``vmap`` over a normal and an all-zero input (which also checks
  ``vmap``: row 0 of the last shape is compared with an unbatched call); error feedback under
  ``vmap`` over a finite, a NaN and an Inf input from one state with a nonzero residual.
  """
  compressor = CATALOG[name]
  wrapped = error_feedback(compressor)

  def roundtrip(x, key):
    payload, _ = compressor.encode(x, compressor.init(x.shape, x.dtype), key)
    return payload, compressor.decode(payload, x.shape)

  @jax.jit
  def run(inputs, keys):
    out = {label: jax.vmap(roundtrip, in_axes=(0, None))(batch, keys[0])
           for label, batch in inputs.items()}
    x = inputs[f"shape{VMAP_SHAPE}"][0]
    out["unbatched"] = roundtrip(x, keys[0])
    for dtype in (jnp.bfloat16, jnp.float16):
      out[f"dtype {jnp.dtype(dtype).name}"] = roundtrip(x.astype(dtype), keys[1])
    state = wrapped.init(VMAP_SHAPE, jnp.float32)
    state = state._replace(residual=0.1 * jnp.flip(x))
    bad = jnp.stack([x, x.at[2, 3].set(jnp.nan), x.at[2, 3].set(jnp.inf)])
    out["ef_before"] = state
    out["ef_after"] = jax.vmap(wrapped.encode, in_axes=(0, None, None))(bad, state, keys[2])[1]
    return out

  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  return jax.device_get(run(_inputs(), keys))


def _row(tree, index):
  return jax.tree.map(lambda leaf: leaf[index], tree)


@pytest.mark.parametrize("name", NAMES)
def test_wire_bytes_shapes_zeros_and_vmap(name):
  compressor, out = CATALOG[name], probe(name)
  for shape in SHAPES:
    payloads, decoded = out[f"shape{shape}"]
    assert payload_nbytes(_row(payloads, 0)) == compressor.wire_bytes(shape, jnp.float32), shape
    chex.assert_shape(decoded, (2,) + shape)
    chex.assert_type(decoded, jnp.float32)
    chex.assert_tree_all_finite(decoded)
    # sign_vote sends votes, not magnitudes: a zero votes +1.
    np.testing.assert_array_equal(decoded[1], 1.0 if name == "sign_vote" else 0.0)
  chex.assert_trees_all_close(out["unbatched"], _row(out[f"shape{VMAP_SHAPE}"], 0),
                              atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_inputs(name):
  compressor, out = CATALOG[name], probe(name)
  for dtype in ("bfloat16", "float16"):
    payload, decoded = out[f"dtype {dtype}"]
    assert payload_nbytes(payload) == compressor.wire_bytes(VMAP_SHAPE, jnp.dtype(dtype))
    chex.assert_type(decoded, jnp.float32)
    chex.assert_tree_all_finite(decoded)
    assert np.any(decoded != 0)


def _float_leaves(tree):
  return [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_is_kept_out_of_the_residual(name):
  out = probe(name)
  before, after = out["ef_before"], out["ef_after"]
  assert np.any(after.residual[0] != before.residual)
  for index in (1, 2):
    chex.assert_trees_all_equal(after.residual[index], before.residual)
    chex.assert_trees_all_equal(_float_leaves(_row(after.inner, index)),
                                _float_leaves(before.inner))
