"""Residual memory per compressed level: at most one gradient copy; bf16 halves it."""

import jax
import jax.numpy as jnp
import pytest

import jaxcomm
from jaxcomm.collectives import level

AXES = ("host", "local")
PARAMS = {"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}
GRAD_BYTES = (256 * 64 + 64) * 4  # one float32 gradient copy


def residual_bytes_per_device(state) -> dict[str, int]:
  """Bytes one device holds for each residual kind of a compressed_allreduce state."""
  totals = {}
  for levels in state.level_states:
    for index, level_state in enumerate(levels):
      if isinstance(level_state, jaxcomm.compress.ErrorFeedbackState):
        parts = {"residual": level_state.residual}
      elif isinstance(level_state, jaxcomm.collectives.TwoPhaseState):
        parts = level_state._asdict()
      else:
        continue
      for name, array in parts.items():
        shard = array.addressable_shards[0].data
        totals[f"level{index}/{name}"] = totals.get(f"level{index}/{name}", 0) + shard.nbytes
  return totals


@pytest.mark.parametrize("strategy, dtype, expected", [
    ("gather", jnp.float32, {"level1/residual": GRAD_BYTES // 4}),
    ("gather", jnp.bfloat16, {"level1/residual": GRAD_BYTES // 8}),
    ("two_phase", jnp.float32, {"level1/worker_residual": GRAD_BYTES // 4,
                                "level1/server_residual": GRAD_BYTES // 8}),
])
def test_residuals_hold_one_shard_of_the_gradient_per_device(strategy, dtype, expected):
  """Two levels (4 local x 2 hosts): the host level's residual is the 1/4 shard it sends."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  tx = jaxcomm.compressed_allreduce(jaxcomm.sign(), strategy=strategy, feedback="residual",
                                    residual_dtype=dtype)
  state, _ = jaxcomm.optim.sharded_init(tx, PARAMS, mesh)
  assert residual_bytes_per_device(state) == expected
  assert sum(expected.values()) <= GRAD_BYTES // 4 * 1.5  # at most one copy of the shard
  for leaf in jax.tree.leaves(state.level_states):
    assert leaf.dtype in (jnp.dtype(dtype), jnp.bool_)


def test_three_levels_keep_at_most_one_gradient_copy_each():
  mesh = jax.make_mesh((2, 2, 2), ("pod", "host", "local"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  tx = jaxcomm.compressed_allreduce(levels=[level("local"), level("host", jaxcomm.topk(0.1)),
                                            level("pod", jaxcomm.sign())])
  state, _ = jaxcomm.optim.sharded_init(tx, PARAMS, mesh)
  assert residual_bytes_per_device(state) == {"level1/residual": GRAD_BYTES // 2,
                                              "level2/residual": GRAD_BYTES // 2}


def test_compiled_step_keeps_bf16_residuals_in_half_the_argument_memory():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  sizes = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tx = jaxcomm.compressed_allreduce(jaxcomm.topk(0.01), residual_dtype=dtype)
    state, specs = jaxcomm.optim.sharded_init(tx, PARAMS, mesh)
    step = jax.jit(jax.shard_map(
        lambda s, tx=tx: tx.update(jax.tree.map(jnp.ones_like, PARAMS), s)[1], mesh=mesh,
        in_specs=(specs,), out_specs=specs, check_vma=False))
    analysis = step.lower(state).compile().memory_analysis()
    sizes[jnp.dtype(dtype).name] = analysis.argument_size_in_bytes
  # Arguments per device: the residuals, plus the key, the counters and the finite flags.
  assert sizes["float32"] - sizes["bfloat16"] == GRAD_BYTES // 4 // 2
