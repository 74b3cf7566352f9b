"""Generated data sets that need no download."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def teacher_classification(seed: int, samples: int, features: int, classes: int,
                           label_noise: float = 0.05) -> tuple[jax.Array, jax.Array]:
  """A classification task labelled by a random two-layer teacher network.

  Inputs are standard normal; labels are the argmax of a fixed random ``tanh`` network's logits,
  with a ``label_noise`` fraction replaced by uniform random classes so the optimal loss is
  not zero. The same seed always gives the same data.

  Returns:
    ``(inputs, labels)`` of shapes ``(samples, features)`` float32 and ``(samples,)`` int32.
  """
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  inputs = jax.random.normal(keys[0], (samples, features))
  hidden = jnp.tanh(inputs @ jax.random.normal(keys[1], (features, 4 * classes))
                    / jnp.sqrt(features))
  labels = jnp.argmax(hidden @ jax.random.normal(keys[2], (4 * classes, classes)), axis=1)
  noisy = jax.random.uniform(keys[3], (samples,)) < label_noise
  random_labels = jax.random.randint(keys[4], (samples,), 0, classes)
  return inputs, jnp.where(noisy, random_labels, labels).astype(jnp.int32)
