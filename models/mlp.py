"""A multilayer-perceptron classifier (flax nnx) and its functional loss."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nnx.Module):
  """``Linear -> ReLU`` blocks followed by a linear classifier head.

  Args:
    in_features: input width.
    hidden: widths of the hidden layers.
    classes: number of output classes.
    rngs: flax random streams for initialization.
  """

  def __init__(self, in_features: int, hidden: Sequence[int], classes: int, *, rngs: nnx.Rngs):
    widths = [in_features, *hidden]
    self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])])
    self.head = nnx.Linear(widths[-1], classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Logits of shape ``(batch, classes)`` for inputs of shape ``(batch, in_features)``."""
    for layer in self.hidden:
      x = jax.nn.relu(layer(x))
    return self.head(x)


def init_mlp(in_features: int, hidden: Sequence[int], classes: int, seed: int = 0):
  """Builds an :class:`MLP` and splits it into a static graph and a pure-dict of parameters.

  Returns:
    ``(graphdef, params)``: ``params`` is a nested dict of arrays, a plain pytree for optax and
    ``shard_map``; ``nnx.merge(graphdef, params)`` rebuilds the module.
  """
  graphdef, state = nnx.split(MLP(in_features, hidden, classes, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def classification_loss(graphdef):
  """``loss(params, (inputs, labels))``: mean softmax cross-entropy of the merged module."""

  def loss(params, batch) -> jax.Array:
    inputs, labels = batch
    logits = nnx.merge(graphdef, params)(inputs)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

  return loss
