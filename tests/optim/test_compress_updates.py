"""compress_updates: the optimizer per host, its updates compressed across hosts.

Exact identities: without compression (None or the identity compressor) it is the uncompressed
chain ``compressed_allreduce() -> inner`` for a linear inner optimizer on several hosts and for
Adam on one host; a NaN step leaves every state unchanged.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm
from update_helpers import apply_fn

PARAMS = {"b": jnp.zeros((5,)), "s": jnp.zeros(()), "w": jnp.ones((6, 7))}


def _grads(step: int, devices: int):
  keys = jax.random.split(jax.random.PRNGKey(step), 3)
  return {"b": jax.random.normal(keys[0], (devices, 5)),
          "s": jax.random.normal(keys[1], (devices,)),
          "w": jax.random.t(keys[2], 2.0, (devices, 6, 7))}


def _train(tx, mesh, steps=3, grads=_grads):
  """``[(params, state)]`` after each of ``steps`` steps (one compilation)."""
  state, step = apply_fn(tx, PARAMS, mesh)
  params, history = PARAMS, []
  for t in range(steps):
    params, state = step(params, state, grads(t, mesh.size))
    history.append((params, state))
  return history


INNERS = {"sgdm": lambda: optax.sgd(0.1, momentum=0.9),
          "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1)}


@functools.cache
def _uncompressed(hosts: int, local: int, inner: str):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  return _train(optax.chain(jaxcomm.compressed_allreduce(), INNERS[inner]()), mesh)[-1][0]


@pytest.mark.parametrize("hosts, local, inner, compressor", [
    (2, 4, "sgdm", None),
    (2, 4, "sgdm", jaxcomm.identity()),
    (1, 8, "adamw", jaxcomm.identity()),
])
def test_without_compression_it_is_the_uncompressed_chain(hosts, local, inner, compressor):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  got = _train(jaxcomm.optim.compress_updates(INNERS[inner](), compressor), mesh)[-1][0]
  chex.assert_trees_all_close(got, _uncompressed(hosts, local, inner), rtol=1e-6, atol=1e-7)


def test_topk_residual_conserves_the_update_mass():
  """With a linear inner optimizer (SGD, lr 1) the host updates are ``-g_h``: what was applied
  plus what the residuals still hold is the sum of the mean gradients, exactly."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.optim.compress_updates(optax.sgd(1.0), jaxcomm.topk(0.1))
  params, state = _train(tx, mesh, steps=4)[-1]
  sent = -np.concatenate([np.ravel(params[k] - PARAMS[k]) for k in sorted(PARAMS)])
  true = sum(np.concatenate([np.asarray(_grads(t, 8)[k]).reshape(8, -1).mean(0)
                             for k in sorted(PARAMS)]) for t in range(4))
  pending = []
  for leaf_states, key in zip(state.allreduce.level_states, sorted(PARAMS)):
    residual = np.asarray(leaf_states[1].residual).reshape(2, 4, -1)  # (hosts, local, shard)
    size = PARAMS[key].size
    pending.append(-residual.sum(axis=0).reshape(-1)[:size])  # inputs pre-divided by 8
  np.testing.assert_allclose(sent + np.concatenate(pending), true, rtol=1e-5, atol=1e-5)
  assert np.abs(np.concatenate(pending)).max() > 0  # top-10% really held something back


def test_a_nonfinite_step_changes_nothing():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.optim.compress_updates(optax.adam(1e-2), jaxcomm.topk(0.2))

  def poisoned(step, devices):
    grads = _grads(step, devices)
    return ({**grads, "b": grads["b"].at[3, 0].set(jnp.nan)} if step == 2 else grads)

  (params2, state2), (params3, state3) = _train(tx, mesh, steps=3, grads=poisoned)[1:]
  chex.assert_trees_all_equal(params3, params2)
  chex.assert_trees_all_equal(state3.inner, state2.inner)
  assert int(state3.allreduce.skipped_steps) == 1


def test_bad_input_raises_naming_the_argument():
  with pytest.raises(TypeError, match="inner"):
    jaxcomm.optim.compress_updates("adam")
  with pytest.raises(ValueError, match="compressor=powersgd"):
    jaxcomm.optim.compress_updates(optax.adam(1e-3), jaxcomm.powersgd(1))
  with pytest.raises(ValueError, match="feedback"):
    jaxcomm.optim.compress_updates(optax.adam(1e-3), jaxcomm.topk(0.1), feedback="late")
  with pytest.raises(TypeError, match="host_variance=True"):
    jaxcomm.optim.compress_updates(optax.GradientTransformation(*optax.adam(1e-3)[:2]),
                                   host_variance=True)
  with pytest.raises(ValueError, match="b2 must be in"):
    jaxcomm.optim.host_adamw(1e-3, b2=1.0)
  with pytest.raises(TypeError, match="host_variance= and hosts="):
    tx = jaxcomm.optim.scale_by_host_adam()
    tx.update(PARAMS, tx.init(PARAMS))


def test_host_variance_is_the_variance_of_the_host_mean():
  """An inner optimizer that returns the ``host_variance`` it is given: the output is its mean
  over hosts, ``mean_h var(g_h,d, ddof=1) / G``."""
  report = optax.GradientTransformationExtraArgs(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None, *, host_variance, hosts: (
          jax.tree.map(lambda v: v * hosts / 2, host_variance), state))
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, _ = _train(jaxcomm.optim.compress_updates(report, host_variance=True), mesh,
                     steps=1)[-1]
  for key in PARAMS:
    grads = np.asarray(_grads(0, 8)[key]).reshape(2, 4, -1)
    want = (grads.var(axis=1, ddof=1) / 4).mean(axis=0).reshape(PARAMS[key].shape)
    np.testing.assert_allclose(np.asarray(params[key] - PARAMS[key]), want, rtol=1e-5,
                               atol=1e-6)


def test_host_adamw_is_adamw_without_device_noise():
  """Every device of a host with the same gradient: the host mean has no estimated variance
  and ``host_adamw`` is ``optax.adamw``."""
  def shared(step, devices):
    return jax.tree.map(lambda g: jnp.repeat(g[:2], devices // 2, axis=0), _grads(step, 2))

  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  want = _train(jaxcomm.optim.compress_updates(optax.adamw(1e-2, weight_decay=0.1)), mesh,
                grads=shared)[-1][0]
  got = _train(jaxcomm.optim.compress_updates(jaxcomm.optim.host_adamw(1e-2, weight_decay=0.1),
                                              host_variance=True), mesh, grads=shared)[-1][0]
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_scale_by_host_adam_subtracts_the_excess_variance():
  """Two steps against the formula: ``m_hat / (sqrt(max(v_hat - (1 - 1/H) w_hat, v_hat / H))
  + eps)``, one coordinate on the floor."""
  tx = jaxcomm.optim.scale_by_host_adam(b1=0.5, b2=0.75, eps=0.0)
  g = [jnp.array([1.0, -2.0, 0.5]), jnp.array([3.0, 1.0, -0.5])]
  w = [jnp.array([0.5, 1.0, 0.0]), jnp.array([0.25, 100.0, 0.0])]
  state = tx.init(g[0])
  for t in range(2):
    out, state = tx.update(g[t], state, host_variance=w[t], hosts=4)
  m = 0.5 * 0.5 * g[0] + 0.5 * g[1]
  v = 0.75 * 0.25 * g[0] ** 2 + 0.25 * g[1] ** 2
  noise = 0.75 * 0.25 * w[0] + 0.25 * w[1]
  v_global = np.maximum(v - 0.75 * noise, v / 4) / (1 - 0.75 ** 2)
  np.testing.assert_allclose(out, m / (1 - 0.25) / np.sqrt(v_global), rtol=1e-6)
  assert v[1] - 0.75 * noise[1] < v[1] / 4  # the floor acted on one coordinate
