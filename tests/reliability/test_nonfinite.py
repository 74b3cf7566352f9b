"""Non-finite gradients: skip together, zero, or propagate; residuals never poisoned."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting
from update_helpers import update_fn
from models.data import teacher_classification
from models.mlp import classification_loss, init_mlp

AXES = ("host", "local")
SHAPES = {"w": (24, 10), "b": (10,)}
BAD_STEP, BAD_DEVICE = 2, 5
CONFIGS = {
    "topk-gather": dict(compressor=jaxcomm.topk(0.2), strategy="gather"),
    "sign-two-phase": dict(compressor=jaxcomm.sign(), strategy="two_phase"),
    "sign-ef21-gather": dict(compressor=jaxcomm.sign(), strategy="gather"),
    "identity-linear": dict(compressor=jaxcomm.identity()),
}


def _grads(step, poison=None):
  """Per-device gradients ``(8, *shape)``; ``poison`` sets NaN and Inf on one device."""
  rng = np.random.default_rng(step)
  grads = {k: rng.standard_normal((8, *s)).astype(np.float32) for k, s in SHAPES.items()}
  if poison is not None:
    grads["w"][BAD_DEVICE, 3, 4] = poison[0]
    grads["b"][BAD_DEVICE, 7] = poison[1]
  return grads


def _runner(nonfinite, config):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(nonfinite=nonfinite, **config)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  state, update = update_fn(tx, params, mesh, every_device=True)  # each device's result
  return update, state


def _run(nonfinite, config, poison):
  update, state = _runner(nonfinite, config)
  means, states = [], [state]
  for step in range(5):
    mean, state = update(_grads(step, poison if step == BAD_STEP else None), state)
    means.append(jax.tree.map(np.asarray, mean))
    states.append(state)
  return means, states


def _float_leaves(state):
  return [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.inexact)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_skip_every_device_skips_together_and_training_continues(name):
  means, states = _run("skip", CONFIGS[name], (np.nan, np.inf))
  for leaf in jax.tree.leaves(means[BAD_STEP]):
    np.testing.assert_array_equal(leaf, 0.0)  # zero updates on all 8 devices
  before, after = states[BAD_STEP], states[BAD_STEP + 1]
  chex.assert_trees_all_equal(after._replace(skipped_steps=before.skipped_steps), before)
  assert int(after.skipped_steps) == 1 and int(states[-1].skipped_steps) == 1
  for state in states:
    chex.assert_tree_all_finite(_float_leaves(state.level_states))
  # The later steps are exactly those of a run that never saw the bad step.
  update, state = _runner("skip", CONFIGS[name])
  for step in [s for s in range(5) if s != BAD_STEP]:
    mean, state = update(_grads(step), state)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, mean), means[step])
  chex.assert_trees_all_equal(state.level_states, states[-1].level_states)
  for leaf in jax.tree.leaves(means[-1]):
    assert np.all(leaf == leaf[:1]) and np.any(leaf != 0)  # devices agree, steps not zero


@pytest.mark.parametrize("poison", [(np.nan, np.nan), (np.inf, -np.inf)], ids=["nan", "inf"])
def test_zero_replaces_non_finite_entries_by_zero(poison):
  config = CONFIGS["topk-gather"]
  means, states = _run("zero", config, poison)
  update, state = _runner("zero", config)
  for step in range(5):
    clean = _grads(step, (0.0, 0.0) if step == BAD_STEP else None)
    mean, state = update(clean, state)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, mean), means[step])
  assert int(states[-1].skipped_steps) == 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_propagate_passes_them_on_but_never_into_residuals(name):
  means, states = _run("propagate", CONFIGS[name], (np.nan, np.inf))
  assert not all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(means[BAD_STEP]))
  for state in states:
    chex.assert_tree_all_finite(_float_leaves(state.level_states))
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(means[-1]))


def test_skip_costs_one_four_byte_agreement_and_nothing_else():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  reports = {}
  for mode in ("skip", "propagate"):
    tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.2), nonfinite=mode)
    state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
    step = jax.jit(jax.shard_map(
        lambda g, s, tx=tx: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
        in_specs=(P(AXES), specs), out_specs=(P(), specs)))
    reports[mode] = accounting.measure(step, _grads(0), state, mesh=mesh)
  extra = [op for op in reports["skip"].collectives if op not in reports["propagate"].collectives]
  assert len(extra) == 1 and extra[0].kind == "all-reduce" and extra[0].axes == AXES
  assert extra[0].bytes_per_device == pytest.approx(2 * 7 / 8 * 4)


def test_a_nan_batch_on_one_device_is_skipped_in_training():
  graphdef, params = init_mlp(16, [32], 4, seed=0)
  loss_fn = classification_loss(graphdef)
  inputs, labels = teacher_classification(0, 128 * 30, 16, 4)
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  # Plain SGD: a zero mean gradient leaves the parameters exactly as they were (a momentum
  # method after the allreduce would still move them; see docs/reliability.md).
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.1)), optax.sgd(0.5))
  params = jax.device_put(params, NamedSharding(mesh, P()))  # as the step returns it
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  step = jaxcomm.optim.data_parallel_step(loss_fn, tx, mesh, specs)
  losses = []
  for i in range(30):
    batch_inputs = inputs[i * 128:(i + 1) * 128]
    if i == 10:  # device 3's 16 examples: one NaN input -> NaN gradients there only
      batch_inputs = batch_inputs.at[3 * 16 + 2, 0].set(jnp.nan)
    before = params
    params, opt_state, loss = step(params, opt_state, (batch_inputs, labels[i * 128:(i + 1) * 128]))
    if i == 10:
      assert np.isnan(float(loss))
      chex.assert_trees_all_equal(params, before)
    else:
      losses.append(float(loss))
  assert int(opt_state[0].skipped_steps) == 1
  chex.assert_tree_all_finite((params, opt_state[0].level_states))
  assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5])


@pytest.mark.parametrize("kwargs, match", [
    ({"nonfinite": "ignore"}, "nonfinite must be one of skip, zero, propagate; got 'ignore'"),
    ({"residual_dtype": jnp.float16}, "residual_dtype must be one of float32, bfloat16"),
    ({"residual_dtype": "nope"}, "residual_dtype must be a dtype"),
])
def test_bad_options_name_the_parameter(kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    jaxcomm.compressed_allreduce(jaxcomm.topk(0.1), **kwargs)
