"""Seeds and keys: an int seed, a typed ``jax.random.key`` and a legacy ``PRNGKey`` are one."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm import compress
from jaxcomm._src.keys import as_key, check_seed, is_key, nth_key, raw_key
from update_helpers import update_fn
import fast_random

# The compressors that read the key of encode (stochastic rounding, private random indices);
# shared random indices, sketches and bases come from the compressor's seed, in its state.
RANDOM = {
    "quantize": lambda: compress.quantize(4),
    "qsgd": lambda: compress.qsgd(4),
    "terngrad": lambda: compress.terngrad(),
    "randomk_private": lambda: compress.randomk(0.25, shared=False),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_a_compressor_encodes_alike_with_a_typed_and_a_legacy_key(name):
  compressor = RANDOM[name]()
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 5))
  state = compressor.init(x.shape, x.dtype)

  def payload(key):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(compressor.encode(x, state, key)[0])]

  legacy = payload(jax.random.PRNGKey(3))
  for typed, ours in zip(legacy, payload(jax.random.key(3))):
    np.testing.assert_array_equal(ours, typed)
  assert any(not np.array_equal(a, b)  # the key is read: another one sends other values
             for a, b in zip(legacy, payload(jax.random.key(4))))


def test_seeds_and_both_kinds_of_key_are_accepted_and_draw_alike():
  typed, legacy = jax.random.key(7), jax.random.PRNGKey(7)
  assert check_seed("seed", 7) == 7 and check_seed("seed", np.int32(7)) == 7
  assert check_seed("seed", typed) is typed and check_seed("seed", legacy) is legacy
  draws = [jax.random.uniform(as_key(seed), (4,)) for seed in (7, typed, legacy)]
  np.testing.assert_array_equal(draws[0], draws[1])
  np.testing.assert_array_equal(draws[0], draws[2])
  assert as_key(7).dtype == jnp.uint32  # an int seed keeps the legacy state layout


@pytest.mark.parametrize("value", [True, 1.5, "0", None, jnp.zeros((3,), jnp.uint32),
                                   jax.random.split(jax.random.key(0), 2)])
def test_anything_else_is_a_type_error_naming_the_parameter(value):
  assert not is_key(value)
  with pytest.raises(TypeError, match="seed must be an int seed, a jax.random.key"):
    check_seed("seed", value)


# The compressors whose own state holds a key made from their seed (shared indices, hashes,
# bases, PowerSGD's first warm start).
SEEDED = {
    "randomk": lambda seed: compress.randomk(0.25, seed=seed),
    "count_sketch": lambda seed: compress.count_sketch(8, 3, seed=seed),
    "gradzip": lambda seed: compress.gradzip(2, seed=seed),
    "powersgd": lambda seed: compress.powersgd(2, seed=seed),
}


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_a_seeded_compressor_is_the_same_from_an_int_a_typed_and_a_legacy_key(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (12, 10))

  def run(seed):
    compressor = SEEDED[name](seed)
    payload, state = compressor.encode(x, compressor.init(x.shape, x.dtype),
                                       jax.random.PRNGKey(1))
    return [np.asarray(leaf) for leaf in jax.tree.leaves((payload, state))]

  from_int = run(3)
  for key in (jax.random.key(3), jax.random.PRNGKey(3)):
    chex.assert_trees_all_equal(run(key), from_int)
  assert any(not np.array_equal(a, b) for a, b in zip(from_int, run(4)))


@pytest.mark.parametrize("name", sorted(SEEDED))
@pytest.mark.parametrize("value", [1.5, True, "3", jax.random.split(jax.random.key(0), 2)])
def test_a_seeded_compressor_refuses_anything_else_naming_seed(name, value):
  with pytest.raises(TypeError, match="seed must be an int seed, a jax.random.key"):
    SEEDED[name](value)


@pytest.mark.parametrize("name", ["randomk", "count_sketch", "gradzip"])
def test_a_key_kept_as_uint32_must_be_of_the_default_implementation(name):
  with pytest.raises(TypeError, match="seed must be a key of the default 'threefry2x32'"):
    SEEDED[name](jax.random.key(0, impl="rbg"))


def test_nth_key_keeps_the_int_layout_and_folds_a_key():
  np.testing.assert_array_equal(nth_key(5, 2), jax.random.PRNGKey(7))
  np.testing.assert_array_equal(jax.random.key_data(nth_key(jax.random.key(5), 2)),
                                nth_key(jax.random.PRNGKey(5), 2))
  np.testing.assert_array_equal(raw_key(jax.random.key(5)), raw_key(5))


def _mean(tx, grads):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  state, update = update_fn(tx, jax.tree.map(lambda g: g[0], grads), mesh)
  return np.asarray(update(grads, state)[0]["w"])


GRADS = {"w": fast_random.normal(jax.random.PRNGKey(2), (8, 12, 10))}


def test_compressed_allreduce_draws_alike_from_an_int_and_a_typed_key():
  def mean(seed):  # stochastic rounding reads the step's key
    return _mean(jaxcomm.compressed_allreduce(compress.quantize(2), seed=seed), GRADS)

  np.testing.assert_array_equal(mean(jax.random.key(5)), mean(5))
  assert not np.array_equal(mean(6), mean(5))
  with pytest.raises(TypeError, match="seed must be an int seed, a jax.random.key"):
    jaxcomm.compressed_allreduce(seed=1.5)


def test_powersgd_allreduce_draws_alike_from_a_typed_and_a_legacy_key():
  def mean(seed):
    return _mean(jaxcomm.powersgd_allreduce(2, seed=seed), GRADS)

  np.testing.assert_array_equal(mean(jax.random.key(5)), mean(jax.random.PRNGKey(5)))
  with pytest.raises(TypeError, match="seed must be an int seed, a jax.random.key"):
    jaxcomm.powersgd_allreduce(seed="5")
