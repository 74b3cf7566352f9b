"""Reshard after forward: ``data_parallel(..., shard_over='local', reshard_after_forward=True)``
gathers each leaf where an operation reads it and again for its backward pass; it equals the
plain HSDP step and moves one more all-gather of exactly the leaves its backward pass reads."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxcomm

from hsdp_helpers import padded

# w1 (30 elements), b1, b2, c: padded on G = 4; three layers and a loss term of c alone.
LEAVES = {"w1": (6, 5), "b1": (5,), "w2": (5, 8), "b2": (8,), "w3": (8, 3), "c": (7,)}
OPTIMIZERS = {"sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
              "adamw": lambda: optax.adamw(3e-2, weight_decay=0.1)}


def _problem():
  params = {name: 0.4 * jax.random.normal(jax.random.key(i), shape)
            for i, (name, shape) in enumerate(LEAVES.items())}
  batch = (jax.random.normal(jax.random.key(10), (32, 6)),
           jax.random.normal(jax.random.key(11), (32, 3)))

  def loss_fn(p, batch):
    h = jnp.tanh(batch[0] @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"])
    return jnp.mean((h @ p["w3"] - batch[1]) ** 2) + jnp.mean(p["c"] ** 2)

  return params, loss_fn, batch


def _trainer(opt, reshard, mesh):
  params, loss_fn, batch = _problem()
  tx = optax.chain(jaxcomm.compressed_allreduce(), OPTIMIZERS[opt]())
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over="local",
                                  reshard_after_forward=reshard)
  return trainer, trainer.init(params), batch


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_reshard_after_forward_equals_the_gathered_step_and_regathers_what_backward_reads(opt):
  """Equal parameters and losses after 3 steps. Bytes: forward, one all-gather per leaf;
  backward, the reduce-scatter of every gradient and a second all-gather of w2, w3 (their
  values carry the gradient to the layer below) and c (the gradient of mean(c^2) reads c),
  not of w1 (the batch needs no gradient) or the biases (their gradients read no value)."""
  hosts, local = 2, 4
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  runs = []
  for reshard in (False, True):
    trainer, state, batch = _trainer(opt, reshard, mesh)
    step = trainer.step.lower(state, batch).compile()
    report = jaxcomm.accounting.report_from_hlo(step.as_text(), mesh).bytes_per_axes()
    losses = []
    for _ in range(3):
      state, loss = step(state, batch)
      losses.append(float(loss))
    runs.append((trainer.model(state), losses, state, report))
  chex.assert_trees_all_close(runs[1][0], runs[0][0], atol=1e-6)
  assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-6)
  assert runs[1][1][-1] < runs[1][1][0]
  for new, old in zip(jax.tree.leaves(runs[1][2]), jax.tree.leaves(runs[0][2])):
    assert new.sharding == old.sharding
  plain, resharded = runs[0][3], runs[1][3]
  size = {name: padded(jnp.zeros(shape).size, local) for name, shape in LEAVES.items()}
  gather = lambda names: sum((local - 1) / local * 4 * size[name] for name in names)
  assert plain[("local",)] == pytest.approx(2 * gather(LEAVES))
  assert resharded[("local",)] == pytest.approx(2 * gather(LEAVES) + gather(("w2", "w3", "c")))
  assert resharded[("host",)] == pytest.approx(plain[("host",)])
  assert resharded[("host", "local")] == pytest.approx(plain[("host", "local")])
  assert set(resharded) == set(plain)


def test_reshard_after_forward_lowers_the_temporaries_of_a_deep_mlp():
  """Eight 256 x 256 layers on 1 x 8: the gathered weights no longer wait for the backward
  pass (compiled memory_analysis; XLA's CPU scheduler issues untied gathers first)."""
  mesh = jaxcomm.make_mesh(hosts=1, local=8)
  params = [jax.random.normal(jax.random.key(i), (256, 256)) / 16 for i in range(8)]

  def loss_fn(p, x):
    for w in p:
      x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)

  temps = []
  for reshard in (False, True):
    trainer = jaxcomm.data_parallel(loss_fn, optax.chain(jaxcomm.compressed_allreduce(),
                                                         optax.sgd(0.1)),
                                    mesh, shard_over="local", reshard_after_forward=reshard)
    state = trainer.init(params)
    compiled = trainer.step.lower(state, jnp.ones((64, 256))).compile()
    temps.append(compiled.memory_analysis().temp_size_in_bytes)
  full = 8 * 256 * 256 * 4
  assert temps[0] >= full  # every gathered weight at once
  assert temps[1] <= full / 2, temps


def test_reshard_after_forward_needs_a_bool_and_shard_over():
  params, loss_fn, _ = _problem()
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = optax.sgd(0.1)
  with pytest.raises(ValueError, match="reshard_after_forward=True needs shard_over"):
    jaxcomm.data_parallel(loss_fn, tx, mesh, reshard_after_forward=True)
  with pytest.raises(TypeError, match="reshard_after_forward must be a bool, got 'yes'"):
    jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over="local", reshard_after_forward="yes")


class _TiedLM(nnx.Module):
  """An embedding read twice (lookup and tied output projection: gathered once per reading
  operation), an RMSNorm scale and a Linear with bias."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(13, 6, rngs=rngs)
    self.norm = nnx.RMSNorm(6, rngs=rngs)
    self.linear = nnx.Linear(6, 6, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.norm(jax.nn.gelu(self.linear(self.embed(tokens)))))


def test_an_nnx_module_with_a_tied_embedding_equals_the_gathered_step():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tokens = jax.random.randint(jax.random.key(0), (16, 5), 0, 13)

  def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  runs = []
  for reshard in (False, True):
    tx = optax.chain(jaxcomm.compressed_allreduce(), optax.adamw(3e-2))
    trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over="local",
                                    reshard_after_forward=reshard)
    state = trainer.init(_TiedLM(nnx.Rngs(0)))
    for _ in range(2):
      state, loss = trainer.step(state, tokens)
    runs.append((nnx.state(trainer.model(state)), float(loss)))
  chex.assert_trees_all_close(runs[1][0], runs[0][0], atol=1e-6)
  assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-6)
