"""Composition: a sparsifier's kept values sent through a quantizer."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor


class ComposedState(NamedTuple):
  """State of :func:`compose`: the two compressors' own states."""
  sparsifier: Any
  quantizer: Any


def _values_struct(sparsifier: Compressor, shape, dtype) -> jax.ShapeDtypeStruct:
  """Static shape and dtype of the sparsifier's ``values`` for ``shape`` (traced, not run)."""
  def probe():
    state = sparsifier.init(tuple(shape), dtype)
    payload, _ = sparsifier.encode(jnp.zeros(shape, dtype), state, jax.random.PRNGKey(0))
    if not hasattr(payload, "values"):
      raise TypeError(f"compose needs a sparsifier whose payload has a 'values' field; "
                      f"{sparsifier.name} sends {type(payload).__name__}.")
    return payload.values
  return jax.eval_shape(probe)


def compose(sparsifier: Compressor, quantizer: Compressor) -> Compressor:
  """Sends the ``values`` of ``sparsifier``'s payload through ``quantizer``.

  For example ``compose(topk(0.01), quantize(8))`` sends top-1% with 8-bit values and int32
  indices, and ``compose(topk(0.01, chunk=65536), quantize(4))`` 4-bit values with uint16
  indices. The sparsifier must have a payload with a float32 ``values`` field
  (:func:`~jaxcomm.topk`, :func:`~jaxcomm.compress.randomk`,
  :func:`~jaxcomm.compress.threshold`); the quantizer sees the values as a flat array.

  Properties: unbiased when both are (e.g. scaled random-k with stochastic quantization; the
  quantization noise is independent of the selection); otherwise biased. For an unscaled
  sparsifier ``S`` (top-k, threshold) the errors add over disjoint supports,
  ``||C(x) - x||^2 = ||S(x) - x||^2 + ||Q(v) - v||^2`` with ``v`` the kept values, so a
  contraction of ``S`` survives when ``||Q(v) - v||^2`` is below its slack. Not linear.

  Bytes: ``wire_bytes(sparsifier) - k * itemsize(values) + wire_bytes(quantizer, (k,))``,
  with ``k`` the number of values (found by tracing the sparsifier, nothing is run).

  Args:
    sparsifier: a compressor whose payload has a ``values`` field.
    quantizer: any compressor, applied to the 1-D array of values.

  Returns:
    A :class:`~jaxcomm.Compressor` whose payload is the sparsifier's with ``values`` replaced
    by the quantizer's payload, and whose state is :class:`ComposedState`.

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018; Shi et al., "Understanding Top-k
    Sparsification in Distributed Deep Learning", 2019 (top-k with quantized values).
  """
  for label, value in (("sparsifier", sparsifier), ("quantizer", quantizer)):
    if not isinstance(value, Compressor):
      raise TypeError(f"{label} must be a jaxcomm.Compressor, got {type(value).__name__}.")

  def init(shape, dtype) -> ComposedState:
    values = _values_struct(sparsifier, shape, dtype)
    return ComposedState(sparsifier.init(shape, dtype),
                         quantizer.init((values.size,), jnp.float32))

  def encode(x: jax.Array, state: ComposedState, key: jax.Array):
    sparse_key, quantize_key = jax.random.split(key)
    sparse, sparse_state = sparsifier.encode(x, state.sparsifier, sparse_key)
    values, quantizer_state = quantizer.encode(sparse.values.reshape(-1), state.quantizer,
                                               quantize_key)
    return sparse._replace(values=values), ComposedState(sparse_state, quantizer_state)

  def decode(payload, shape) -> jax.Array:
    values = _values_struct(sparsifier, shape, jnp.float32)
    decoded = quantizer.decode(payload.values, (values.size,)).reshape(values.shape)
    return sparsifier.decode(payload._replace(values=decoded), shape)

  def wire_bytes(shape, dtype) -> int:
    values = _values_struct(sparsifier, shape, dtype)
    return (sparsifier.wire_bytes(shape, dtype) - values.size * values.dtype.itemsize
            + quantizer.wire_bytes((values.size,), jnp.float32))

  return Compressor(init=init, encode=encode, decode=decode, wire_bytes=wire_bytes,
                    linear=False, unbiased=sparsifier.unbiased and quantizer.unbiased,
                    name=f"{sparsifier.name}+{quantizer.name}")
