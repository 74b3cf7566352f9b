"""GPT: a byte-level decoder-only transformer LM trained on Python's own English documentation.

The network is :class:`models.transformer.TransformerLM` built with dense causal attention and
as many key/value heads as query heads (plain multi-head attention): token embedding, pre-norm
blocks (RMSNorm, causal self-attention with rotary positions, RMSNorm, GELU MLP, each with a
residual), a final RMSNorm and the output projection tied to the embedding. This module adds
what makes it a language-model workload: the sizes, the data and the loss.

Data: :func:`models.text.load_pydoc_corpus`, the documentation topics of the standard
library's ``pydoc_data`` package, split by topic (held-out topics are never trained on).
Training batches are random windows of the training stream, the same for the same seed
(:func:`models.text.sample_sequences`); the held-out set is every whole window of the held-out
stream (:func:`models.text.tile_sequences`), so its loss does not depend on a seed.

Example::

  corpus = text.load_pydoc_corpus()
  graphdef, params = init_gpt(SIZES["default"], seed=0)
  loss_fn = lm_loss(graphdef)
  batch = text.sample_sequences(corpus.train, 32, CONTEXT["default"], seed=0)
  loss = loss_fn(params, batch)   # mean next-byte cross-entropy, nats

Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019; Su et al.,
"RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.text import VOCAB
from models.transformer import TransformerConfig, TransformerLM, make_attention, next_token_loss

#: Model sizes. ``default``: 2 layers, width 64, 4 heads of 16, MLP 256, 32-byte context
#: (115,648 parameters); ``large``: 3 layers, width 256, 4 heads of 64, MLP 1,024, the same
#: context (2,430,464 parameters), the size of ``mesh_scan --profile lm-large``. 4 layers
#: with a 64-byte context and 4 windows per device took 291 ms per fp32 step on the 2x4 CPU
#: mesh, 2 layers with 2 windows 108 ms (both on 2 shared cores): the 14-method x 2-seed
#: table needs the small one (docs/results.md: its 300-step form took 70 minutes there).
SIZES = {
    "quick": TransformerConfig(vocab_size=VOCAB, d_model=32, num_heads=2, num_kv_heads=2,
                               num_layers=1, mlp_dim=128),
    "default": TransformerConfig(vocab_size=VOCAB, d_model=64, num_heads=4, num_kv_heads=4,
                                 num_layers=2, mlp_dim=256),
    "large": TransformerConfig(vocab_size=VOCAB, d_model=256, num_heads=4, num_kv_heads=4,
                               num_layers=3, mlp_dim=1024),
}
#: Bytes of context per sequence for each size.
CONTEXT = {"quick": 32, "default": 32, "large": 32}
#: AdamW learning rate of each size. At 3e-3 the large size's training loss jumped (seed 0,
#: 100-step means: fp32 1.751 -> 1.820 at step 1,100, fp32-hier 1.631 -> 1.747 at 2,100), and
#: the two, the same mean up to float order, ended 2.9% apart in held-out loss after 3,000
#: steps; 1e-3 is 3e-3 scaled down for the 4x width (docs/results.md).
LR = {"quick": 3e-3, "default": 3e-3, "large": 1e-3}


def init_gpt(config: TransformerConfig, seed: int = 0):
  """Builds the model; returns ``(graphdef, params)`` with ``params`` a pure dict."""
  model = TransformerLM(config, make_attention("dense"), rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def lm_loss(graphdef):
  """``loss(params, (tokens, targets))``: mean next-token cross-entropy in nats.

  ``tokens`` and ``targets`` are ``(B, S)`` int; positions are ``0 .. S-1`` in every row.
  """

  def loss(params, batch) -> jax.Array:
    tokens, targets = batch
    logits = nnx.merge(graphdef, params)(tokens, jnp.arange(tokens.shape[1]))
    return next_token_loss(logits, targets) / targets.size

  return loss

