"""PowerSGD's collective: exactness at full rank, convergence to the SVD, bytes, warm-up."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
import fast_random
from jaxcomm._src.collectives.powersgd import psum_together


AXES = ("host", "local")


def _stepper(mesh, tx, params, steps):
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), specs),
                     out_specs=(P(), specs))
  def run(grads, opt_state):
    # A scan, not an unrolled loop: one copy of the collective whatever ``steps`` is.
    def one_step(opt_state, _):
      update, opt_state = tx.update(jax.tree.map(lambda g: g[0], grads), opt_state)
      return opt_state, update

    opt_state, updates = jax.lax.scan(one_step, opt_state, length=steps)
    return updates, opt_state

  return run, state


def _low_rank_grads(rank, shape=(24, 16), seed=0):
  """Per-device gradients whose mean has rank ``rank``."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  left = fast_random.normal(keys[0], (shape[0], rank))
  right = fast_random.normal(keys[1], (rank, shape[1]))
  mixing = fast_random.normal(keys[2], (8, rank))
  # Each device holds a different combination of the same rank-`rank` factors.
  return jnp.einsum("dr,mr,rn->dmn", mixing, left, right)


@pytest.mark.parametrize("rank", [1, 3])
def test_rank_at_least_the_matrix_rank_reproduces_the_dense_mean(rank):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": _low_rank_grads(rank), "b": fast_random.normal(jax.random.PRNGKey(9), (8, 16))}
  tx = jaxcomm.powersgd_allreduce(rank=rank, min_compression_rate=1.0)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], grads), steps=1)
  outputs, new_state = run(grads, state)
  chex.assert_trees_all_close(outputs["w"][0], jnp.mean(grads["w"], 0), atol=1e-4, rtol=1e-4)
  chex.assert_trees_all_close(outputs["b"][0], jnp.mean(grads["b"], 0), atol=1e-6)
  # Each host keeps its own difference to the average; nothing is left unsent in total.
  residuals = new_state.leaves[1].residual.reshape(2, 24, 16)
  chex.assert_trees_all_close(jnp.sum(residuals, 0), jnp.zeros((24, 16)), atol=1e-4)


def _dense_powersgd(grads, rank, steps, hosts=2, seed=0):
  """Whole-matrix PowerSGD with error feedback in float64 numpy, every leaf factorized: the
  reference the row-block collective must reproduce. ``grads`` maps names (in leaf order) to
  per-device gradients ``(H G, ...)``; returns each step's outputs."""
  from jaxcomm._src.compress.powersgd import initial_q
  from jaxcomm._src.keys import nth_key
  names = sorted(grads)
  rows = {k: np.asarray(grads[k], np.float64).reshape(hosts, -1, *grads[k].shape[1:])
          for k in names}
  # Each host's sum of g / (H G), as M^T: (n, m).
  host_sums = {k: rows[k].sum(1).reshape(hosts, -1, grads[k].shape[-1]) / len(grads[k])
               for k in names}
  q = {k: np.asarray(initial_q(nth_key(seed, i), grads[k].shape[1:], rank), np.float64)
       for i, k in enumerate(names)}
  residual = {k: np.zeros_like(host_sums[k]) for k in names}
  outputs = []
  for _ in range(steps):
    step = {}
    for k in names:
      corrected = host_sums[k] + residual[k]
      p = np.einsum("hnm,nr->mr", corrected, q[k])
      columns = []
      for column in p.T:
        for previous in columns:
          column = column - previous @ column * previous
        columns.append(column / (np.linalg.norm(column) + 1e-8))
      p = np.stack(columns, 1)
      new_q = np.einsum("hnm,mr->nr", corrected, p)
      approx = new_q @ p.T
      residual[k] = corrected - approx / hosts
      q[k] = np.where(np.linalg.norm(new_q, axis=0) > 0, new_q, q[k])
      step[k] = approx.reshape(grads[k].shape[1:])
    outputs.append(step)
  return outputs


def test_row_blocks_equal_whole_matrix_powersgd_over_steps():
  """Padded rows (30 = 4 * 8 - 2), a 3-D leaf and a 2-D one stacked into one group, feedback
  and warm start over two steps: the outputs of the dense reference."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  grads = {"a": fast_random.normal(keys[0], (8, 10, 3, 8)),
           "b": fast_random.normal(keys[1], (8, 30, 8))}
  tx = jaxcomm.powersgd_allreduce(rank=2, seed=0)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], grads), steps=2)
  outputs, _ = run(grads, state)
  for step, expected in enumerate(_dense_powersgd(grads, rank=2, steps=2)):
    for name in grads:
      np.testing.assert_allclose(outputs[name][step], expected[name], rtol=2e-4, atol=2e-5)


def test_warm_started_iterations_converge_to_the_best_rank_r_approximation():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  left, _ = jnp.linalg.qr(fast_random.normal(keys[0], (40, 30)))
  right, _ = jnp.linalg.qr(fast_random.normal(keys[1], (30, 30)))
  spectrum = jnp.array([6.0, 4.0] + [1.0 / (i + 1) for i in range(28)])  # gap 4 -> 1
  target = (left * spectrum) @ right.T
  noise = fast_random.normal(keys[2], (8, 40, 30))
  grads = {"w": target + noise - jnp.mean(noise, 0)}  # per-device gradients, mean = target
  mean = np.asarray(jnp.mean(grads["w"], 0))
  u, s, vt = np.linalg.svd(mean)
  rank = 2
  best = (u[:, :rank] * s[:rank]) @ vt[:rank]
  tx = jaxcomm.powersgd_allreduce(rank=rank, feedback=False)
  run, state = _stepper(mesh, tx, {"w": grads["w"][0]}, steps=40)
  outputs, _ = run(grads, state)
  errors = [np.linalg.norm(np.asarray(o) - best) / np.linalg.norm(best) for o in outputs["w"]]
  assert errors[0] > 0.1
  assert errors[-1] < 1e-2, errors[-1]
  assert np.linalg.norm(mean - np.asarray(outputs["w"][-1])) == pytest.approx(
      np.linalg.norm(mean - best), rel=1e-3)


def test_error_feedback_identity_over_steps():
  """sum of outputs + the hosts' residuals == sum of the inputs' mean, step after step."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": fast_random.normal(jax.random.PRNGKey(2), (8, 32, 32))}
  tx = jaxcomm.powersgd_allreduce(rank=1)
  run, state = _stepper(mesh, tx, {"w": grads["w"][0]}, steps=6)
  outputs, new_state = run(grads, state)
  residual_per_host = new_state.leaves[0].residual.reshape(2, 32, 32)
  chex.assert_trees_all_close(jnp.sum(outputs["w"], 0) + jnp.sum(residual_per_host, 0),
                              6 * jnp.mean(grads["w"], 0), atol=1e-4)


def test_dense_warm_up_then_factors_and_bytes_on_the_slow_link():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": fast_random.normal(jax.random.PRNGKey(3), (8, 64, 48)),
           "b": jnp.ones((8, 48))}
  tx = jaxcomm.powersgd_allreduce(rank=2, warmup_steps=2)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], grads), steps=3)
  outputs, _ = run(grads, state)
  exact = jnp.mean(grads["w"], 0)
  chex.assert_trees_all_close(outputs["w"][0], exact, atol=1e-5)
  chex.assert_trees_all_close(outputs["w"][1], exact, atol=1e-5)
  assert float(jnp.max(jnp.abs(outputs["w"][2] - exact))) > 1e-2

  compressed = jaxcomm.powersgd_allreduce(rank=2)
  run, state = _stepper(mesh, compressed, jax.tree.map(lambda g: g[0], grads), steps=1)
  report = jaxcomm.accounting.measure(run, grads, state, mesh=mesh)
  # P (48 x 2: the (out, rest) view) and this device's 64 / 4 rows of Q
  factor_bytes = 4 * 2 * (48 + 64 // 4)
  assert report.bytes_per_axes()[("host",)] == pytest.approx(
      2 * (2 - 1) / 2 * (factor_bytes + 4 * 48))
  # The gradient's reduce-scatter and the approximation's all-gather, the all-reduces of P's
  # parts and of Q's squared column norms (which also tell a non-finite step), the dense bias
  assert report.bytes_per_axes()[("local",)] == pytest.approx(
      3 / 4 * 4 * 64 * 48 * 2 + 2 * 3 / 4 * 4 * (48 * 2 + 2 + 48))


def test_psum_together_equals_one_psum_per_array_bit_for_bit():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  arrays = [fast_random.normal(jax.random.PRNGKey(i), (8,) + shape)
            for i, shape in enumerate([(3, 16, 4), (5,), (2, 7)])]
  specs = tuple(P(AXES) for _ in arrays)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=(specs, specs))
  def run(*xs):
    xs = [x[0] for x in xs]
    together = psum_together(xs, "host")
    alone = [jax.lax.psum(x, "host") for x in xs]
    return tuple(t[None] for t in together), tuple(a[None] for a in alone)

  together, alone = run(*arrays)
  for t, a in zip(together, alone):
    assert t.shape == a.shape
    np.testing.assert_array_equal(np.asarray(t), np.asarray(a))


def test_factors_cross_the_slow_axis_in_one_all_reduce_per_round():
  """All leaves' P (with the dense leaves' sums) in one slow-axis all-reduce, all Q in one."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"embed": fast_random.normal(jax.random.PRNGKey(4), (8, 64, 16)),
           "kernel": fast_random.normal(jax.random.PRNGKey(5), (8, 128, 48)),
           "head": fast_random.normal(jax.random.PRNGKey(6), (8, 48, 48)),
           "b": jnp.ones((8, 48))}
  tx = jaxcomm.powersgd_allreduce(rank=4)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], grads), steps=1)
  report = jaxcomm.accounting.measure(run, grads, state, mesh=mesh)
  assert [op.kind for op in report.collectives if op.axes == ("host",)] == ["all-reduce"] * 2


def test_non_finite_gradients_leave_the_state_finite():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": fast_random.normal(jax.random.PRNGKey(4), (8, 16, 16)).at[3, 0, 0].set(jnp.nan)}
  tx = jaxcomm.powersgd_allreduce(rank=1)
  run, state = _stepper(mesh, tx, {"w": grads["w"][0]}, steps=1)
  _, new_state = run(grads, state)
  chex.assert_tree_all_finite(new_state.leaves[0])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("device, index", [(3, (0, 0)), (0, (29, 7)), (6, (13, 4)),
                                           (7, (5, 0))])
def test_a_non_finite_entry_anywhere_keeps_every_state(value, device, index):
  """One NaN or Inf on one device, at rows of each of the four row blocks (29 is the last
  real row of 30, padded to 32): the non-finite check sees it on every device, so the
  leaf's state does not move, while a clean step moves every state."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  keys = jax.random.split(jax.random.PRNGKey(6), 2)
  clean = {"a": fast_random.normal(keys[0], (8, 30, 8)),
           "b": fast_random.normal(keys[1], (8, 10, 3, 8))}
  tx = jaxcomm.powersgd_allreduce(rank=2)
  run, state = _stepper(mesh, tx, jax.tree.map(lambda g: g[0], clean), steps=1)
  _, moved = run(clean, state)
  bad = dict(clean, a=clean["a"].at[(device,) + index].set(value))
  _, kept = run(bad, state)
  for leaf_moved, leaf_kept, leaf_old in zip(moved.leaves, kept.leaves, state.leaves):
    assert not np.array_equal(leaf_moved.q, leaf_old.q)
  chex.assert_trees_all_equal(kept.leaves[0], state.leaves[0])
  chex.assert_tree_all_finite(kept.leaves)


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "rank"), ({"min_compression_rate": 0.0}, "min_compression_rate"),
    ({"warmup_steps": -1}, "warmup_steps"), ({"epsilon": -1.0}, "epsilon"),
    ({"fast_axis": "host"}, "must differ"), ({"feedback": 1}, "feedback"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomm.powersgd_allreduce(**kwargs)
