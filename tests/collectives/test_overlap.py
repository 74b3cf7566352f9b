"""Bucketed collectives start while the backward pass still runs (scheduled HLO order)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.collectives import plan_buckets

WIDTH, LAYERS = 64, 4
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*\S+\s+(?P<opcode>[\w-]+)\(")


def _mlp_loss(params, batch):
  x, y = batch
  for name in sorted(params):
    x = jnp.tanh(x @ params[name])
  return jnp.mean((x - y) ** 2)


def _scheduled_entry(bucket_bytes):
  """The compiled train step's ENTRY instructions, in schedule order: ``(opcode, line)``."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  params = {f"layer{i}": jnp.full((WIDTH, WIDTH), 0.01 * (i + 1)) for i in range(LAYERS)}
  tx = optax.chain(jaxcomm.compressed_allreduce(jaxcomm.sign(), strategy="gather",
                                                bucket_bytes=bucket_bytes), optax.sgd(0.1))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  batch = tuple(jax.device_put(jnp.ones((8 * 4, WIDTH)), NamedSharding(mesh, P(("host", "local"))))
                for _ in range(2))
  step = jaxcomm.optim.data_parallel_step(_mlp_loss, tx, mesh, specs)
  text = step.lower(params, state, batch).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  return [(m.group("opcode"), line) for line in entry.splitlines()
          if (m := _INSTRUCTION.match(line))]


def _first_and_last(instructions):
  """Position of the first reduce-scatter (the first collective of the gradient mean) and
  of the last matrix product of the backward pass (a gradient being computed)."""
  first_collective = next(i for i, (op, _) in enumerate(instructions) if op == "reduce-scatter")
  backward_dots = [i for i, (op, line) in enumerate(instructions)
                   if "transpose(jvp" in line and (op == "dot" or "dot_general" in line)]
  return first_collective, max(backward_dots)


def test_a_layer_sized_bucket_is_reduced_before_the_last_gradient_is_computed():
  layer_bytes = WIDTH * WIDTH * 4
  first_collective, last_dot = _first_and_last(_scheduled_entry(bucket_bytes=layer_bytes))
  assert first_collective < last_dot


def test_one_bucket_for_everything_waits_for_the_whole_backward_pass():
  first_collective, last_dot = _first_and_last(_scheduled_entry(bucket_bytes=1 << 30))
  assert first_collective > last_dot


@pytest.mark.parametrize("bucket_bytes", [16, 40])
def test_buckets_fill_from_the_last_leaf_and_come_in_readiness_order(bucket_bytes):
  leaves = [jnp.zeros(3) for _ in range(5)]  # 12 bytes each
  buckets = plan_buckets(leaves, bucket_bytes)
  assert buckets[0].leaves[-1] == 4  # the last leaf's gradient is ready first
  assert [i for b in buckets for i in reversed(b.leaves)] == [4, 3, 2, 1, 0]
  assert all(list(b.leaves) == sorted(b.leaves) for b in buckets)
  per_bucket = max(1, bucket_bytes // 12)
  assert [len(b.leaves) for b in buckets] == [per_bucket] * (5 // per_bucket) + (
      [5 % per_bucket] if 5 % per_bucket else [])
