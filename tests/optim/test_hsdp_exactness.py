"""What ``data_parallel(..., shard_over='local')`` refuses because it cannot be exact on flat
``1/G`` shards, and what it accepts and runs equal to the replicated step.

``hsdp.check_shardable`` traces ``tx.update`` on abstract shards at ``init``: outside the
regions jaxcomm's transformations declare exact (``hsdp.shard_aware``), an operation that
combines a shard's elements, or other operations than on the full leaves (logic by rank or
shape), is a ``ValueError``; an optimizer the user hands to a jaxcomm transformation
(``hsdp.user_optimizer``) is checked the same way.
"""

import chex
import jax
import optax
import optax.contrib
import pytest

import jaxcomm

from hsdp_helpers import assert_refused_at_init, train


def _after_sign(*optimizers):
  return optax.chain(jaxcomm.compressed_allreduce(jaxcomm.sign()), *optimizers)


def _by_rank(params):
  return jax.tree.map(lambda leaf: leaf.ndim > 1, params)


REFUSED = {
    # the defect: the norm of each device's shard alone (1.1e-3 away after 2 steps)
    "clip_by_global_norm": (
        lambda: _after_sign(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)),
        r"tx runs reduce_sum on an array of shape \(4,\).*shard_over=None"),
    "lamb": (lambda: _after_sign(optax.lamb(3e-3)), "tx runs reduce_sum"),
    "add_noise": (lambda: _after_sign(optax.add_noise(0.1, 0.55, 0), optax.sgd(0.1)),
                  r"tx runs random_bits on an array of shape \(4,\)"),
    # on flat shards every leaf is 1-D: Muon would run its Adam on all of them
    "muon": (lambda: _after_sign(optax.contrib.muon(3e-3)), "rank or shape"),
    "mask_by_rank": (lambda: _after_sign(optax.adamw(3e-3, mask=_by_rank)),
                     "tx runs other operations on flat 1/G shards.*rank or shape.*by parameter "
                     "name"),
    "diloco_inner_clip": (
        lambda: jaxcomm.diloco(optax.chain(optax.clip_by_global_norm(1.0),
                                           optax.adamw(1e-2)), 2),
        r"periodic_averaging.inner runs reduce_sum on an array of shape \(4,\)"),
    "local_sgd_inner_clip": (
        lambda: jaxcomm.local_sgd(optax.chain(optax.clip_by_global_norm(1.0),
                                              optax.sgd(0.1)), 2),
        "periodic_averaging.inner runs reduce_sum"),
    "diloco_outer_mask_by_rank": (
        lambda: jaxcomm.diloco(optax.adamw(1e-2), 2,
                               outer=optax.adamw(0.7, mask=_by_rank)),
        "periodic_averaging.outer runs other operations"),
    "sparseloco_inner_lamb": (lambda: jaxcomm.sparseloco(optax.lamb(1e-2), 2, density=0.5),
                              "periodic_averaging.inner runs reduce_sum"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_is_not_exact_on_shards_is_refused_at_init(name):
  make, message = REFUSED[name]
  assert_refused_at_init(make(), message)


ACCEPTED = {
    "adamw": lambda: _after_sign(optax.adamw(3e-2, weight_decay=0.1)),
    "sgd_momentum": lambda: _after_sign(optax.sgd(0.1, momentum=0.9)),
    "lion": lambda: _after_sign(optax.lion(1e-2, weight_decay=0.1)),
    # the fix for a mask by rank: a mask by parameter name
    "adamw_mask_by_name": lambda: _after_sign(
        optax.adamw(3e-2, weight_decay=0.1, mask={"w": True, "b": False, "c": False})),
    "clip_elementwise": lambda: _after_sign(optax.clip(0.05), optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_elementwise_optimizers_after_the_allreduce_equal_the_replicated_run(name):
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  replicated, rep_state, rep_losses = train(ACCEPTED[name](), mesh, None, steps=3)
  sharded, state, losses = train(ACCEPTED[name](), mesh, "local", steps=3)
  chex.assert_trees_all_close(sharded.model(state), replicated.model(rep_state), atol=1e-5)
  assert losses[-1] < losses[0]


def test_a_jaxcomm_allreduce_passed_as_a_sync_keeps_its_exact_region():
  """The sync DiLoCo takes from the user runs in a user scope; the compressed allreduce
  passed there declares its own shard-aware region inside it (the innermost scope decides),
  so its top-k on each shard is accepted."""
  tx = jaxcomm.diloco(optax.adamw(1e-2), 2, sync=jaxcomm.compressed_allreduce(jaxcomm.topk(0.5)))
  _, state, losses = train(tx, jaxcomm.make_mesh(hosts=2, local=4), "local", steps=4)
  assert losses[-1] < losses[0]
