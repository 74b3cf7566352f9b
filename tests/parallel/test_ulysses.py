"""Ulysses and the Ulysses x ring hybrid against unsharded attention."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import from_layout, hybrid_attention, to_layout, ulysses_attention
from jaxcomm._src.topology import make_mesh
import fast_random


def _inputs(seq, heads, kv_heads, dim=8, batch=2, seed=1):
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (batch, seq, heads, dim)
  kv_shape = (batch, seq, kv_heads, dim)
  return (fast_random.normal(keys[0], shape), fast_random.normal(keys[1], kv_shape),
          fast_random.normal(keys[2], kv_shape), fast_random.normal(keys[3], shape))


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(fn, q, k, v, d_out):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(d_out))


def _assert_exact(fn, causal, q, k, v, d_out):
  reference = functools.partial(jax.nn.dot_product_attention, is_causal=causal)
  got = _value_and_grads(fn, q, k, v, d_out)
  want = _value_and_grads(reference, q, k, v, d_out)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    assert err <= 1e-5, (name, err)


def _laid_out(attend, layout, shards):
  def fn(q, k, v):
    return from_layout(attend(*(to_layout(x, layout, shards) for x in (q, k, v))), layout,
                       shards)
  return fn


# kv_heads: 4 (divisible by P), 2 (P=4: replicated to 4), 1 (MQA).
@pytest.mark.parametrize("size,layout,causal,heads,kv_heads,seq", [
    (2, "contiguous", True, 4, 4, 12),
    (4, "zigzag", True, 8, 2, 24),
    (4, "striped", True, 4, 1, 20),
    (8, "contiguous", False, 8, 4, 24),
])
def test_ulysses_matches_dense(size, layout, causal, heads, kv_heads, seq):
  mesh = jax.make_mesh((size,), ("seq",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:size])
  attend = jax.shard_map(
      functools.partial(ulysses_attention, axis_name="seq", causal=causal, layout=layout),
      mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
  _assert_exact(_laid_out(attend, layout, size), causal, *_inputs(seq, heads, kv_heads))


def test_hybrid_ulysses_on_fast_axis_ring_on_slow_axis():
  mesh = make_mesh(hosts=2, local=4)
  layout, causal = "zigzag", True
  attend = jax.shard_map(
      functools.partial(hybrid_attention, ring_axis="host", ulysses_axis="local",
                        causal=causal, layout=layout),
      mesh=mesh, in_specs=P(None, ("host", "local")), out_specs=P(None, ("host", "local")))
  # The ring's layout is over the 2 hosts; each host's shard is then split over 4 devices.
  _assert_exact(_laid_out(attend, layout, 2), causal, *_inputs(32, 8, 4))


@pytest.mark.parametrize("heads,kv_heads,match", [
    (6, 6, r"q heads \(6, q.shape\[2\]\) are not divisible by the size 4 of axis_name='seq'"),
    (12, 6, r"k/v heads \(6, k.shape\[2\]\) must divide or be divisible by the size 4"),
])
def test_ulysses_heads_not_divisible(heads, kv_heads, match):
  mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  q, k, v, _ = _inputs(8, heads, kv_heads)
  attend = jax.shard_map(functools.partial(ulysses_attention, axis_name="seq"), mesh=mesh,
                         in_specs=P(None, "seq"), out_specs=P(None, "seq"))
  with pytest.raises(ValueError, match=match):
    attend(q, k, v)
