"""DeMo: the DCT, the block layout, the k = block-size identity, error feedback, bytes, quality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm._src.optim.demo import (block_layout, dct, dct_basis, demo, from_blocks,
                                     sparse_coefficients, to_blocks)
from lowcomm_helpers import eval_loss, sync_sgd, train
from update_helpers import apply_fn, measure_update, update_fn
import fast_random

HOSTS, LOCAL = 2, 4
PARAMS = {"w": jnp.zeros((12, 20)), "b": jnp.zeros((20,)), "t": jnp.zeros((3, 5, 8)),
          "m": jnp.zeros((16, 16))}


def host_grads(seed, params=PARAMS):
  """Per-device gradients ``(8, *shape)`` and their mean over each host's 4 devices."""
  keys = jax.random.split(jax.random.PRNGKey(seed), len(params))
  grads = {name: fast_random.normal(key, (HOSTS * LOCAL, *leaf.shape))
           for key, (name, leaf) in zip(keys, sorted(params.items()))}
  means = {name: g.reshape(HOSTS, LOCAL, *g.shape[1:]).mean(axis=1) for name, g in grads.items()}
  return grads, means


def test_dct_basis_is_orthonormal_and_matches_the_dct_ii_definition():
  for size in (1, 5, 8, 64):
    basis = dct_basis(size).astype(np.float64)
    np.testing.assert_allclose(basis @ basis.T, np.eye(size), atol=1e-6)
    x = np.random.default_rng(size).normal(size=size)
    n = np.arange(size)
    scale = np.where(n == 0, np.sqrt(1 / size), np.sqrt(2 / size))
    reference = scale[:, None] * np.cos(np.pi * (2 * n[None] + 1) * n[:, None] / (2 * size)) @ x
    np.testing.assert_allclose(basis @ x, reference, atol=1e-5)


@pytest.mark.parametrize("shape", [(12, 20), (20,), (3, 5, 8), (), (64, 64)])
def test_blocks_round_trip_and_the_2d_dct_inverts(shape):
  x = fast_random.normal(jax.random.PRNGKey(0), shape)
  layout = block_layout(shape, 8, LOCAL)
  blocks = to_blocks(x, layout, LOCAL)
  assert blocks.shape == (LOCAL * layout.per_device, *layout.block)
  np.testing.assert_array_equal(from_blocks(blocks, layout), x)
  np.testing.assert_allclose(dct(dct(blocks, layout), layout, inverse=True), blocks, atol=1e-5)
  # Parseval: an orthonormal transform keeps the energy of every block
  np.testing.assert_allclose(jnp.sum(dct(blocks, layout) ** 2), jnp.sum(blocks ** 2), rtol=1e-5)


def test_kept_coefficients_are_the_k_largest_of_each_block():
  x = fast_random.normal(jax.random.PRNGKey(1), (16, 16))
  layout = block_layout(x.shape, 8, 1)
  blocks = to_blocks(x, layout, 1)
  values, indices, kept = sparse_coefficients(blocks, layout, 5)
  coefficients = np.asarray(dct(blocks, layout)).reshape(4, -1)
  for row, chosen, sent in zip(coefficients, np.asarray(indices), np.asarray(values)):
    assert set(chosen) == set(np.argsort(-np.abs(row))[:5])
    np.testing.assert_allclose(sent, row[chosen], atol=1e-6)
  assert indices.dtype == jnp.uint16
  masked = np.where(np.abs(coefficients) >= np.sort(np.abs(coefficients))[:, -5:-4], coefficients, 0)
  np.testing.assert_allclose(dct(kept, layout).reshape(4, -1), masked, atol=1e-5)


@pytest.mark.parametrize("sign", [False, True])
def test_topk_equal_to_block_size_is_sgd_or_signsgd_on_the_mean_gradient(sign):
  lr, mesh = 0.1, jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  state, update = update_fn(demo(lr, beta=0.9, chunk=8, topk=64, sign=sign), PARAMS, mesh)
  for seed in range(3):
    grads, _ = host_grads(seed)
    out, state = update(grads, state)
    mean = {name: g.mean(axis=0) for name, g in grads.items()}
    for name, g in mean.items():
      if sign:  # away from zero, where float rounding of the DCT cannot flip a sign
        clear = np.abs(g) > 1e-3
        np.testing.assert_array_equal(np.asarray(out[name])[clear], -lr * np.sign(g)[clear])
      else:
        np.testing.assert_allclose(out[name], -lr * g, atol=1e-6)


def test_momentum_keeps_exactly_what_was_not_sent():
  lr, mesh = 0.5, jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  state, update = update_fn(demo(lr, chunk=8, topk=3, sign=False), PARAMS, mesh)
  grads, host_mean = host_grads(7)
  out, state = update(grads, state)
  for name, leaf in PARAMS.items():
    layout = block_layout(leaf.shape, 8, LOCAL)
    per_host = np.asarray(state.momentum[name]).reshape(HOSTS, -1, *layout.block)
    residual = np.stack([np.asarray(from_blocks(jnp.asarray(h), layout)) for h in per_host])
    # -update = mean_h q_h and residual_h = lr g_h - q_h: together the mean of lr g_h
    np.testing.assert_allclose(-np.asarray(out[name]) + residual.mean(axis=0),
                               lr * host_mean[name].mean(axis=0), atol=1e-5)
  # on unpadded blocks, the update holds at most k coefficients per block and host
  whole = block_layout((16, 16), 8, 1)
  sent = dct(to_blocks(-out["m"], whole, 1), whole).reshape(-1, whole.block_size)
  assert int(jnp.max(jnp.sum(jnp.abs(sent) > 1e-6, axis=1))) <= HOSTS * 3


@pytest.mark.parametrize("sign", [False, True])
def test_bytes_match_the_formula(sign):
  mesh, chunk, topk = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL), 8, 5
  report = measure_update(demo(0.1, chunk=chunk, topk=topk, sign=sign), PARAMS, mesh)
  layouts = [block_layout(leaf.shape, chunk, LOCAL) for leaf in PARAMS.values()]
  slow = sum((HOSTS - 1) * l.per_device * min(topk, l.block_size) * (4 + 2) for l in layouts)
  fast = sum((LOCAL - 1) * l.per_device * l.block_size * (4 + (1 if sign else 4))
             for l in layouts)
  assert report.link_bytes() == pytest.approx({"host": slow, "local": fast})


def test_trains_the_mlp_like_synchronous_sgd():
  baseline = eval_loss(sync_sgd(0.1, 60)[0])
  params, _, losses, _, _ = train(demo(0.01, chunk=8, topk=4), 60)
  assert eval_loss(params) < baseline + 0.05, (losses, baseline)
  assert losses[-1] < 0.5 * losses[0]


def test_learning_rate_schedule_and_weight_decay():
  mesh = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  params = {"w": jnp.ones((8, 8))}
  schedule = lambda count: 0.1 * (count + 1)  # noqa: E731
  grads = {"w": jnp.ones((8, 8, 8))}
  state, step = apply_fn(demo(schedule, chunk=8, topk=64, weight_decay=0.5), params, mesh)
  once, state = step(params, state, grads)
  twice, _ = step(once, state, grads)
  np.testing.assert_allclose(once["w"], 1 - 0.1 * (1 + 0.5), rtol=1e-6)
  np.testing.assert_allclose(twice["w"], once["w"] - 0.2 * (1 + 0.5 * once["w"]), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"chunk": 0}, r"chunk must be in \[1, 256\], got 0"),
    ({"chunk": 257}, r"chunk must be in \[1, 256\], got 257"),
    ({"topk": 0}, "topk must be >= 1, got 0"),
    ({"beta": 1.0}, r"beta must be in \[0, 1\), got 1.0"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite float >= 0, got -0.1"),
    ({"sign": 1}, "sign must be a bool, got 1"),
    ({"fast_axis": "host"}, "fast_axis and slow_axis must differ"),
])
def test_bad_arguments_raise_at_construction_naming_parameter_and_value(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    demo(0.1, **kwargs)
  with pytest.raises(ValueError, match="learning_rate must be a finite float > 0, got -1.0"):
    demo(-1.0)


def test_integer_leaves_are_refused_at_init_naming_the_leaf():
  mesh = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  with pytest.raises(TypeError, match=r"params\['steps'\] must be a float32"):
    update_fn(demo(0.1), {"w": jnp.zeros((4, 4)), "steps": jnp.zeros((4,), jnp.int32)}, mesh)
