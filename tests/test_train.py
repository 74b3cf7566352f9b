"""``jaxcomm.data_parallel``: the library-owned step equals the raw shard_map step, bounds the
steps in flight, donates its state on request, trains pytrees and nnx modules, and names bad
arguments."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxcomm

AXES = ("host", "local")


def _problem():
  inputs = jax.random.normal(jax.random.key(0), (64, 16))
  targets = inputs @ jax.random.normal(jax.random.key(1), (16, 4))
  params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}
  loss_fn = lambda p, batch: jnp.mean((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2)
  return params, loss_fn, (inputs, targets)


def _tx():
  return optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.1)), optax.adamw(1e-1))


def test_step_equals_the_raw_shard_map_step_bit_for_bit():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, loss_fn, batch = _problem()
  tx = _tx()
  opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P(AXES)), out_specs=(P(), specs, P()))
  def raw_step(params, opt_state, batch):
    loss, grads = jaxcomm.optim.local_value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXES)

  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh)
  state = trainer.init(params)
  chex.assert_trees_all_equal((state.params, state.opt_state), (params, opt_state))
  raw = (params, opt_state)
  for _ in range(3):
    *raw, raw_loss = raw_step(*raw, batch)
    state, loss = trainer.step(state, batch)
    assert float(loss) == float(raw_loss)
  chex.assert_trees_all_equal((state.params, state.opt_state), tuple(raw))
  assert state.opt_state[0].level_states[0][1].residual.sharding.spec == P(AXES)


def test_a_tight_loop_never_has_more_than_one_earlier_step_in_flight():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, loss_fn, batch = _problem()
  trainer = jaxcomm.data_parallel(loss_fn, _tx(), mesh)
  state = trainer.init(params)
  losses = []
  for t in range(150):  # no waiting in the loop, as a user would write it
    state, loss = trainer.step(state, batch)
    if t >= 2:  # step t-2 had finished (on every device) before step t was dispatched
      assert losses[t - 2].is_ready()
    losses.append(loss)
  trainer.step.wait()
  assert loss.is_ready() and float(loss) < 0.1 * float(losses[0])


@pytest.mark.parametrize("replicated", [False, True], ids=["on_one_device", "replicated"])
@pytest.mark.parametrize("shard_over", [None, "local"])
def test_a_donating_step_equals_the_plain_one_and_deletes_only_the_state_it_was_given(
    shard_over, replicated):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, loss_fn, batch = _problem()
  noisy_loss = lambda p, b, k: loss_fn(p, b) + 1e-3 * jax.random.normal(k)
  key = jax.random.key(3)
  if replicated:  # already placed as the step places them: init must not hand them over
    params, key = jax.device_put((params, key), jax.sharding.NamedSharding(mesh, P()))
  runs = {}
  for donate in (False, True):
    trainer = jaxcomm.data_parallel(noisy_loss, _tx(), mesh, key=key, shard_over=shard_over,
                                    donate=donate)
    state = trainer.init(params)
    header = trainer.step.lower(state, batch).compile().as_text().splitlines()[0]
    aliased = len(re.findall(r"\{\d+\}: \(\d+, \{\}, may-alias\)", header))
    losses = []
    for _ in range(3):
      given = state
      state, loss = trainer.step(state, batch)
      losses.append(float(loss))
      assert all(leaf.is_deleted() == donate for leaf in jax.tree.leaves(given))
    runs[donate] = (state, losses, aliased)
  chex.assert_trees_all_equal(runs[True][:2], runs[False][:2])
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((params, key)))
  # Every buffer of the state is reused for the new state (the loss is the one new output).
  assert (runs[False][2], runs[True][2]) == (0, len(jax.tree.leaves(state)))


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(16, 8, rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def test_an_nnx_module_trains_and_comes_back_as_a_module():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  _, _, batch = _problem()
  loss_fn = lambda model, b: jnp.mean((model(b[0]) - b[1]) ** 2)
  trainer = jaxcomm.data_parallel(loss_fn, _tx(), mesh)
  module = _MLP(nnx.Rngs(0))
  state = trainer.init(module)
  assert isinstance(state.params, nnx.State)
  for _ in range(20):
    state, loss = trainer.step(state, batch)
  trained = trainer.model(state)
  assert isinstance(trained, _MLP)
  chex.assert_trees_all_equal(nnx.state(trained, nnx.Param), state.params)
  assert float(loss_fn(trained, batch)) < 0.5 * float(loss_fn(module, batch))


@pytest.mark.parametrize("key", [7, jax.random.key(7), jax.random.PRNGKey(7)])
def test_each_device_and_step_gets_its_own_key(key):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = optax.chain(jaxcomm.compressed_allreduce(), optax.sgd(1.0))
  loss_fn = lambda p, batch, k: jnp.sum(p["w"] * jax.random.uniform(k, (3,)))
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, key=key)
  state = trainer.init({"w": jnp.zeros(3)})
  state, _ = trainer.step(state, jnp.zeros((8, 1)))
  typed = jax.random.key(7) if isinstance(key, int) else key
  _, step_key = jax.random.split(typed)
  uniforms = np.stack([jax.random.uniform(jax.random.fold_in(step_key, i), (3,))
                       for i in range(8)])
  assert len({tuple(row) for row in uniforms}) == 8
  np.testing.assert_allclose(state.params["w"], -uniforms.mean(0), rtol=1e-6)
  chex.assert_trees_all_equal(state.key, jax.random.split(typed)[0])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss_fn=None), TypeError, "loss_fn must be callable"),
    (dict(tx=optax.adamw), TypeError, "tx must be an optax.GradientTransformation"),
    (dict(mesh="mesh"), TypeError, "mesh must be a jax.sharding.Mesh"),
    (dict(batch_spec=("host",)), TypeError, "batch_spec must be a PartitionSpec"),
    (dict(max_in_flight=0), ValueError, "max_in_flight must be None or an int >= 1, got 0"),
    (dict(key=1.5), TypeError, "key must be None, an int seed"),
    (dict(key=jnp.zeros(3, jnp.uint32)), TypeError, "key must be None, an int seed"),
    (dict(donate=1), TypeError, "donate must be a bool, got 1"),
])
def test_bad_arguments_are_named_at_construction(kwargs, error, match):
  params, loss_fn, _ = _problem()
  args = dict(loss_fn=loss_fn, tx=_tx(), mesh=jaxcomm.make_mesh(hosts=2, local=4)) | kwargs
  with pytest.raises(error, match=match):
    jaxcomm.data_parallel(args.pop("loss_fn"), args.pop("tx"), args.pop("mesh"), **args)


def test_bad_models_are_named_at_init():
  trainer = jaxcomm.data_parallel(lambda p, b: 0.0, _tx(), jaxcomm.make_mesh(hosts=2, local=4))
  with pytest.raises(TypeError, match=r"params\['n'\]"):
    trainer.init({"n": jnp.zeros(4, jnp.int32)})
  with pytest.raises(ValueError, match="also holds BatchStat"):
    trainer.init(nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
