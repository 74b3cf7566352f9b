"""Seeds and keys: an int seed, a typed ``jax.random.key`` and a legacy ``PRNGKey`` are one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm import compress
from jaxcomm.keys import as_key, check_seed, is_key

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
