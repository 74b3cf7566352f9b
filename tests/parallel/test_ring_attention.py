"""Ring attention against jax.nn.dot_product_attention on the unsharded sequence."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import from_layout, ring_attention, to_layout


def _mesh(size, name="seq"):
  return jax.make_mesh((size,), (name,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:size])


def _inputs(seq, heads=4, kv_heads=2, dim=8, batch=2, dtype=jnp.float32, seed=0):
  # Drawn by numpy: jax.random compiles a threefry program per rank-4 shape, seconds of CPU
  # each on XLA:CPU (4 per case), for the same standard normal inputs.
  rng = np.random.default_rng(seed)
  shapes = [(batch, seq, h, dim) for h in (heads, kv_heads, kv_heads, heads)]
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
               for shape in shapes)


def _sharded(size, layout, causal):
  """Global (natural order) -> global attention, computed by the ring over ``size`` devices."""
  attend = jax.shard_map(
      functools.partial(ring_attention, axis_name="seq", causal=causal, layout=layout),
      mesh=_mesh(size), in_specs=P(None, "seq"), out_specs=P(None, "seq"))

  def fn(q, k, v):
    laid_out = [to_layout(x, layout, size) for x in (q, k, v)]
    return from_layout(attend(*laid_out), layout, size)

  return fn


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(fn, q, k, v, d_out):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(d_out))


def _max_rel_err(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return np.max(np.abs(actual - expected)) / np.max(np.abs(expected))


def _check_exact(size, layout, causal, seq, heads=4, kv_heads=2):
  q, k, v, d_out = _inputs(seq, heads, kv_heads)
  reference = functools.partial(jax.nn.dot_product_attention, is_causal=causal)
  got = _value_and_grads(_sharded(size, layout, causal), q, k, v, d_out)
  want = _value_and_grads(reference, q, k, v, d_out)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
    assert _max_rel_err(a, b) <= 1e-5, (name, _max_rel_err(a, b))


# Every (P > 1, layout) pair under a causal mask, where the layouts differ, each with its own
# sequence length (none a power of two) and head grouping (MHA, GQA, MQA); the unmasked ring is
# layout independent, so it is covered on one layout per P.
# Striped blocks from a later device leave a query row fully masked (lse = -inf): a NaN from
# merging it would fail the error bound (NaN <= tol is False).
_CAUSAL_CASES = [
    (1, "striped", 7, (6, 3)),  # one device: every layout is the identity
    (2, "contiguous", 18, (4, 1)), (2, "zigzag", 20, (4, 4)), (2, "striped", 14, (4, 2)),
    (4, "contiguous", 20, (6, 3)), (4, "zigzag", 24, (4, 1)), (4, "striped", 28, (4, 4)),
    (8, "contiguous", 40, (4, 2)), (8, "zigzag", 48, (6, 3)), (8, "striped", 24, (4, 1)),
]


@pytest.mark.parametrize("size,layout,seq,heads", _CAUSAL_CASES)
def test_causal_matches_dense_forward_and_grads(size, layout, seq, heads):
  _check_exact(size, layout, causal=True, seq=seq, heads=heads[0], kv_heads=heads[1])


@pytest.mark.parametrize("size,layout,seq", [(2, "striped", 18), (8, "contiguous", 40)])
def test_non_causal_matches_dense_forward_and_grads(size, layout, seq):
  _check_exact(size, layout, causal=False, seq=seq)


def test_bf16_inputs_within_bf16_tolerance():
  size, causal, layout = 4, True, "zigzag"
  q, k, v, d_out = _inputs(32, dtype=jnp.bfloat16)
  got = _value_and_grads(_sharded(size, layout, causal), q, k, v, d_out)

  def reference(q, k, v):  # the exact answer for these bf16 inputs, computed in fp32
    return jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                        is_causal=causal)

  want = _value_and_grads(reference, q, k, v, d_out.astype(jnp.float32))
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.dtype == jnp.bfloat16, name
    # bf16 keeps 8 significant bits (eps 2^-8 ~ 0.4%); a few roundings of inputs and outputs.
    assert _max_rel_err(a, b) <= 2e-2, (name, _max_rel_err(a, b))


def test_batch_sharded_over_a_data_axis_too():
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  q, k, v, d_out = _inputs(32)
  attend = jax.shard_map(
      functools.partial(ring_attention, axis_name="seq", causal=True, layout="contiguous"),
      mesh=mesh, in_specs=P("data", "seq"), out_specs=P("data", "seq"))
  got = _value_and_grads(attend, q, k, v, d_out)
  want = _value_and_grads(functools.partial(jax.nn.dot_product_attention, is_causal=True),
                          q, k, v, d_out)
  for a, b in zip(got, want):
    assert _max_rel_err(a, b) <= 1e-5
