"""Bad input fails early with an error that names the parameter and its value."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import hybrid_attention, ring_attention, ulysses_attention


def _mesh():
  return jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])


def _call(attention, q, k, v, **kwargs):
  fn = functools.partial(attention, **kwargs)
  return jax.shard_map(fn, mesh=_mesh(), in_specs=P(None, "seq"), out_specs=P(None, "seq"))(
      q, k, v)


def _qkv(seq=16, heads=4, kv_heads=4, dim=8, dtype=jnp.float32):
  return (jnp.ones((2, seq, heads, dim), dtype), jnp.ones((2, seq, kv_heads, dim), dtype),
          jnp.ones((2, seq, kv_heads, dim), dtype))


_ATTENTIONS = [ring_attention, ulysses_attention]


@pytest.mark.parametrize("attention", _ATTENTIONS)
def test_mismatched_shapes(attention):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"k and v must have the same shape; got k.shape="):
    _call(attention, q, k, v[..., :4], axis_name="seq")
  with pytest.raises(ValueError, match=r"head_dim .* q.shape=\(2, 4, 4, 4\)"):
    _call(attention, q[..., :4], k, v, axis_name="seq")
  with pytest.raises(ValueError, match=r"q heads must be a multiple of k/v heads.*=3"):
    _call(attention, *_qkv(heads=4, kv_heads=3), axis_name="seq")
  with pytest.raises(ValueError, match=r"q must have shape \(batch, seq, heads, head_dim\)"):
    _call(attention, q[..., 0], k, v, axis_name="seq")


@pytest.mark.parametrize("attention", _ATTENTIONS)
def test_mismatched_dtypes(attention):
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"k.dtype=bfloat16"):
    _call(attention, q, k.astype(jnp.bfloat16), v, axis_name="seq")
  with pytest.raises(TypeError, match=r"floating point; got dtype int32"):
    _call(attention, *(x.astype(jnp.int32) for x in (q, k, v)), axis_name="seq")


@pytest.mark.parametrize("attention", _ATTENTIONS)
def test_sequence_not_divisible_by_layout_chunks(attention):
  # 12 tokens over 4 devices is 3 per device: zigzag needs two equal chunks per device.
  with pytest.raises(ValueError, match=r"sequence length 3 .* layout='zigzag'"):
    _call(attention, *_qkv(seq=12), axis_name="seq", causal=True, layout="zigzag")


@pytest.mark.parametrize("attention", _ATTENTIONS)
def test_axis_missing_from_mesh(attention):
  with pytest.raises(ValueError, match=r"axis_name='sp' is not an axis of the enclosing"):
    _call(attention, *_qkv(), axis_name="sp")


def test_called_outside_shard_map():
  with pytest.raises(ValueError, match=r"axis_name='seq' is not an axis"):
    ring_attention(*_qkv(), axis_name="seq")


@pytest.mark.parametrize("attention", _ATTENTIONS)
def test_unknown_layout_and_implementation(attention):
  with pytest.raises(ValueError, match=r"layout='diagonal' is unknown"):
    _call(attention, *_qkv(), axis_name="seq", layout="diagonal")
  with pytest.raises(ValueError, match=r"implementation='flash' is unknown"):
    _call(attention, *_qkv(), axis_name="seq", implementation="flash")


def test_hybrid_names_the_axis_parameter():
  with pytest.raises(ValueError, match=r"ring_axis='host' is not an axis"):
    _call(hybrid_attention, *_qkv(), ring_axis="host", ulysses_axis="seq")
  with pytest.raises(ValueError, match=r"ulysses_axis='local' is not an axis"):
    _call(hybrid_attention, *_qkv(), ring_axis="seq", ulysses_axis="local")
  with pytest.raises(ValueError, match=r"ring_axis and ulysses_axis must differ; both are 'seq'"):
    _call(hybrid_attention, *_qkv(), ring_axis="seq", ulysses_axis="seq")


def test_hybrid_heads_not_divisible_by_the_fast_axis():
  mesh = jax.make_mesh((2, 4), ("host", "local"), axis_types=(AxisType.Auto,) * 2)
  fn = functools.partial(hybrid_attention, ring_axis="host", ulysses_axis="local")
  spec = P(None, ("host", "local"))
  with pytest.raises(ValueError, match=r"not divisible by the size 4 of ulysses_axis='local'"):
    jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(*_qkv(heads=6, kv_heads=6))
