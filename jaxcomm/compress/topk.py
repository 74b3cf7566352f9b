"""Top-k sparsification by magnitude."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm.compress.base import (Compressor, check_dtype, check_fraction, check_int_range,
                                   num_elements, stateless_init)

VALUE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class TopKPayload(NamedTuple):
  """The wire format of top-k: ``k`` values and their int32 flat indices.

  Attributes:
    values: shape ``(k,)``, the compressor's ``value_dtype``.
    indices: shape ``(k,)``, int32 positions in the flattened input.
  """
  values: jax.Array
  indices: jax.Array


def topk_count(shape: tuple[int, ...], fraction: float | None, k: int | None) -> int:
  """The static number of kept elements: ``max(1, floor(fraction * d))``, or ``min(k, d)``."""
  size = num_elements(shape)
  if k is not None:
    return min(k, size)
  return min(size, max(1, math.floor(fraction * size)))


def topk(fraction: float | None = None, *, k: int | None = None,
         value_dtype: Any = jnp.float32) -> Compressor:
  """Keeps the ``k`` largest-magnitude elements; all others are sent as zero.

  ``k = max(1, floor(fraction * d))`` for ``d`` elements (or the given ``k``, capped at ``d``),
  fixed at trace time so shapes are static under ``jit``. Ties in magnitude go to the lower
  index (``jax.lax.top_k`` is stable), so the choice is deterministic.

  Properties: biased; a delta-contraction with ``delta = k / d`` on every call,
  ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``; not linear (each device picks its own indices).
  Use it with :func:`~jaxcomm.error_feedback`.

  Bytes: ``k * (itemsize(value_dtype) + 4)``; ``8 k`` for float32 values.

  Args:
    fraction: fraction of elements to keep, in (0, 1]. Exactly one of ``fraction`` and ``k``.
    k: number of elements to keep, >= 1.
    value_dtype: dtype of the sent values: float32, bfloat16 or float16.

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`TopKPayload` payloads.

  References:
    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
    Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
  """
  if (fraction is None) == (k is None):
    raise ValueError(f"topk needs exactly one of fraction and k; got fraction={fraction!r}, k={k!r}.")
  if fraction is not None:
    fraction = check_fraction("fraction", fraction)
  else:
    k = check_int_range("k", k, 1)
  value_dtype = check_dtype("value_dtype", value_dtype, VALUE_DTYPES)

  def encode(x: jax.Array, state, key: jax.Array):
    del key
    flat = x.reshape(-1).astype(jnp.float32)
    _, indices = jax.lax.top_k(jnp.abs(flat), topk_count(x.shape, fraction, k))
    return TopKPayload(flat[indices].astype(value_dtype), indices.astype(jnp.int32)), state

  def decode(payload: TopKPayload, shape) -> jax.Array:
    dense = jnp.zeros(num_elements(shape), jnp.float32)
    return dense.at[payload.indices].set(payload.values.astype(jnp.float32)).reshape(shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    return topk_count(tuple(shape), fraction, k) * (value_dtype.itemsize + 4)

  amount = f"{fraction:g}" if fraction is not None else f"k={k}"
  return Compressor(init=stateless_init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=False, name=f"topk({amount})")
