"""compress_updates under hybrid sharded data parallelism (``shard_over='local'``).

Each device runs the optimizer on its ``1/G`` shard of the host-mean gradient and the
compressed allreduce crosses hosts with the same shard the replicated path compresses, so
the two runs agree to float rounding; the zero padding stays exactly 0; what cannot be exact
on shards is refused at ``init``; a non-finite step is skipped as in the replicated form.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm

from hsdp_helpers import SHAPES, assert_refused_at_init, problem, train

# Compressors whose shard-wise encoding is the replicated path's: that path reduce-scatters
# each zero-padded leaf over 'local' and compresses the same 1/G shard across hosts
# (tests/test_hsdp.py, test_compressors_under_hsdp_equal_their_replicated_run).
COMPRESSORS = {"none": lambda: None, "sign_ef": jaxcomm.sign,
               "topk_ef": lambda: jaxcomm.topk(0.3)}


def _tx(compressor):
  return jaxcomm.optim.compress_updates(optax.adamw(3e-2, weight_decay=0.1),
                                        COMPRESSORS[compressor]())


@functools.cache
def _runs(compressor: str):
  """``(replicated, sharded)``: each ``(trainer, state, losses)`` after 4 steps on 2x4."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  return train(_tx(compressor), mesh, None), train(_tx(compressor), mesh, "local")


@pytest.mark.parametrize("compressor", sorted(COMPRESSORS))
def test_sharded_equals_the_replicated_run(compressor):
  """Equal to float rounding: the host mean is summed in another order (the reduce-scatter
  that transposes the parameter all-gather, against a pmean), a last-bit difference that
  Adam's ``m / sqrt(v)`` keeps relative (~1e-7) and lr 3e-2 scales; observed <= 3e-8 after
  4 steps. Sign and top-k see those inputs too, away from any tie, so they choose the same."""
  (replicated, rep_state, rep_losses), (sharded, state, losses) = _runs(compressor)
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-6)
  assert losses == pytest.approx(rep_losses, rel=1e-6)
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("compressor", ["none", "sign_ef"])
def test_the_zero_padding_stays_exactly_zero(compressor):
  """Parameters and Adam's moments: sign's mean of a padded zero is not 0, and would make the
  padded parameters move, weight decay send them and the last shard's sign scale differ from
  the replicated run's; compress_updates restores the padding's zeros."""
  _, (_, state, _) = _runs(compressor)
  adam = state.opt_state.inner[0]
  for name, shape in SHAPES.items():
    size = int(np.prod(shape))
    assert not np.any(np.asarray(state.params[name])[size:])
    for moment in (adam.mu[name], adam.nu[name]):  # (hosts * padded,): each host's own
      per_host = np.asarray(moment).reshape(2, -1)
      assert not np.any(per_host[:, size:]) and np.any(per_host[:, :size])


def _clip_then_adamw():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def _decay_matrices_only():
  return optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))


REFUSED = {
    "fast_axis": (lambda: jaxcomm.optim.compress_updates(
        optax.adamw(1e-2), fast_axis="host", slow_axis="local"),
        "fast_axis must be 'local'; got fast_axis='host'"),
    "host_variance": (lambda: jaxcomm.optim.compress_updates(
        jaxcomm.optim.host_adamw(1e-2), host_variance=True), "host_variance=True"),
    "global_norm": (lambda: jaxcomm.optim.compress_updates(_clip_then_adamw()),
                    "inner runs reduce_sum on an array of shape"),
    "mask_by_rank": (lambda: jaxcomm.optim.compress_updates(_decay_matrices_only()),
                     "rank or shape"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_cannot_be_exact_on_shards_is_refused_at_init(name):
  make, message = REFUSED[name]
  assert_refused_at_init(make(), message)


def test_a_nonfinite_step_is_skipped():
  """A NaN input on one device poisons its gradient: every device skips the step, so the
  parameters and Adam's moments stay as they were and the step is counted as skipped."""
  params, loss_fn, (inputs, targets) = problem()
  trainer = jaxcomm.data_parallel(loss_fn, _tx("sign_ef"), jaxcomm.make_mesh(hosts=2, local=4),
                                  shard_over="local")
  state = trainer.init(params)
  for _ in range(2):
    state, _ = trainer.step(state, (inputs, targets))
  before = jax.tree.map(np.asarray, (state.params, state.opt_state.inner))
  state, loss = trainer.step(state, (inputs.at[0, 0].set(jnp.nan), targets))
  assert np.isnan(float(loss))
  chex.assert_trees_all_equal((state.params, state.opt_state.inner), before)
  assert int(state.opt_state.allreduce.skipped_steps) == 1
  state, loss = trainer.step(state, (inputs, targets))
  assert np.isfinite(float(loss)) and int(state.opt_state.allreduce.skipped_steps) == 1
