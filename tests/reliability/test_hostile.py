"""Hostile input, property-based: a correct result or a clear error naming the parameter.

Shapes (0-d, empty, length 1, odd, large), dtypes (float32, bfloat16, float16, integer, bool),
pytrees (empty, nested, None leaves) and configurations, for every compressor factory of
``jaxcomm.compress``, the collectives and ``compressed_allreduce``.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxcomm
from jaxcomm import compress
from update_helpers import update_fn

SETTINGS = settings(deadline=None, max_examples=20, derandomize=True)
AXES = ("host", "local")
# One configured instance (or more) of every compressor factory in jaxcomm.compress.__all__.
COMPRESSORS = {
    "identity": compress.identity(), "natural": compress.natural(),
    "cast": compress.cast(jnp.bfloat16), "cast-scaled": compress.cast(jnp.float16, scaled=True),
    "topk": compress.topk(0.3), "topk-k": compress.topk(k=3), "topk-chunk": compress.topk(0.3, chunk=4),
    "randomk": compress.randomk(0.3), "randomk-private": compress.randomk(0.3, shared=False),
    "sign": compress.sign(), "sign-chunk": compress.sign(chunk=3), "sign-vote": compress.sign_vote(),
    "qsgd": compress.qsgd(4), "quantize": compress.quantize(4),
    "quantize-chunk": compress.quantize(8, chunk=5), "terngrad": compress.terngrad(),
    "terngrad-bucket": compress.terngrad(bucket=5, clip=None),
    "threshold": compress.threshold(0.5), "adaptive-threshold": compress.adaptive_threshold(0.3),
    "count-sketch": compress.count_sketch(8, 3), "count-sketch-heavy": compress.count_sketch(8, 3, heavy=0.3),
    "powersgd": compress.powersgd(1, min_compression_rate=1.0),
    "compose": compress.compose(compress.topk(0.5), compress.quantize(8)),
}
SHAPES = st.sampled_from([(), (0,), (1,), (7,), (3, 5), (0, 4), (2, 0, 3), (1, 1), (65537,),
                          (33, 17)])
FLOATS = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])


def _values(shape, dtype, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 3, dtype)


@SETTINGS
@given(name=st.sampled_from(sorted(COMPRESSORS)), shape=SHAPES, dtype=FLOATS,
       seed=st.integers(0, 2**16))
def test_every_compressor_with_error_feedback_loses_nothing(name, shape, dtype, seed):
  """decode(payload) + new residual == input, for any shape and float dtype."""
  compressor = compress.error_feedback(COMPRESSORS[name])
  x = _values(shape, dtype, seed)
  state = compressor.init(shape, dtype)
  payload, state = jax.jit(compressor.encode)(x, state, jax.random.PRNGKey(seed))
  decoded = compressor.decode(payload, shape)
  assert decoded.shape == shape and decoded.dtype == jnp.float32
  chex.assert_tree_all_finite((decoded, state.residual))
  np.testing.assert_allclose(decoded + state.residual, np.asarray(x, np.float32),
                             rtol=1e-5, atol=1e-5 * (1 + float(jnp.max(jnp.abs(x), initial=0))))
  assert compress.payload_nbytes(payload) <= max(compressor.wire_bytes(shape, dtype), 0) + 64


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_])
def test_integer_and_bool_input_is_refused_by_every_compressor(name, dtype):
  compressor = compress.error_feedback(COMPRESSORS[name])
  with pytest.raises(TypeError, match="x must be a float32, bfloat16 or float16 array"):
    compressor.encode(jnp.zeros((4,), dtype), compressor.init((4,), jnp.float32),
                      jax.random.PRNGKey(0))


def _both_densities(value):
  """top-k and the adaptive threshold take the same density argument."""
  compress.topk(value)
  return compress.adaptive_threshold(value)


JUNK = st.sampled_from([0, -1, -0.5, 1.5, math.nan, math.inf, True, "0.1", None, 10**6])
FACTORIES = {
    "k": lambda v: compress.topk(k=v),
    "chunk": lambda v: compress.sign(chunk=v), "bits": lambda v: compress.quantize(v),
    "levels": lambda v: compress.qsgd(v), "width": lambda v: compress.count_sketch(v),
    "depth": lambda v: compress.count_sketch(8, v), "rank": lambda v: compress.powersgd(v),
    "value": lambda v: compress.threshold(v), "density": lambda v: _both_densities(v),
    "dtype": lambda v: compress.cast(v), "seed": lambda v: compress.randomk(0.1, seed=v),
}


@SETTINGS
@given(parameter=st.sampled_from(sorted(FACTORIES)), value=JUNK)
def test_bad_configuration_is_refused_with_the_parameter_named_or_accepted(parameter, value):
  try:
    compressor = FACTORIES[parameter](value)
  except (TypeError, ValueError) as error:
    assert parameter in str(error), str(error)
    return
  # Accepted: then it must work on a small input.
  payload, _ = compressor.encode(jnp.ones(6), compressor.init((6,), jnp.float32),
                                 jax.random.PRNGKey(0))
  assert bool(jnp.all(jnp.isfinite(compressor.decode(payload, (6,)))))


LEAF = st.tuples(st.sampled_from([(), (0,), (1,), (5,), (3, 7), (2, 0)]),
                 st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
TREES = st.recursive(
    st.one_of(LEAF, st.none()),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.sampled_from("abc"), children, max_size=3)),
    max_leaves=4)
ALLREDUCE = {
    "full": dict(compressor=None),
    "identity": dict(compressor=compress.identity(), feedback=False),
    "topk-ef": dict(compressor=compress.topk(0.5)),
    "sign-two-phase": dict(compressor=compress.sign(), strategy="two_phase"),
    "quantize-linear": dict(compressor=compress.quantize(8), feedback=False),
}
EXACT = ("full", "identity")


def _materialize(spec, seed):
  """A pytree of per-device arrays ``(8, *shape)`` from a tree of ``(shape, dtype)``."""
  is_spec = lambda node: isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], tuple)
  leaves, treedef = jax.tree.flatten(spec, is_leaf=is_spec)
  rng = np.random.default_rng(seed)
  return treedef.unflatten([jnp.asarray(rng.standard_normal((8, *shape)), dtype)
                            for shape, dtype in leaves])


@settings(deadline=None, max_examples=15, derandomize=True)
@given(spec=TREES, name=st.sampled_from(sorted(ALLREDUCE)), seed=st.integers(0, 100))
# An empty leaf beside another in a two-phase exchange (quantize(8) resolves to two-phase):
# once every leaf shared one all-to-all, the empty leaf's reduce-scatter could not be lowered.
@example(spec=[((), jnp.float32), ((0,), jnp.float32)], name="quantize-linear", seed=0)
@example(spec=[((5,), jnp.float32), ((0,), jnp.float32)], name="sign-two-phase", seed=0)
def test_compressed_allreduce_on_any_pytree(spec, name, seed):
  """Every leaf comes back with its shape and dtype, the same on all devices; exact
  configurations give the mean."""
  grads = _materialize(spec, seed)
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(**ALLREDUCE[name])
  params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)
  state, update = update_fn(tx, params, mesh, every_device=True)
  means, _ = update(grads, state)
  assert jax.tree.structure(means) == jax.tree.structure(grads)
  for mean, grad in zip(jax.tree.leaves(means), jax.tree.leaves(grads)):
    assert mean.shape == grad.shape and mean.dtype == grad.dtype
    mean = np.asarray(mean, np.float32)
    assert np.all(np.isfinite(mean)) and np.all(mean == mean[:1])
    if name in EXACT:
      tolerance = 1e-6 if grad.dtype == jnp.float32 else 2e-2
      np.testing.assert_allclose(mean[0], np.mean(np.asarray(grad, np.float32), 0),
                                 atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_compressed_allreduce_names_an_integer_or_bool_leaf(dtype):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(compress.topk(0.5))
  with pytest.raises(TypeError, match=r"params\['a'\]\[1\] must be a float32"):
    jaxcomm.optim.sharded_init(tx, {"a": [jnp.zeros(3), jnp.zeros(3, dtype)]}, mesh)


@pytest.mark.parametrize("call, match", [
    (lambda: jaxcomm.collectives.level("host", compress.topk(0.1), strategy="psum"), "strategy"),
    (lambda: jaxcomm.collectives.level("", None), "axis"),
    (lambda: jaxcomm.collectives.level("host", None, dtype=jnp.int8), "dtype"),
    (lambda: jaxcomm.collectives.level("host", compress.topk(0.1), strategy="linear"), "linear"),
    (lambda: jaxcomm.compressed_allreduce(compress.topk(0.1), bucket_bytes=1.5), "bucket_bytes"),
])
def test_bad_collective_configuration_names_the_parameter(call, match):
  with pytest.raises((TypeError, ValueError), match=match):
    call()
