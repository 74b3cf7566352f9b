"""The flat draws of fast_random are jax.random's draws, bit for bit."""

import jax
import numpy as np

import fast_random


def test_flat_draws_reshaped_equal_jax_random():
  # One rank-3 draw (each costs seconds to compile): a typed key for normal, a legacy one for
  # uniform with bounds.
  key, legacy = jax.random.key(3), jax.random.PRNGKey(2)
  np.testing.assert_array_equal(fast_random.normal(key, (2, 3, 4)),
                                jax.random.normal(key, (2, 3, 4)))
  np.testing.assert_array_equal(fast_random.uniform(legacy, (3, 4), minval=-2.0, maxval=3.0),
                                jax.random.uniform(legacy, (3, 4), minval=-2.0, maxval=3.0))
