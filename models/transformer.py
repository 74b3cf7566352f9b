"""A decoder-only transformer language model (flax nnx) with pluggable attention.

The model never sees the mesh: it attends with whatever ``attention(q, k, v)`` it was built
with and embeds positions it is given. Built with ``make_attention('dense')`` it is an ordinary
single-device LM; with ``'ring'``, ``'ulysses'`` or ``'hybrid'`` it runs inside
``jax.shard_map`` on a sequence shard, taking the global positions of its tokens from
``jaxcomm.parallel.shard_positions`` so rotary embeddings match the unsharded model.

Example (a (data, seq) mesh, batch sharded on 'data', sequence in zigzag layout on 'seq')::

  attention = make_attention('ring', axis_name='seq', layout='zigzag')
  model = TransformerLM(TransformerConfig(vocab_size=256), attention, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  # inside shard_map(..., in_specs=(P(), P('data', 'seq')), ...):
  #   positions = shard_positions('zigzag', tokens.shape[1], seq_size, axis_index('seq'))
  #   logits = nnx.merge(graphdef, params)(tokens, positions)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcomm.parallel import dense_attention, hybrid_attention, ring_attention, ulysses_attention

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
ATTENTION_KINDS = ("dense", "ring", "ulysses", "hybrid")


def make_attention(kind: str = "dense", *, axis_name: str | None = None,
                   layout: str = "contiguous", ring_axis: str | None = None,
                   ulysses_axis: str | None = None, implementation: str | None = None
                   ) -> AttentionFn:
  """Causal attention ``(q, k, v) -> out`` on ``(B, S, H, D)`` arrays.

  Args:
    kind: ``'dense'`` (unsharded), ``'ring'`` or ``'ulysses'`` (sequence sharded over
      ``axis_name``), ``'hybrid'`` (Ulysses over ``ulysses_axis``, ring over ``ring_axis``).
    axis_name: sequence axis for ``'ring'`` and ``'ulysses'``.
    layout: the sequence layout of the sharded kinds.
    ring_axis, ulysses_axis: the two axes of ``'hybrid'``.
    implementation: block kernel choice, as for ``jaxcomm.parallel.ring_attention``.

  Returns:
    The attention function to build ``TransformerLM`` with.

  Raises:
    ValueError: unknown ``kind``, or a sharded kind without its axis names.
  """
  if kind not in ATTENTION_KINDS:
    raise ValueError(f"kind={kind!r} is unknown; expected one of {ATTENTION_KINDS}.")
  if kind == "dense":
    return functools.partial(dense_attention, causal=True, implementation=implementation)
  if kind == "hybrid":
    if ring_axis is None or ulysses_axis is None:
      raise ValueError(f"kind='hybrid' needs ring_axis and ulysses_axis; got "
                       f"ring_axis={ring_axis!r}, ulysses_axis={ulysses_axis!r}.")
    return functools.partial(hybrid_attention, ring_axis=ring_axis, ulysses_axis=ulysses_axis,
                             causal=True, layout=layout, implementation=implementation)
  if axis_name is None:
    raise ValueError(f"kind={kind!r} needs axis_name, the sequence-sharded mesh axis.")
  sharded = ring_attention if kind == "ring" else ulysses_attention
  return functools.partial(sharded, axis_name=axis_name, causal=True, layout=layout,
                           implementation=implementation)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes of ``TransformerLM``; ``num_kv_heads < num_heads`` gives grouped-query attention."""
  vocab_size: int
  d_model: int = 64
  num_heads: int = 4
  num_kv_heads: int = 2
  num_layers: int = 2
  mlp_dim: int = 128
  rope_base: float = 10_000.0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding of ``x (B, S, H, D)`` at global ``positions (S,)`` or ``(B, S)``."""
  half = x.shape[-1] // 2
  frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[..., None].astype(jnp.float32) * frequencies   # (..., S, D/2)
  angles = jnp.broadcast_to(angles, x.shape[:2] + (half,))[:, :, None]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary embeddings and a pluggable kernel."""

  def __init__(self, config: TransformerConfig, attention: AttentionFn, *, rngs: nnx.Rngs):
    self.config = config
    self.attention = attention
    kv_features = config.num_kv_heads * config.head_dim
    self.query = nnx.Linear(config.d_model, config.d_model, use_bias=False, rngs=rngs)
    self.key = nnx.Linear(config.d_model, kv_features, use_bias=False, rngs=rngs)
    self.value = nnx.Linear(config.d_model, kv_features, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(config.d_model, config.d_model, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    config = self.config
    batch, seq, _ = x.shape
    q = self.query(x).reshape(batch, seq, config.num_heads, config.head_dim)
    k = self.key(x).reshape(batch, seq, config.num_kv_heads, config.head_dim)
    v = self.value(x).reshape(batch, seq, config.num_kv_heads, config.head_dim)
    q, k = (rotary(t, positions, config.rope_base) for t in (q, k))
    return self.out(self.attention(q, k, v).reshape(batch, seq, config.d_model))


class Block(nnx.Module):
  """Pre-norm transformer block: attention and a GELU MLP, each with a residual."""

  def __init__(self, config: TransformerConfig, attention: AttentionFn, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
    self.attention = Attention(config, attention, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
    self.mlp_in = nnx.Linear(config.d_model, config.mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(config.mlp_dim, config.d_model, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), positions)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
  """Decoder-only LM: token embedding, ``num_layers`` blocks, tied output projection.

  Args:
    config: model sizes.
    attention: ``(q, k, v) -> out``, e.g. from ``make_attention``.
    rngs: parameter initialization keys.

  Call with ``tokens (B, S)`` int and their global ``positions (S,)`` or ``(B, S)``; returns
  logits ``(B, S, vocab_size)`` in fp32.
  """

  def __init__(self, config: TransformerConfig, attention: AttentionFn, *, rngs: nnx.Rngs):
    if config.d_model % config.num_heads or config.head_dim % 2:
      raise ValueError(f"d_model={config.d_model} must split into num_heads={config.num_heads} "
                       f"heads of even size.")
    self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(config, attention, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(config.d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions)
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Summed cross-entropy of ``logits (B, S, V)`` against ``targets (B, S)``.

  A sum, not a mean, so per-shard losses add up to the global one: divide by the global
  token count once.
  """
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
