"""PRNG keys from a seed or a passed key, legacy ``uint32`` or typed ``jax.random.key``.

Every factory that draws randomness takes ``seed``: an int, a typed key
(``jax.random.key(0)``) or a legacy raw key (``jax.random.PRNGKey(0)``). The draws of an
int seed and of either key made from it are identical (the same key data), except where
one seed makes several keys (:func:`nth_key`).
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


def _typed(value: jax.Array) -> bool:
  return jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def check_seed(name: str, value: Any, *, raw: bool = False) -> int | jax.Array:
  """Validates an int seed or a PRNG key at construction; returns it unchanged.

  With ``raw`` (state that keeps a legacy ``uint32`` key, e.g. one sent in a payload) a typed
  key must be of the default implementation, whose key data is such a key (:func:`raw_key`).

  Raises:
    TypeError: naming ``name``, for anything else (a bool, a float, a batch of keys), or with
      ``raw`` a typed key of another implementation.
  """
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return int(value)
  if not is_key(value):
    raise TypeError(f"{name} must be an int seed, a jax.random.key(...) or a "
                    f"jax.random.PRNGKey(...); got {value!r}.")
  default = jax.config.jax_default_prng_impl
  if raw and _typed(value) and str(jax.random.key_impl(value)) != default:
    raise TypeError(f"{name} must be a key of the default {default!r} implementation (its "
                    f"state keeps a uint32 key), got one of {jax.random.key_impl(value)}.")
  return value


def as_key(seed: int | jax.Array) -> jax.Array:
  """The key of a value accepted by :func:`check_seed`: ``jax.random.PRNGKey(seed)`` for an
  int (the state keeps the legacy layout it always had), the key itself otherwise."""
  return jax.random.PRNGKey(seed) if isinstance(seed, int) else seed


def raw_key(seed: int | jax.Array) -> jax.Array:
  """The legacy ``uint32`` key of a value accepted by ``check_seed(..., raw=True)``: the same
  key data for an int, a typed key made from it and a legacy key made from it."""
  if isinstance(seed, int):
    return jax.random.PRNGKey(seed)
  return jax.random.key_data(seed) if _typed(seed) else seed


def nth_key(seed: int | jax.Array, index: int) -> jax.Array:
  """The key of the ``index``-th of several independent draws from one seed:
  ``PRNGKey(seed + index)`` for an int (the layout PowerSGD's per-leaf warm starts always
  had, so an int seed draws what it drew before), ``fold_in(key, index)`` for a key (typed
  or legacy alike). An int seed and a key made from it draw different keys here."""
  if isinstance(seed, int):
    return jax.random.PRNGKey(seed + index)
  return jax.random.fold_in(seed, index)


def unread_key() -> jax.Array:
  """The key handed to deterministic compressors (scaled sign, top-k): ``encode`` takes a
  key by contract and never reads it, so no seed is worth exposing."""
  return jax.random.key(0)
