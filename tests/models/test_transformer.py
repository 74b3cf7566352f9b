"""TransformerLM with dense, ring, Ulysses and hybrid attention; training on a (data, seq) mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import layout_permutation, to_layout
from models.transformer import TransformerConfig, TransformerLM, make_attention, next_token_loss

CONFIG = TransformerConfig(vocab_size=16, d_model=32, num_heads=4, num_kv_heads=2,
                           num_layers=1, mlp_dim=64)
BATCH, SEQ = 4, 32


def _data(seed=0):
  """Arithmetic sequences mod V with a random start and stride: the next token is learnable."""
  keys = jax.random.split(jax.random.key(seed))
  start = jax.random.randint(keys[0], (BATCH, 1), 0, CONFIG.vocab_size)
  stride = jax.random.randint(keys[1], (BATCH, 1), 1, 4)
  stream = (start + stride * jnp.arange(SEQ + 1)) % CONFIG.vocab_size
  return stream[:, :-1], stream[:, 1:]


def _params(attention):
  model = TransformerLM(CONFIG, attention, rngs=nnx.Rngs(0))
  return nnx.split(model, nnx.Param)


def _dense_loss(params, tokens, targets):
  graphdef, _ = _params(make_attention("dense"))
  logits = nnx.merge(graphdef, params)(tokens, jnp.arange(SEQ))
  return next_token_loss(logits, targets) / targets.size


def _sharded_loss(attention, mesh, seq_axes, layout, ring_shards):
  """Global mean loss of the model run inside shard_map on a sequence-sharded batch."""
  graphdef, _ = _params(attention)
  spec = P("data", seq_axes)
  reduce_axes = ("data",) + (seq_axes if isinstance(seq_axes, tuple) else (seq_axes,))

  def local_loss(params, tokens, targets, positions):
    logits = nnx.merge(graphdef, params)(tokens, positions)
    return jax.lax.psum(next_token_loss(logits, targets), reduce_axes) / (BATCH * SEQ)

  def loss(params, tokens, targets):
    tokens, targets = (to_layout(x, layout, ring_shards) for x in (tokens, targets))
    # Global positions of the tokens in layout order, sharded like them: rotary embeddings
    # see the same positions as in the unsharded model.
    positions = jnp.asarray(layout_permutation(layout, SEQ, ring_shards))
    per_device = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(), spec, spec, P(seq_axes)),
                               out_specs=P())
    return per_device(params, tokens, targets, positions)

  return loss


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _assert_matches_dense(got_loss, got_grads, params, tokens, targets):
  want_loss, want_grads = jax.jit(jax.value_and_grad(_dense_loss))(params, tokens, targets)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_ulysses_model_equals_dense_model_loss_and_grads():
  loss = _sharded_loss(make_attention("ulysses", axis_name="seq", layout="striped"),
                       _mesh((2, 2), ("data", "seq")), "seq", "striped", 2)
  params = _params(make_attention("dense"))[1]
  _assert_matches_dense(*jax.jit(jax.value_and_grad(loss))(params, *_data()), params, *_data())


def test_ring_model_equals_dense_and_trains_on_a_data_by_seq_mesh():
  mesh = _mesh((2, 4), ("data", "seq"))
  loss = _sharded_loss(make_attention("ring", axis_name="seq", layout="zigzag"), mesh, "seq",
                       "zigzag", 4)
  _, params = _params(make_attention("dense"))
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, grads

  losses = []
  for step in range(20):
    tokens, targets = _data(seed=step)
    new_params, opt_state, value, grads = train_step(params, opt_state, tokens, targets)
    if step == 0:  # the ring model computes the dense model's loss and gradients
      _assert_matches_dense(value, grads, params, tokens, targets)
    params = new_params
    losses.append(float(value))
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses


def test_make_attention_errors():
  with pytest.raises(ValueError, match="kind='flash' is unknown"):
    make_attention("flash")
  with pytest.raises(ValueError, match="kind='ring' needs axis_name"):
    make_attention("ring")
  with pytest.raises(ValueError, match="ring_axis=None"):
    make_attention("hybrid", ulysses_axis="local")
