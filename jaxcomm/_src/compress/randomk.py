"""Random-k sparsification, with indices from a key shared over the axis (linear payloads)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm._src.compress.base import Compressor, num_elements, stateless_init
from jaxcomm._src.validation import check_bool, check_fraction, renamed
from jaxcomm._src.compress.hashing import hash_bits
from jaxcomm._src.keys import check_seed, raw_key


class RandomKState(NamedTuple):
  """State of shared random-k.

  Attributes:
    key: uint32 of shape ``(2,)``: the raw PRNG key of the next call, identical on every
      device (made from ``seed`` by ``init``, split once per ``encode``).
  """
  key: jax.Array


class SharedRandomKPayload(NamedTuple):
  """The wire format of shared random-k: values only; the receiver regenerates the indices.

  Attributes:
    values: float32 of shape ``(k,)``.
    key: uint32 of shape ``(2,)``: the key the indices were drawn from. It is the same on
      every device, so a ``psum`` keeps it as it is (see ``REPLICATED``) and sums the values.
  """
  values: jax.Array
  key: jax.Array
  REPLICATED = ("key",)


class RandomKPayload(NamedTuple):
  """The wire format of private random-k.

  Attributes:
    values: float32 of shape ``(k,)``.
    indices: int32 of shape ``(k,)``, flat positions, distinct.
  """
  values: jax.Array
  indices: jax.Array


def randomk_count(size: int, density: float) -> int:
  """``k = max(1, floor(density * d))``, capped at ``d``."""
  return min(size, max(1, math.floor(density * size)))


def uniform_below(first: jax.Array, second: jax.Array, bound: jax.Array) -> jax.Array:
  """``(first % n + second % n) % n`` for uint32 random words and ``n = bound <= 2^31``: a sum
  of two independent near-uniform residues, uniform on ``[0, n)`` up to ``(n / 2^32)^2``
  (one residue alone is off by up to ``n / 2^32``)."""
  bound = jnp.asarray(bound, jnp.uint32)
  return (first % bound + second % bound) % bound


def random_indices(key: jax.Array, size: int, count: int) -> jax.Array:
  """``count`` distinct positions in ``[0, size)``, each included with probability
  ``count / size``, as int32.

  Stratified sampling with a random rotation: the positions are cut into ``count`` strata of
  ``w = size // count`` (the last one takes the remainder), one position is drawn uniformly in
  each stratum, and all are shifted by one uniform ``c`` modulo ``size``. Averaged over ``c``,
  every position is kept with probability exactly ``count / size`` whatever the strata sizes
  (up to ``(size / 2^32)^2`` from the draws), so the unbiasedness and the variance of random-k
  hold as for a uniform subset; the kept positions are spread more evenly than a uniform
  subset's. Costs ``O(count)`` hashes (:mod:`~jaxcomm.compress.hashing`), no sort and no pass
  over ``size``.
  """
  if count == 0:
    return jnp.zeros((0,), jnp.int32)
  width = size // count
  stratum = jnp.arange(count, dtype=jnp.uint32)
  sizes = jnp.where(stratum == count - 1, size - (count - 1) * width, width)
  words = hash_bits(key, (4, count))
  within = uniform_below(words[0], words[1], sizes)
  shift = uniform_below(words[2, 0], words[3, 0], size)
  return ((stratum * width + within + shift) % jnp.uint32(size)).astype(jnp.int32)


def randomk(density: float | None = None, *, shared: bool = True, scale: bool = True,
            seed: int | jax.Array = 0, fraction: float | None = None) -> Compressor:
  """Keeps ``k = max(1, floor(density * d))`` random elements, each with probability ``k/d``.

  The positions are a stratified sample with a random rotation (:func:`random_indices`):
  distinct, each one kept with probability exactly ``k / d``, drawn in ``O(k)``.

  With ``shared=True`` the indices come from a PRNG key kept in the state, made from ``seed``
  and split once per call: identical on every device that calls ``encode`` the same number of
  times. The payload then carries only the values (and the 8-byte key), and payloads are
  linear: ``psum`` them (the key is replicated, not summed, see
  :func:`~jaxcomm.compress.psum_payload`). With ``shared=False`` the indices come from the
  ``encode`` key, differ per device, and are sent as int32.

  With ``scale=True`` decode multiplies by ``d / k`` with the ``k`` actually kept.

  Properties: with ``scale``, unbiased with variance ``E||C(x) - x||^2 = (d/k - 1) ||x||^2``;
  without, biased, a contraction ``E||C(x) - x||^2 = (1 - k/d) ||x||^2`` in expectation only
  (not on every call). Linear when ``shared``.

  Bytes: ``4 k + 8`` shared; ``8 k`` private.

  Args:
    density: fraction of elements to keep, in (0, 1].
    shared: draw indices from the shared state key (linear payload) instead of the call's key.
    scale: multiply by ``d / k`` so that the compressor is unbiased.
    seed: int seed or PRNG key (typed ``jax.random.key`` of the default implementation,
      or legacy ``PRNGKey``) of the shared key; the same on every device.
    fraction: the former name of ``density`` (deprecated).

  Returns:
    A :class:`~jaxcomm.Compressor` with :class:`SharedRandomKPayload` payloads and
    :class:`RandomKState` state (``shared``), or :class:`RandomKPayload` payloads.

  References:
    Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Wangni et al.,
    "Gradient Sparsification for Communication-Efficient Distributed Optimization",
    NeurIPS 2018.
  """
  density = check_fraction("density", renamed("density", density, "fraction", fraction))
  shared = check_bool("shared", shared)
  scale = check_bool("scale", scale)
  seed = check_seed("seed", seed, raw=True)

  def gain(size: int) -> float:
    count = randomk_count(size, density)
    return size / count if scale and count else 1.0  # an empty array keeps k = 0

  def init(shape, dtype):
    del dtype
    return RandomKState(jax.random.fold_in(raw_key(seed), num_elements(shape)))

  def scatter(values: jax.Array, indices: jax.Array, shape) -> jax.Array:
    size = num_elements(shape)
    dense = jnp.zeros(size, jnp.float32).at[indices].set(values * gain(size))
    return dense.reshape(shape)

  def encode(x: jax.Array, state, key: jax.Array):
    flat = x.reshape(-1).astype(jnp.float32)
    count = randomk_count(flat.shape[0], density)
    if shared:
      next_key, draw_key = jax.random.split(state.key)
      values = flat[random_indices(draw_key, flat.shape[0], count)]
      return SharedRandomKPayload(values, draw_key), RandomKState(next_key)
    indices = random_indices(key, flat.shape[0], count)
    return RandomKPayload(flat[indices], indices), state

  def decode(payload, shape) -> jax.Array:
    if shared:
      size = num_elements(shape)
      indices = random_indices(payload.key, size, payload.values.shape[0])
      return scatter(payload.values, indices, shape)
    return scatter(payload.values, payload.indices, shape)

  def subtract_decoded(x: jax.Array, payload) -> jax.Array:
    # Unscaled only: the kept entries minus their sent values, the rest of x as it is, with
    # no dense decode. Scaled, XLA would fuse x - v * (d / k) into one rounding (an FMA),
    # not the dense path's two.
    indices = (random_indices(payload.key, x.size, payload.values.shape[0]) if shared
               else payload.indices)
    flat = x.reshape(-1)
    return flat.at[indices].set(flat[indices] - payload.values).reshape(x.shape)

  def wire_bytes(shape, dtype) -> int:
    del dtype
    count = randomk_count(num_elements(shape), density)
    return 4 * count + 8 if shared else 8 * count

  options = ("" if shared else ", shared=False") + ("" if scale else ", scale=False")
  return Compressor(init=init if shared else stateless_init, encode=encode, decode=decode,
                    wire_bytes=wire_bytes, linear=shared, unbiased=scale,
                    name=f"randomk({density:g}{options})",
                    subtract_decoded=None if scale else subtract_decoded)
