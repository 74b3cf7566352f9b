"""jaxcomm._src.nonfinite: the one home of detection, agreement and keeping state."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm._src.nonfinite import (any_nonfinite, check_nonfinite_mode, has_nonfinite, keep_finite,
                                    keep_if, zero_if, zero_nonfinite)


def test_has_nonfinite_over_a_tree():
  good = {"a": jnp.ones(3), "b": (jnp.zeros((2, 2)), jnp.arange(4))}
  assert not bool(has_nonfinite(good)) and not bool(has_nonfinite([]))
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    assert bool(has_nonfinite({**good, "a": jnp.ones(3).at[1].set(bad)}))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_has_nonfinite_compiled_finds_every_position(dtype):
  # Compiled, large enough for XLA's CPU reduction kernels; huge finite values stay finite.
  x = jnp.full(40_000, jnp.finfo(dtype).max, dtype).at[::2].set(-1.5)
  check = jax.jit(has_nonfinite)
  assert not bool(check(x)) and not bool(check((x, jnp.arange(3))))
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    for position in (0, 16_383, 39_999):
      assert bool(check(x.at[position].set(bad))), (bad, position)
      assert bool(check((x, x.at[position].set(bad))))


def test_any_nonfinite_is_agreed_by_every_device():
  x = jnp.ones((4, 3)).at[2, 0].set(jnp.nan)
  agreed = jax.vmap(lambda row: any_nonfinite(row, ("d",)), axis_name="d")(x)
  np.testing.assert_array_equal(agreed, [True] * 4)
  agreed = jax.vmap(lambda row: any_nonfinite(row, ("d",)), axis_name="d")(jnp.ones((4, 3)))
  np.testing.assert_array_equal(agreed, [False] * 4)


def test_keep_if_keeps_every_leaf_or_only_floats():
  old = (jnp.zeros(2), jnp.array(3, jnp.int32))
  new = (jnp.ones(2), jnp.array(4, jnp.int32))
  chex.assert_trees_all_equal(keep_if(jnp.array(True), old, new), old)
  chex.assert_trees_all_equal(keep_if(jnp.array(False), old, new), new)
  chex.assert_trees_all_equal(keep_if(jnp.array(True), old, new, floats_only=True),
                              (old[0], new[1]))


def test_keep_finite_and_zeroing_are_entry_by_entry():
  new = jnp.array([1.0, jnp.nan, jnp.inf, 4.0])
  old = jnp.array([5.0, 6.0, 7.0, 8.0])
  chex.assert_trees_all_equal(keep_finite(new, old), jnp.array([1.0, 6.0, 7.0, 4.0]))
  chex.assert_trees_all_equal(zero_nonfinite(new), jnp.array([1.0, 0.0, 0.0, 4.0]))
  chex.assert_trees_all_equal(zero_if(jnp.array(True), [old]), [jnp.zeros(4)])
  chex.assert_trees_all_equal(zero_if(jnp.array(False), [old]), [old])


def test_modes_are_checked_by_name():
  assert check_nonfinite_mode("zero") == "zero"
  with pytest.raises(ValueError, match="nonfinite must be one of skip, zero, propagate; got 'nan'"):
    check_nonfinite_mode("nan")
