"""``jax.random.normal`` and ``uniform``, bit for bit, without a compilation per shape's rank.

With partitionable threefry (JAX's default) a draw's bits depend only on each element's flat
index, so a flat draw reshaped is the same array. XLA:CPU compiles the flat draw in about 0.2 s
of CPU, a rank-3 draw in about 2.5 s and a rank-4 draw in 3.5-5 s (LLVM over the small-trip
loop nests), once per shape: tests that draw many shapes pay that many times.
"""

import math

import jax


def normal(key: jax.Array, shape: tuple[int, ...] = (), dtype=float) -> jax.Array:
  """``jax.random.normal(key, shape, dtype)``: the same values, of shape ``shape``."""
  return jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)


def uniform(key: jax.Array, shape: tuple[int, ...] = (), dtype=float, minval=0.0,
            maxval=1.0) -> jax.Array:
  """``jax.random.uniform(key, shape, dtype, minval, maxval)``: the same values."""
  return jax.random.uniform(key, (math.prod(shape),), dtype, minval, maxval).reshape(shape)
