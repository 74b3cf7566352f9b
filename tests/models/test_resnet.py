"""The CIFAR-style ResNet has the expected shapes and fits the generated template images."""

import chex
import jax
import pytest
from flax import nnx

from models import resnet

from fit_helpers import adam_losses


def _count(params):
  return sum(leaf.size for leaf in jax.tree.leaves(params))


def test_resnet20_shapes_and_size():
  abstract = nnx.eval_shape(lambda: resnet.ResNet((16, 32, 64), 3, rngs=nnx.Rngs(0)))
  assert _count(nnx.state(abstract, nnx.Param)) == pytest.approx(0.27e6, rel=0.03)
  graphdef, params = resnet.init_resnet((8, 16), blocks=1)
  images, labels = resnet.template_images(0, 4)
  assert images.shape == (4, 32, 32, 3) and labels.shape == (4,)
  logits = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), params, images)
  assert logits.shape == (4, 10)


def test_flat_draws_are_the_shaped_draws_bit_for_bit():
  key = jax.random.key(7)
  shape = (2, 2, 3, 4)
  chex.assert_trees_all_equal(resnet._conv_kernel_init(key, shape),
                              nnx.initializers.lecun_normal()(key, shape))
  chex.assert_trees_all_equal(resnet._standard_normal(key, shape),
                              jax.random.normal(key, shape))


def test_template_images_are_deterministic_and_share_templates():
  a, la = resnet.template_images(1, 16, size=16)
  b, lb = resnet.template_images(1, 16, size=16)
  assert (a == b).all() and (la == lb).all()


def test_small_resnet_learns_the_templates():
  graphdef, params = resnet.init_resnet((8, 16), blocks=1)
  loss_fn = resnet.image_loss(graphdef)
  batch = resnet.template_images(0, 64, size=16)
  losses = adam_losses(loss_fn, params, batch, steps=30)
  assert losses[-1] < 0.7 * losses[0]  # 2.5 -> 1.6 nats measured
