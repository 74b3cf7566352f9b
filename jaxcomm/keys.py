"""PRNG keys from a seed or a passed key, legacy ``uint32`` or typed ``jax.random.key``.

Every factory that draws randomness takes ``seed``: an int, a typed key
(``jax.random.key(0)``) or a legacy raw key (``jax.random.PRNGKey(0)``). The draws of an
int seed and of either key made from it are identical (the same key data).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_key(value: Any) -> bool:
  """Whether ``value`` is a typed key of shape ``()`` or a legacy ``uint32`` key ``(2,)``."""
  if not isinstance(value, jax.Array):
    return False
  if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    return value.shape == ()
  return value.dtype == jnp.uint32 and value.shape == (2,)


def check_seed(name: str, value: Any) -> int | jax.Array:
  """Validates an int seed or a PRNG key at construction; returns it unchanged.

  Raises:
    TypeError: naming ``name``, for anything else (a bool, a float, a batch of keys).
  """
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value)
  if is_key(value):
    return value
  raise TypeError(f"{name} must be an int seed, a jax.random.key(...) or a "
                  f"jax.random.PRNGKey(...); got {value!r}.")


def as_key(seed: int | jax.Array) -> jax.Array:
  """The key of a value accepted by :func:`check_seed`: ``jax.random.PRNGKey(seed)`` for an
  int (the state keeps the legacy layout it always had), the key itself otherwise."""
  return jax.random.PRNGKey(seed) if isinstance(seed, int) else seed


def unread_key() -> jax.Array:
  """The key handed to deterministic compressors (scaled sign, top-k): ``encode`` takes a
  key by contract and never reads it, so no seed is worth exposing."""
  return jax.random.key(0)
