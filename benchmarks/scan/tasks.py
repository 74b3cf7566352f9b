"""The models the scan trains, each with its data, in a quick and a default size.

A :class:`Task` holds the initial parameters, the per-device loss, a deterministic batch for
every step (the same sequence for every method and mesh) and a fixed held-out set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

#: Examples per device per step.
BATCH = {"charlm": 32, "mlp": 32, "resnet": 8, "transformer": 8, "gpt": 2}


class Task(NamedTuple):
  """A model, its loss and its data.

  Attributes:
    name: the ``--models`` name.
    description: model and data in one line, with the parameter count.
    params: initial parameters, a pure-dict pytree.
    loss_fn: ``loss_fn(params, batch) -> scalar`` on one device's batch.
    batch: ``batch(step) -> pytree of numpy arrays`` with ``global_batch`` rows each.
    held_out: a fixed held-out batch.
    lr: the AdamW learning rate used with it.
  """
  name: str
  description: str
  params: Any
  loss_fn: Callable
  batch: Callable[[int], Any]
  held_out: Any
  lr: float


def _count(params) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(params))


def mlp(size: str, global_batch: int, steps: int, seed: int, hidden=None) -> Task:
  """The MLP classifier on a random teacher network's labels (5% label noise)."""
  from models.data import teacher_classification
  from models.mlp import classification_loss, init_mlp
  features, classes = 64, 10
  hidden = hidden or ((64,) if size == "quick" else (256, 256))
  graphdef, params = init_mlp(features, hidden, classes, seed=seed)
  samples = global_batch * steps
  inputs, labels = (np.asarray(a) for a in teacher_classification(
      seed, samples + 4096, features, classes))

  def batch(step):
    rows = slice(step * global_batch, (step + 1) * global_batch)
    return inputs[rows], labels[rows]

  return Task("mlp", f"MLP {features}-{'-'.join(map(str, hidden))}-{classes} "
              f"({_count(params):,} params) on teacher-network labels", params,
              classification_loss(graphdef), batch, (inputs[samples:], labels[samples:]), 1e-3)


def charlm(size: str, global_batch: int, steps: int, seed: int, hidden=None) -> Task:
  """Next-byte prediction on the standard library's source (held-out files held out)."""
  from models import text
  context, embed, widths = (16, 8, (128,)) if size == "quick" else (32, 16, (256,))
  hidden = hidden or widths
  corpus = text.load_corpus()
  graphdef, params = text.init_char_mlp(context, embed, hidden, seed=seed)
  inputs, targets = text.sample_windows(corpus.train, global_batch * steps, context, seed)
  held_out = text.sample_windows(corpus.held_out, 4096, context, seed + 1)

  def batch(step):
    rows = slice(step * global_batch, (step + 1) * global_batch)
    return inputs[rows], targets[rows]

  return Task("charlm", f"char-MLP LM, {context}-byte context, embed {embed}, hidden "
              f"{'-'.join(map(str, hidden))} ({_count(params):,} params) on "
              f"{len(corpus.files[0])} stdlib files ({len(corpus.train):,} bytes), held-out "
              f"{len(corpus.files[1])} other files", params, text.next_byte_loss(graphdef),
              batch, held_out, 3e-3)


def resnet(size: str, global_batch: int, steps: int, seed: int, hidden=None) -> Task:
  """The CIFAR-style ResNet on generated template images (10 classes); ``hidden`` is unused
  (the widths are the profile's)."""
  del hidden
  from models.resnet import image_loss, init_resnet, template_images
  widths, image_size = ((8, 16, 32), 16) if size == "quick" else ((16, 32, 64), 32)
  graphdef, params = init_resnet(widths, blocks=1, classes=10, seed=seed)
  samples = global_batch * steps
  images, labels = (np.asarray(a) for a in template_images(seed, samples + 512, 10,
                                                           image_size))

  def batch(step):
    rows = slice(step * global_batch, (step + 1) * global_batch)
    return images[rows], labels[rows]

  return Task("resnet", f"ResNet widths {'-'.join(map(str, widths))} ({_count(params):,} "
              f"params) on {image_size}x{image_size} template images",
              params, image_loss(graphdef), batch, (images[samples:], labels[samples:]), 1e-3)


def transformer(size: str, global_batch: int, steps: int, seed: int, hidden=None) -> Task:
  """The sequence-parallel issue's transformer LM (dense attention) on the stdlib corpus:
  next-byte prediction at every position of each window."""
  from flax import nnx

  from models import text
  from models.gpt import lm_loss
  from models.transformer import TransformerConfig, TransformerLM, make_attention
  context, width, layers = (32, 32, 1) if size == "quick" else (64, 64, 2)
  width = hidden[0] if hidden else width
  config = TransformerConfig(vocab_size=256, d_model=width, num_heads=4, num_kv_heads=2,
                             num_layers=layers, mlp_dim=2 * width)
  graphdef, state = nnx.split(TransformerLM(config, make_attention("dense"),
                                            rngs=nnx.Rngs(seed)))
  params = nnx.to_pure_dict(state)
  corpus = text.load_corpus()
  tokens, targets = text.sample_sequences(corpus.train, global_batch * steps, context, seed)

  def batch(step):
    rows = slice(step * global_batch, (step + 1) * global_batch)
    return tokens[rows], targets[rows]

  return Task("transformer", f"transformer LM, {layers} layers, d_model {width}, GQA 4/2 heads, "
              f"{context}-byte context ({_count(params):,} params) on the stdlib corpus",
              params, lm_loss(graphdef), batch,
              text.sample_sequences(corpus.held_out, 1024, context, seed + 1), 3e-3)


def gpt(size: str, global_batch: int, steps: int, seed: int, hidden=None) -> Task:
  """The quality task: :mod:`models.gpt` (pre-norm, rotary, GELU, tied embedding) on the
  English documentation topics of ``pydoc_data``, split by topic; the held-out loss is over
  every whole window of the held-out topics. ``hidden`` overrides the width (``d_model``,
  MLP 4x)."""
  import dataclasses

  from models import gpt as model, text
  size = size if size in model.SIZES else "default"
  config = model.SIZES[size]
  if hidden:
    config = dataclasses.replace(config, d_model=hidden[0], mlp_dim=4 * hidden[0])
  context = model.CONTEXT[size]
  graphdef, params = model.init_gpt(config, seed=seed)
  corpus = text.load_pydoc_corpus()
  tokens, targets = text.sample_sequences(corpus.train, global_batch * steps, context, seed)

  def batch(step):
    rows = slice(step * global_batch, (step + 1) * global_batch)
    return tokens[rows], targets[rows]

  return Task("gpt", f"GPT, {config.num_layers} layers, d_model {config.d_model}, "
              f"{config.num_heads} heads, MLP {config.mlp_dim}, {context}-byte context "
              f"({_count(params):,} params) on {len(corpus.files[0])} pydoc topics "
              f"({len(corpus.train):,} bytes), held-out {len(corpus.files[1])} other topics",
              params, model.lm_loss(graphdef), batch,
              text.tile_sequences(corpus.held_out, context), model.LR[size])


#: ``factory(size, global_batch, steps, seed, hidden=None)``; ``hidden`` overrides the widths.
TASKS: dict[str, Callable[..., Task]] = {
    "charlm": charlm, "mlp": mlp, "resnet": resnet, "transformer": transformer, "gpt": gpt}
