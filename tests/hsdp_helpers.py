"""Shared problems of the HSDP tests: small leaves that no mesh size divides."""

import jax
import jax.numpy as jnp
import pytest

import jaxcomm

# Leaves of 15, 4 and 7 elements: none a multiple of 4 or 8, so every one is padded.
SHAPES = {"w": (5, 3), "b": (4,), "c": (7,)}


def problem(shapes=None):
  """``(params, loss_fn, batch)`` of a small regression whose leaves have ``shapes``."""
  shapes = shapes or SHAPES
  inputs = jax.random.normal(jax.random.key(0), (32, shapes["w"][0]))
  targets = jax.random.normal(jax.random.key(1), (32, 3))
  params = {name: 0.3 * jax.random.normal(jax.random.key(i + 2), shape)
            for i, (name, shape) in enumerate(shapes.items())}

  def loss_fn(p, batch):
    out = batch[0] @ p["w"] + p["b"][:3] + jnp.mean(p["c"] ** 2)
    return jnp.mean((out - batch[1]) ** 2)

  return params, loss_fn, (inputs, targets)


def train(tx, mesh, shard_over, steps=4, model=None, shapes=None):
  """``(trainer, state, losses)`` after ``steps`` steps of :func:`problem` on ``mesh``."""
  params, loss_fn, batch = problem(shapes)
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over=shard_over)
  state = trainer.init(params if model is None else model)
  losses = []
  for _ in range(steps):
    state, loss = trainer.step(state, batch)
    losses.append(float(loss))
  return trainer, state, losses


def assert_refused_at_init(tx, message):
  """``data_parallel(..., shard_over='local')`` on 2x4 with ``tx`` raises a ``ValueError``
  matching ``message`` at ``init``, before any step."""
  params, loss_fn, _ = problem()
  trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=2, local=4),
                                  shard_over="local")
  with pytest.raises(ValueError, match=message):
    trainer.init(params)


def powersgd_problem():
  """w: PowerSGD's (out, rest) matrix 8 x 16 (16 columns split over G = 2, 4, 8); b: dense;
  v: 6 x 5, factorized replicated but sent dense on shards of G = 4 (6 columns)."""
  shapes = {"w": (16, 8), "b": (8,), "v": (6, 5)}
  params = {name: 0.3 * jax.random.normal(jax.random.key(i), shape)
            for i, (name, shape) in enumerate(shapes.items())}
  batch = (jax.random.normal(jax.random.key(9), (32, 16)),
           jax.random.normal(jax.random.key(8), (32, 8)))
  loss_fn = lambda p, batch: (jnp.mean((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2)
                              + jnp.mean(p["v"] ** 2))
  return params, loss_fn, batch


def padded(size, group):
  """``size`` rounded up to a multiple of ``group``: a leaf's padded length on G devices."""
  return -(-size // group) * group
