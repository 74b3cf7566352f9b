"""A small CIFAR-style ResNet (flax nnx) and a generated image-classification task.

The network follows He et al. 2016's CIFAR layout: a 3x3 stem, three stages of basic blocks
whose widths double and whose resolution halves (``32 -> 16 -> 8`` for 32x32 inputs), global
average pooling and a linear head. GroupNorm stands in for BatchNorm so that the parameters
are the whole state (no running statistics to synchronize across devices).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def _conv_kernel_init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
  """flax's default LeCun-normal kernel, drawn as its ``(h * w * in, out)`` matrix.

  The values are bit-identical to drawing ``shape`` directly (the same random bits, the same
  fan-in), but XLA's classic CPU emitters build the 2-D draw faster: in a one-device process a
  ``3x3x16x16`` draw takes about 10 s of CPU to compile, its matrix form under 1 s (with 8
  simulated devices the difference is about 1.3x).
  """
  matrix = nnx.initializers.lecun_normal()(key, (math.prod(shape[:-1]), shape[-1]), dtype)
  return matrix.reshape(shape)


def _standard_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``jax.random.normal(key, shape)``, bit-identical, drawn flat (faster to compile on CPU)."""
  return jax.random.normal(key, (math.prod(shape),)).reshape(shape)


def _conv(in_features: int, features: int, size: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
  return nnx.Conv(in_features, features, (size, size), strides=stride, use_bias=False,
                  kernel_init=_conv_kernel_init, rngs=rngs)


def _norm(features: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
  return nnx.GroupNorm(features, num_groups=min(4, features), rngs=rngs)


class BasicBlock(nnx.Module):
  """Two 3x3 convolutions with a residual connection (1x1 projection when the shape changes).

  Args:
    in_features: input channels.
    features: output channels.
    stride: stride of the first convolution (2 halves the resolution).
    rngs: flax random streams.
  """

  def __init__(self, in_features: int, features: int, stride: int, *, rngs: nnx.Rngs):
    self.conv1 = _conv(in_features, features, 3, stride, rngs)
    self.norm1 = _norm(features, rngs)
    self.conv2 = _conv(features, features, 3, 1, rngs)
    self.norm2 = _norm(features, rngs)
    self.shortcut = (_conv(in_features, features, 1, stride, rngs)
                     if stride != 1 or in_features != features else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``(batch, h, w, in_features) -> (batch, h / stride, w / stride, features)``."""
    y = jax.nn.relu(self.norm1(self.conv1(x)))
    y = self.norm2(self.conv2(y))
    return jax.nn.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nnx.Module):
  """CIFAR-style ResNet: stem, ``len(widths)`` stages of ``blocks`` blocks, pool, head.

  With ``widths=(16, 32, 64)`` and ``blocks=3`` this is ResNet-20 (0.27M parameters).

  Args:
    widths: channels of each stage; stages after the first halve the resolution.
    blocks: basic blocks per stage.
    classes: output classes.
    in_features: input channels.
    rngs: flax random streams.
  """

  def __init__(self, widths: Sequence[int] = (16, 32, 64), blocks: int = 1, classes: int = 10,
               in_features: int = 3, *, rngs: nnx.Rngs):
    self.stem = _conv(in_features, widths[0], 3, 1, rngs)
    self.stem_norm = _norm(widths[0], rngs)
    layers = []
    previous = widths[0]
    for stage, features in enumerate(widths):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        layers.append(BasicBlock(previous, features, stride, rngs=rngs))
        previous = features
    self.blocks = nnx.List(layers)
    self.head = nnx.Linear(previous, classes, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    """Logits ``(batch, classes)`` for ``images`` of shape ``(batch, h, w, in_features)``."""
    x = jax.nn.relu(self.stem_norm(self.stem(images)))
    for block in self.blocks:
      x = block(x)
    return self.head(jnp.mean(x, axis=(1, 2)))


def init_resnet(widths: Sequence[int] = (16, 32, 64), blocks: int = 1, classes: int = 10,
                seed: int = 0):
  """Builds a :class:`ResNet`; returns ``(graphdef, params)`` with ``params`` a pure dict."""
  graphdef, state = nnx.split(ResNet(tuple(widths), blocks, classes, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def image_loss(graphdef):
  """``loss(params, (images, labels))``: mean softmax cross-entropy."""

  def loss(params, batch) -> jax.Array:
    images, labels = batch
    logits = nnx.merge(graphdef, params)(images)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

  return loss


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def template_images(seed: int, samples: int, classes: int = 10, size: int = 32,
                    noise: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """A generated CIFAR-shaped task: a class's smooth template, shifted, plus pixel noise.

  Each class has a fixed random low-frequency 3-channel pattern (an ``8x8`` grid upsampled to
  ``size x size``). An example is its class's pattern rolled by a random offset of up to
  ``size/4`` pixels in each direction, plus standard-normal noise times ``noise``; the
  convolutional network must recognize the pattern wherever it sits. The templates depend
  only on ``seed``'s first key, so tasks drawn with the same ``seed`` share them.

  Returns:
    ``(images, labels)``: float32 ``(samples, size, size, 3)`` and int32 ``(samples,)``.
    Compiled once per ``(samples, classes, size)``.
  """
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  coarse = _standard_normal(keys[0], (classes, 8, 8, 3))
  templates = jax.image.resize(coarse, (classes, size, size, 3), method="linear")
  labels = jax.random.randint(keys[1], (samples,), 0, classes)
  shifts = jax.random.randint(keys[2], (samples, 2), -(size // 4), size // 4 + 1)
  images = jax.vmap(lambda label, shift: jnp.roll(templates[label], shift, axis=(0, 1)))(
      labels, shifts)
  return images + noise * _standard_normal(keys[3], images.shape), labels.astype(jnp.int32)
