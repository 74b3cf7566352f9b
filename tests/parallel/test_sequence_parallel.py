"""A Megatron sequence-parallel transformer block equals the unsharded block, fwd and bwd."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import gather_sequence, reduce_scatter_sequence, split_sequence
import fast_random

TP = 4
BATCH, SEQ, EMBED, HEADS, HEAD_DIM, HIDDEN = 2, 12, 16, 4, 4, 32


def _params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  normal = lambda key, shape: fast_random.normal(key, shape) * shape[0] ** -0.5  # noqa: E731
  return {
      "ln1": 1.0 + 0.1 * fast_random.normal(keys[0], (EMBED,)),
      "ln2": 1.0 + 0.1 * fast_random.normal(keys[1], (EMBED,)),
      "qkv": normal(keys[2], (EMBED, 3, HEADS, HEAD_DIM)),
      "out": normal(keys[3], (HEADS, HEAD_DIM, EMBED)),
      "fc1": normal(keys[4], (EMBED, HIDDEN)),
      "fc2": normal(keys[5], (HIDDEN, EMBED)),
  }


# Column-parallel weights are split on their output (heads, hidden), row-parallel ones on
# their input; the layer-norm scales are replicated.
_SPECS = {"ln1": P(), "ln2": P(), "qkv": P(None, None, "tp"), "out": P("tp"),
          "fc1": P(None, "tp"), "fc2": P("tp")}


def _norm(x, scale):
  x = x - x.mean(-1, keepdims=True)
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def _block(params, x, gather, reduce):
  """Pre-norm block; ``gather``/``reduce`` are identities when unsharded."""
  q, k, v = jnp.einsum("bse,ethd->tbshd", gather(_norm(x, params["ln1"])), params["qkv"])
  attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  x = x + reduce(jnp.einsum("bshd,hde->bse", attn, params["out"]))
  hidden = jax.nn.gelu(gather(_norm(x, params["ln2"])) @ params["fc1"])
  return x + reduce(hidden @ params["fc2"])


def _sequence_parallel_block():
  mesh = jax.make_mesh((TP,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:TP])
  block = functools.partial(_block, gather=functools.partial(gather_sequence, axis_name="tp"),
                            reduce=functools.partial(reduce_scatter_sequence, axis_name="tp"))
  return jax.shard_map(block, mesh=mesh, in_specs=(_SPECS, P(None, "tp")),
                       out_specs=P(None, "tp"))


def _unsharded_block(params, x):
  return _block(params, x, gather=lambda h: h, reduce=lambda h: h)


def test_sequence_parallel_block_equals_unsharded_forward_and_backward():
  params = _params()
  x = fast_random.normal(jax.random.key(1), (BATCH, SEQ, EMBED))
  d_out = fast_random.normal(jax.random.key(2), (BATCH, SEQ, EMBED))

  @functools.partial(jax.jit, static_argnums=0)
  def value_and_grads(block, params, x):
    out, vjp = jax.vjp(block, params, x)
    return out, vjp(d_out)

  got = value_and_grads(_sequence_parallel_block(), params, x)
  want = value_and_grads(_unsharded_block, params, x)
  flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want) == 2 + len(params)
  for a, b in zip(flat_got, flat_want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_split_sequence_gradient_is_an_all_gather_not_an_all_reduce():
  mesh = jax.make_mesh((TP,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:TP])
  weights = jnp.arange(1.0, 1.0 + SEQ)[None, :, None]

  def local_loss(x):  # x replicated; each device weighs its own slice
    mine = split_sequence(x, "tp")
    return jax.lax.psum(jnp.sum(mine * split_sequence(weights, "tp")), "tp")

  def grad_fn(x):
    return jax.shard_map(jax.grad(local_loss), mesh=mesh, in_specs=P(), out_specs=P())(x)

  x = jnp.ones((BATCH, SEQ, EMBED))
  np.testing.assert_allclose(jax.jit(grad_fn)(x), jnp.broadcast_to(weights, x.shape))
  hlo = jax.jit(grad_fn).lower(x).compile().as_text()
  assert "all-gather" in hlo and "all-reduce(" not in hlo.replace("all-reduce-", "")
