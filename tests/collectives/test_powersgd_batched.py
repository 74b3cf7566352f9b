"""PowerSGD's collective batches every leaf's Gram-Schmidt and state check (session 18):
leaves of different shapes give what each gives alone, and a bad leaf stays its own."""

import functools

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fast_random
import jaxcomm

AXES = ("host", "local")
# Three groups of row blocks and three widths m of P (8, 16, 24) on 2x4: one padded batch.
SHAPES = {"a": (30, 8), "b": (12, 16), "c": (5, 7, 24), "d": (40, 16), "bias": (16,)}


def _stepper(mesh, tx, params):
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), specs),
                     out_specs=(P(), specs))
  def run(grads, opt_state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), opt_state)

  return run, state


def _grads(names, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(SHAPES))
  return {name: fast_random.normal(key, (8,) + SHAPES[name])
          for key, name in zip(keys, SHAPES) if name in names}


@pytest.mark.parametrize("rank", [1, 4])
def test_leaves_together_are_each_leaf_alone(rank):
  """Two steps (the second warm-started) of all leaves in one collective against each
  factorized leaf alone: equal up to rounding (the batch pads ``P^T`` to the widest ``m``)."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = _grads(SHAPES)
  tx = jaxcomm.powersgd_allreduce(rank=rank)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], grads))
  together, state_together = run(grads, state)
  together, _ = run(jax.tree.map(lambda g: -0.5 * g, grads), state_together)
  for index, name in enumerate(sorted(SHAPES)):  # the leaves' order in the state
    if name == "bias":
      continue
    alone_grads = {name: grads[name]}
    alone_run, alone_state = _stepper(mesh, tx, {name: grads[name][0]})
    alone_state = alone_state._replace(leaves=(state.leaves[index],))  # the same warm start
    alone, alone_state = alone_run(alone_grads, alone_state)
    alone, _ = alone_run(jax.tree.map(lambda g: -0.5 * g, alone_grads), alone_state)
    np.testing.assert_allclose(together[name], alone[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_bad_leaf_leaves_the_other_leaves_alone(value):
  """A NaN or Inf in one leaf keeps that leaf's state; every other leaf (other groups, other
  widths in the same Gram-Schmidt batch and the same norm reduction) steps as on clean input,
  bit for bit."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  clean = _grads(SHAPES, seed=1)
  tx = jaxcomm.powersgd_allreduce(rank=4)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], clean))
  clean_out, moved = run(clean, state)
  bad = dict(clean, b=clean["b"].at[2, 3, 5].set(value))
  bad_out, kept = run(bad, state)
  names = sorted(SHAPES)  # the leaves' order in the state
  for name, leaf_moved, leaf_kept, leaf_old in zip(names, moved.leaves, kept.leaves,
                                                    state.leaves):
    if name == "b":
      chex.assert_trees_all_equal(leaf_kept, leaf_old)
    else:
      chex.assert_trees_all_equal(leaf_kept, leaf_moved)
      np.testing.assert_array_equal(bad_out[name], clean_out[name])
  chex.assert_tree_all_finite(kept.leaves)
