"""skip_nonfinite: a bad gradient on one device makes the whole chain skip, everywhere."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxcomm
from update_helpers import apply_fn
import fast_random

AXES = ("host", "local")


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_adam_momentum_does_not_move_parameters_on_a_skipped_step(bad):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {"w": jnp.ones((4, 16))}
  chain = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.25), nonfinite="propagate"),
                      optax.adam(0.1))
  tx = jaxcomm.skip_nonfinite(chain, AXES)
  state, step = apply_fn(tx, params, mesh)
  good = {"w": fast_random.normal(jax.random.PRNGKey(0), (8, 4, 16))}
  params, state = step(params, state, good)  # momentum is now non-zero
  poisoned = {"w": good["w"].at[6, 1, 2].set(bad)}
  after, skipped_state = step(params, state, poisoned)
  chex.assert_trees_all_equal(after, params)
  chex.assert_trees_all_equal(skipped_state.inner, state.inner)
  assert int(skipped_state.skipped_steps) == 1
  resumed, resumed_state = step(after, skipped_state, good)
  assert float(jnp.max(jnp.abs(resumed["w"] - after["w"]))) > 0
  chex.assert_tree_all_finite(resumed_state)


def test_bad_axes_are_refused():
  with pytest.raises(TypeError, match="axes"):
    jaxcomm.skip_nonfinite(optax.sgd(0.1), ())
