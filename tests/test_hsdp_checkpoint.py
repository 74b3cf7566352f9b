"""HSDP checkpoints: sharded state restores bit-identically on the same mesh and onto another
mesh shape, conserving the error-feedback mass pending for every element."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm

from hsdp_helpers import padded, powersgd_problem, problem


def test_sharded_state_saves_and_restores_bit_identically(tmp_path):
  """Checkpoint after 2 steps, restore into a fresh init's state, 2 more steps: bit-equal to
  4 uninterrupted steps (shards, AdamW moments and top-k residuals all round-trip)."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params, loss_fn, batch = problem()
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.5)), optax.adamw(3e-2))
  trainer = jaxcomm.data_parallel(loss_fn, tx, mesh, shard_over="local")
  state = trainer.init(params)
  for step in range(4):
    if step == 2:
      jaxcomm.checkpoint.save(tmp_path, 2, state)
    state, _ = trainer.step(state, batch)
  restored = jaxcomm.checkpoint.restore(tmp_path, trainer.init(params))
  assert restored.params["w"].sharding.spec == P("local")
  for _ in range(2):
    restored, _ = trainer.step(restored, batch)
  chex.assert_trees_all_equal(restored, state)


def _pending(residual, hosts, local, size):
  """Per element of a leaf of ``size``: the error-feedback mass pending, summed over hosts."""
  shard = -(-size // local)
  flat = jnp.asarray(residual).reshape(hosts, local, -1)[:, :, :shard].reshape(hosts, -1)
  return flat[:, :size].sum(axis=0)


RESTORED = {  # method -> (problem, compressor)
    "topk": (problem, lambda: jaxcomm.topk(0.5)),
    "powersgd": (powersgd_problem, lambda: jaxcomm.powersgd(1)),
}


def _residuals(opt_state, method):
  """``(warm starts and counters, [(residual, leaf index)])`` of the allreduce state."""
  allreduce = opt_state[0]
  if method == "topk":
    return ((allreduce.key, allreduce.count),
            [(level.residual, i) for i, (_, level) in enumerate(allreduce.level_states)])
  leaves = allreduce.inner.leaves
  return (([leaf.q for leaf in leaves if leaf], allreduce.inner.count),
          [(leaf.residual, i) for i, leaf in enumerate(leaves) if leaf])


@pytest.mark.parametrize("method,hosts,local", [("topk", 4, 2), ("powersgd", 1, 8)])
def test_a_sharded_checkpoint_restores_onto_another_mesh_shape(tmp_path, method, hosts, local):
  """Saved on 2x4 (shards padded to multiples of 4), restored on 4x2 / 1x8: parameters and
  Adam moments un-padded and re-padded exactly, the residual mass pending for every element
  (summed over hosts) conserved bit for bit (top-k's error feedback; PowerSGD's residual of
  its column block), counters, keys and PowerSGD's Q kept; it then trains."""
  problem, compressor = RESTORED[method]
  params, loss_fn, batch = problem()
  tx = optax.chain(jaxcomm.compressed_allreduce(compressor(), feedback="residual"),
                   optax.adamw(3e-2))
  saved_trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=2, local=4),
                                        shard_over="local")
  saved = saved_trainer.init(params)
  for _ in range(2):
    saved, _ = saved_trainer.step(saved, batch)
  jaxcomm.checkpoint.save(tmp_path, 2, saved)
  trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=hosts, local=local),
                                  shard_over="local")
  state = jaxcomm.checkpoint.restore(tmp_path, trainer.init(params), tx=tx, params=params,
                                     shard_over="local")
  chex.assert_trees_all_equal(trainer.model(state), saved_trainer.model(saved))
  sizes = [leaf.size for leaf in jax.tree.leaves(params)]
  for new, old, size in zip(jax.tree.leaves(state.opt_state[1]),
                            jax.tree.leaves(saved.opt_state[1]), [1] + sizes * 2):
    if new.ndim:  # AdamW's mu and nu, leaf by leaf: same entries, padding zero
      assert new.shape == (padded(size, local),)
      assert new.sharding.shard_shape(new.shape) == (padded(size, local) // local,)
      chex.assert_trees_all_equal(new[:size], old[:size])
      assert not jnp.any(new[size:])
  (kept, new_residuals), (old_kept, old_residuals) = (_residuals(state.opt_state, method),
                                                      _residuals(saved.opt_state, method))
  chex.assert_trees_all_equal(kept, old_kept)
  pending = 0
  for (new, index), (old, _) in zip(new_residuals, old_residuals):
    mass = _pending(old, 2, 4, sizes[index])
    chex.assert_trees_all_equal(_pending(new, hosts, local, sizes[index]), mass)
    pending += int(jnp.count_nonzero(mass))
  assert pending > 5  # mass was pending (top-k: leaf b's 1-element shards send it all)
  _, loss = trainer.step(state, batch)
  assert jnp.isfinite(loss)


def test_ef21_estimates_restart_with_their_mean_on_another_mesh_shape(tmp_path):
  """EF21 keeps each device's estimate and their mean: both restart at zero together (a
  re-laid-out mean with zeroed estimates would no longer be their mean)."""
  params, loss_fn, batch = problem()
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.5), feedback="estimate"),
                   optax.sgd(0.1))
  saved_trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=2, local=4),
                                        shard_over="local")
  saved, _ = saved_trainer.step(saved_trainer.init(params), batch)
  assert any(jnp.any(mean) for mean in saved.opt_state[0].estimates)
  jaxcomm.checkpoint.save(tmp_path, 1, saved)
  trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=4, local=2),
                                  shard_over="local")
  state = jaxcomm.checkpoint.restore(tmp_path, trainer.init(params), tx=tx, params=params,
                                     shard_over="local")
  chex.assert_trees_all_equal(trainer.model(state), saved_trainer.model(saved))
  allreduce = state.opt_state[0]
  assert not any(jnp.any(leaf) for leaf in jax.tree.leaves((allreduce.estimates, [
      level.estimate for _, level in allreduce.level_states])))


def test_restore_with_a_bad_shard_over_names_it(tmp_path):
  with pytest.raises(ValueError, match=r"shard_over must be None or the name.*got 3"):
    jaxcomm.checkpoint.restore(tmp_path, {}, shard_over=3)



def _split_pending(residual, hosts, local, shape, dim):
  """Per element of a leaf of ``shape`` split along ``dim``: the pending mass summed over
  hosts (each device's residual is its block, flattened row-major)."""
  block = list(shape)
  block[dim] //= local
  blocks = jnp.asarray(residual).reshape(hosts, local, *block)
  return jnp.concatenate(list(jnp.moveaxis(blocks, 1, 0)), axis=1 + dim).sum(axis=0)


@pytest.mark.parametrize("hosts,local", [(4, 2), (1, 8)])
def test_a_dimension_split_checkpoint_restores_onto_another_mesh_shape(tmp_path, hosts, local):
  """w (16 x 8) split along its columns (dimension 1), b and v flat: saved on 2x4 after 2
  steps of top-k(0.5) + residual EF and AdamW, restored on 4x2 / 1x8: w and its moments keep
  their shape, resharded bit for bit; the pending residual mass of every element of w,
  summed over hosts, is conserved bit for bit (each device's block re-cut along the
  columns), as for the flat leaves; it then trains."""
  params, loss_fn, batch = powersgd_problem()
  specs = {"w": P(None, "local"), "b": P(), "v": P()}
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.topk(0.5), feedback="residual"),
                   optax.adamw(3e-2))
  saved_trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=2, local=4),
                                        shard_over="local")
  saved = saved_trainer.init(params, specs=specs)
  for _ in range(2):
    saved, _ = saved_trainer.step(saved, batch)
  jaxcomm.checkpoint.save(tmp_path, 2, saved)
  trainer = jaxcomm.data_parallel(loss_fn, tx, jaxcomm.make_mesh(hosts=hosts, local=local),
                                  shard_over="local")
  state = jaxcomm.checkpoint.restore(tmp_path, trainer.init(params, specs=specs), tx=tx,
                                     params=params, shard_over="local")
  chex.assert_trees_all_equal(trainer.model(state), saved_trainer.model(saved))
  assert state.params["w"].sharding.shard_shape((16, 8)) == (16, 8 // local)
  # AdamW's moments of w: each device's columns, stacked along rows; the same full moment
  unstack = lambda mu, group: jnp.concatenate(list(jnp.asarray(mu).reshape(group, 16, -1)), 1)
  for moment in ("mu", "nu"):
    new, old = (getattr(s.opt_state[1][0], moment)["w"] for s in (state, saved))
    assert new.shape == (16 * local, 8 // local) and new.sharding.spec == P("local")
    chex.assert_trees_all_equal(unstack(new, local), unstack(old, 4))
  order = [name for name, _ in sorted(params.items())]  # the leaves' order: b, v, w
  levels = {name: level.residual for name, (_, level) in
            zip(order, state.opt_state[0].level_states)}
  old_levels = {name: level.residual for name, (_, level) in
                zip(order, saved.opt_state[0].level_states)}
  mass = _split_pending(old_levels["w"], 2, 4, (16, 8), 1)
  chex.assert_trees_all_equal(_split_pending(levels["w"], hosts, local, (16, 8), 1), mass)
  assert int(jnp.count_nonzero(mass)) > 5
  for name, size in (("b", 8), ("v", 30)):
    chex.assert_trees_all_equal(_pending(levels[name], hosts, local, size),
                                _pending(old_levels[name], 2, 4, size))
  _, loss = trainer.step(state, batch)
  assert jnp.isfinite(loss)


def _rows(leaf, hosts, size):
  """A per-host flat leaf as ``(hosts, size)``: each host's real entries."""
  return jnp.asarray(leaf).reshape(hosts, -1)[:, :size]


PER_HOST = {"diloco": lambda: jaxcomm.diloco(optax.adamw(3e-2), 2),
            "sparseloco": lambda: jaxcomm.sparseloco(optax.adamw(3e-2), 2, density=0.5)}


def _adam(inner):
  return next(node for node in jax.tree.leaves(inner, is_leaf=lambda n: hasattr(n, "mu"))
              if hasattr(node, "mu"))


def _saved_and_moved(tmp_path, tx, steps: int):
  """``(params, batch, state, moved)``: ``tx()`` trained ``steps`` steps under HSDP on 2x4
  (the hosts' models differ, checked) and saved as step ``steps`` in ``tmp_path``; ``moved``
  the same trainer on 4x2."""
  params, loss_fn, batch = problem()
  trainer = jaxcomm.data_parallel(loss_fn, tx(), jaxcomm.make_mesh(hosts=2, local=4),
                                  shard_over="local")
  state = trainer.init(params)
  for _ in range(steps):
    state, _ = trainer.step(state, batch)
  jaxcomm.checkpoint.save(tmp_path, steps, state)
  assert not jnp.array_equal(*_rows(state.params["w"], 2, params["w"].size))
  moved = jaxcomm.data_parallel(loss_fn, tx(), jaxcomm.make_mesh(hosts=4, local=2),
                                shard_over="local")
  return params, batch, state, moved


def _assert_hosts_mean(old, new, size: int, hosts: int = 4, local: int = 2):
  """``new``, a per-host flat shard on ``hosts x local``, holds on every host the mean of the
  2 saved hosts' first ``size`` entries of ``old``, bit for bit."""
  assert new.shape == (hosts * padded(size, local),)
  assert new.sharding.spec == P(("host", "local"))
  mean = jnp.mean(_rows(old, 2, size), axis=0)
  chex.assert_trees_all_equal(_rows(new, hosts, size), jnp.tile(mean, (hosts, 1)))


@pytest.mark.parametrize("method", sorted(PER_HOST))
def test_per_host_shards_restore_onto_another_mesh_shape_as_the_hosts_mean(tmp_path, method):
  """DiLoCo and SparseLoCo (AdamW inner, period 2) saved on 2x4 after 3 steps, mid-period:
  the two hosts' models differ. Restored on 4 x 2 (both H and G change), every new host holds
  the saved hosts' mean model and the mean of their inner AdamW moments (real entries,
  bit-identical), padded with zeros; the anchor and the counters are as saved; SparseLoCo's
  error buffers keep every element's pending mass summed over hosts (residuals='sum',
  bit-identical); the next step (the 4th) synchronizes as planned."""
  hosts, local = 4, 2
  params, batch, state, moved = _saved_and_moved(tmp_path, PER_HOST[method], steps=3)
  sizes = {name: leaf.size for name, leaf in params.items()}
  restored = jaxcomm.checkpoint.restore(tmp_path, moved.init(params), tx=PER_HOST[method](),
                                        params=params, shard_over="local")
  saved_adam, adam = _adam(state.opt_state.inner), _adam(restored.opt_state.inner)
  for name, size in sizes.items():
    for old, new in ((state.params, restored.params), (saved_adam.mu, adam.mu),
                     (saved_adam.nu, adam.nu)):
      _assert_hosts_mean(old[name], new[name], size)
      assert not jnp.any(new[name].reshape(hosts, -1)[:, size:])
    chex.assert_trees_all_equal(restored.opt_state.anchor[name][:size],
                                state.opt_state.anchor[name][:size])
    if method == "sparseloco":
      # the error buffers of the fragment's leaves, in jax.tree.leaves(params) order
      old, new = (dict(zip(sorted(sizes), jax.tree.leaves(s.opt_state.sync[0].error)))[name]
                  for s in (state, restored))
      assert jnp.any(_pending(old, 2, 4, size))
      chex.assert_trees_all_equal(_pending(new, hosts, local, size), _pending(old, 2, 4, size))
  assert int(restored.opt_state.count) == int(state.opt_state.count) == 3
  restored, loss = moved.step(restored, batch)
  assert jnp.isfinite(loss)
  w = _rows(restored.params["w"], hosts, sizes["w"])
  chex.assert_trees_all_equal(w, jnp.tile(w[0], (hosts, 1)))  # synchronized at step 4
  chex.assert_trees_all_close(restored.opt_state.anchor["w"][:sizes["w"]], w[0], atol=1e-6)


def test_zero_one_adam_per_host_state_restores_onto_another_mesh_shape_as_the_hosts_mean(
    tmp_path):
  """0/1 Adam saved on 2x4 after a local step (the hosts' models and momenta differ),
  restored on 4x2 with residuals='reset': on every new host the parameters, the momentum and
  the anchor are bit-identical to the saved hosts' mean (real entries; the parameters'
  padding zero), the
  variance (replicated over hosts) and the step counts are as saved, the two-phase residuals
  are zero, and a step runs. residuals='sum' is refused, naming the server residuals."""
  tx = lambda: jaxcomm.zero_one_adam(1e-2, var_freeze_step=2, var_update_scaler=1,
                                     local_step_scaler=1, local_step_clipper=4)
  params, batch, state, moved = _saved_and_moved(tmp_path, tx, steps=4)
  sizes = {name: leaf.size for name, leaf in params.items()}
  restore = lambda **kw: jaxcomm.checkpoint.restore(tmp_path, moved.init(params), tx=tx(),
                                                    params=params, shard_over="local", **kw)
  with pytest.raises(ValueError, match="two-phase server residuals"):
    restore()
  restored = restore(residuals="reset")
  saved_opt, opt = state.opt_state, restored.opt_state
  for name, size in sizes.items():
    for old, new in ((state.params, restored.params), (saved_opt.mu, opt.mu),
                     (saved_opt.anchor, opt.anchor)):
      _assert_hosts_mean(old[name], new[name], size)
    assert not jnp.any(restored.params[name].reshape(4, -1)[:, size:])
    chex.assert_trees_all_equal(opt.nu[name][:size], saved_opt.nu[name][:size])
  assert int(saved_opt.steps_per_kind[2]) == 1  # saved right after one local step
  assert not any(jnp.any(leaf) for leaf in jax.tree.leaves(opt.residuals))
  chex.assert_trees_all_equal(opt.steps_per_kind, saved_opt.steps_per_kind)
  _, loss = moved.step(restored, batch)
  assert jnp.isfinite(loss)
