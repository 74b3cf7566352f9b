"""Counter-based random numbers: an integer hash of (element index, key words).

``jax.random`` draws bits with threefry (or rbg), about 0.6 GB/s of float32 output on a CPU
core whatever the implementation; stochastic rounding needs one draw per element, so it was
the whole cost of the unbiased quantizers. Here bit ``i`` of a call is
``mix(mix(i ^ k0) + k1)`` with ``mix`` the 32-bit finalizer of MurmurHash3 (two xor-shifts and
two multiplications by odd constants, a bijection of uint32) and ``(k0, k1)`` the words of the
call's PRNG key: about a dozen uint32 operations per element, which XLA fuses into the
consumer's loop. Where that hash is the cost (QSGD), one round, ``mix((i + k1) * m)`` with an
odd ``m`` hashed from both words, halves it (:func:`bits_at`). The key still comes from the
caller (per device, per step, or shared where linearity needs it); only the expansion of a key
into per-element bits changes.

The bits are not cryptographic. What the compressors need, and what the tests check with fixed
keys, is that the uniforms are uniform (a chi-square test of their histogram), that two keys
give unrelated streams, and that stochastic rounding with them is unbiased to within the
standard error of the test.

References:
  Appleby, MurmurHash3 (the ``fmix32`` finalizer), 2011; Salmon et al., "Parallel Random
  Numbers: As Easy as 1, 2, 3", SC 2011 (counter-based generators).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

UNIFORM_BITS = 24


def key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two uint32 scalars from a PRNG key: a raw ``uint32`` key array or a typed key."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words = key.reshape(-1).astype(jnp.uint32)
  return words[0], words[-1]


def mix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's ``fmix32`` finalizer on uint32: a bijection with full avalanche."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def hash_bits(key: jax.Array, shape: tuple[int, ...], offset: int | jax.Array = 0
              ) -> jax.Array:
  """32 random bits per element: uint32 of ``shape``, element ``i`` (row-major) from index
  ``i + offset`` (modulo 2^32; ``offset`` may be traced) and the key's words."""
  count = 1
  for dim in shape:
    count *= dim
  index = jax.lax.iota(jnp.uint32, count) + jnp.asarray(offset).astype(jnp.uint32)
  return bits_at(key, index).reshape(shape)


def bits_at(key: jax.Array, index: jax.Array, *, rounds: int = 2) -> jax.Array:
  """32 random bits for each element number in ``index`` (uint32, any shape): bit ``i`` of a
  call, whatever positions of it are drawn, so a strided slice of the elements can hash its own.

  ``rounds=2``: ``mix32(mix32(i ^ k0) + k1)``. ``rounds=1``: ``mix32((i + k1) * m)`` with the
  odd multiplier ``m = mix32(k0 ^ mix32(k1)) | 1`` hashed once per call, so a key's counter is
  a Weyl sequence (steps of ``m``) and every key word changes the multiplier: half the
  element-wise work (two multiplications and three xor-shifts, not four and six), for callers
  whose cost is the hash (QSGD's encode at 16M: 21.4 -> 16.3 ms of CPU). Keys whose words
  are equal except ``k1`` do not give shifted copies of one stream, as ``i + k1`` alone
  would; two keys share a multiplier with probability about ``2^-31``. With two rounds, raw
  keys whose ``k0`` differ in low bits give streams of neighbours permuted (``i ^ k0``);
  keys from ``jax.random.split`` or ``fold_in`` do not relate so.
  """
  k0, k1 = key_words(key)
  if rounds == 1:
    return mix32((index + k1) * (mix32(k0 ^ mix32(k1)) | jnp.uint32(1)))
  if rounds != 2:
    raise ValueError(f"rounds must be 1 or 2, got {rounds!r}.")
  return mix32(mix32(index ^ k0) + k1)


def hash_uniform(key: jax.Array, shape: tuple[int, ...], *, index: jax.Array | None = None,
                 rounds: int = 2) -> jax.Array:
  """float32 uniforms on ``[0, 1)`` in steps of ``2^-24`` (the top 24 bits of :func:`bits_at`
  with ``rounds``) of the elements' row-major positions, or with ``index`` (uint32 of
  ``shape``) of the element numbers it lists."""
  if index is None:
    index = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
  words = bits_at(key, index, rounds=rounds)
  return (words >> (32 - UNIFORM_BITS)).astype(jnp.float32) * jnp.float32(2.0**-UNIFORM_BITS)


def bernoulli(key: jax.Array, probability: jax.Array, *, index: jax.Array | None = None,
              rounds: int = 2) -> jax.Array:
  """bool of ``probability``'s shape: ``True`` with probability ``probability`` (clipped to
  ``[0, 1]``), exactly ``ceil(2^24 p) / 2^24``, i.e. within ``2^-24`` above ``p``. ``index``
  and ``rounds``: as in :func:`hash_uniform`."""
  return hash_uniform(key, probability.shape, index=index, rounds=rounds) < probability


def stochastic_round(values: jax.Array, key: jax.Array, *, index: jax.Array | None = None
                     ) -> jax.Array:
  """``floor(v) + Bernoulli(v - floor(v))``: unbiased up to ``2^-24`` per element. ``index``:
  the elements' numbers, as in :func:`hash_uniform`."""
  floor = jnp.floor(values)
  return floor + bernoulli(key, values - floor, index=index)
