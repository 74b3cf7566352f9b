"""Streaming DiLoCo with quantized outer gradients: identity at 32 bits, bytes, quality."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.compress.packing import packed_nbytes
from jaxcomm._src.optim.diloco import diloco, streaming_diloco
from jaxcomm._src.optim.local_training import to_device_local
from lowcomm_helpers import AXES, eval_loss, sync_sgd, train
from test_branches import branch_selectors, traced_step
from update_helpers import apply_fn

HOSTS, LOCAL = 2, 4
STREAMING = {"fragments": 2, "delay": 1, "mixing": 0.5}


@pytest.fixture(scope="module")
def unquantized():
  """Parameters after 10 steps of the existing streaming path (diloco with fragments)."""
  return train(diloco(optax.adam(3e-3), 4, **STREAMING), 10, local=True)[0]


def test_32_bits_is_the_unquantized_streaming_path(unquantized):
  params = train(streaming_diloco(optax.adam(3e-3), 4, bits=32, **STREAMING), 10, local=True)[0]
  chex.assert_trees_all_equal(params, unquantized)


def test_8_bits_stays_close_to_the_unquantized_path(unquantized):
  quantized = train(streaming_diloco(optax.adam(3e-3), 4, bits=8, **STREAMING), 10,
                    local=True)[0]
  chex.assert_trees_all_close(quantized, unquantized, atol=2e-3)
  assert any(float(jnp.max(jnp.abs(a - b))) > 0 for a, b in
             zip(jax.tree.leaves(quantized), jax.tree.leaves(unquantized)))


@pytest.mark.parametrize("bits, chunk", [(4, 16), (2, None)])
def test_bytes_per_step_match_the_formula(bits, chunk):
  mesh, period, fragments = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL), 8, 2
  params = {"a": jnp.zeros((16, 20)), "b": jnp.zeros((30,))}
  tx = streaming_diloco(optax.sgd(0.1), period, fragments=fragments, bits=bits, chunk=chunk)
  state, step = apply_fn(tx, to_device_local(params, mesh), mesh, P(AXES))
  grads = jax.tree.map(lambda p: jnp.zeros((HOSTS * LOCAL, *p.shape)), params)
  report = jaxcomm.accounting.measure(step, to_device_local(params, mesh), state, grads,
                                      mesh=mesh)
  (switch,) = report.conditionals()
  weights = [1 - fragments / period] + [1 / period] * fragments
  measured = report.link_bytes(branch_weights={switch: weights})
  shards = [-(-p.size // LOCAL) for p in params.values()]
  scales = lambda s: 1 if chunk is None else -(-s // chunk)  # noqa: E731
  # the gather sends codes and scales as one buffer of exactly their bytes
  slow = sum((HOSTS - 1) * (packed_nbytes(s, bits) + 4 * scales(s))
             for s in shards) / period
  # compressed_allreduce's non-finite check: a 4-byte all-reduce over every device per sync
  slow += fragments * 2 * (HOSTS * LOCAL - 1) / (HOSTS * LOCAL) * 4 / period
  fast = sum(2 * (LOCAL - 1) * 4 * s for s in shards) / period
  assert measured == pytest.approx({"host": slow, "local": fast})


def test_2_bit_streaming_diloco_trains_the_mlp():
  baseline = eval_loss(sync_sgd(0.1, 60)[0])
  params, _, losses, _, _ = train(streaming_diloco(optax.adam(3e-3), 4, bits=2), 60,
                                  local=True)
  assert eval_loss(params, local=True) < baseline + 0.1, (losses, baseline)
  assert losses[-1] < 0.8 * losses[0]


def test_fragment_collectives_are_selected_by_replicated_values():
  selectors = branch_selectors(traced_step(streaming_diloco(optax.sgd(0.1), 4), True))
  guarded = [varying for varying, collective in selectors if collective]
  assert guarded and all(not varying for varying in guarded), selectors


@pytest.mark.parametrize("kwargs, match", [
    ({"bits": 0}, r"bits must be in \[1, 32\], got 0"),
    ({"bits": 16}, r"bits must be in \[1, 8\] or 32, got 16"),
    ({"chunk": 0}, "chunk must be >= 1, got 0"),
    ({"fragments": 3}, "period must be a multiple of fragments"),
    ({"delay": 2}, r"delay must be in \[0, 1\], got 2"),
    ({"mixing": 1.0}, r"mixing must be in \[0, 1\), got 1.0"),
])
def test_bad_arguments_raise_at_construction_naming_parameter_and_value(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    streaming_diloco(optax.sgd(0.1), 4, **kwargs)


def test_integer_leaves_are_refused_at_init():
  mesh = jaxcomm.make_mesh(hosts=HOSTS, local=LOCAL)
  params = to_device_local({"w": jnp.zeros((4, 4)), "n": jnp.zeros((4,), jnp.int32)}, mesh)
  with pytest.raises(TypeError, match=r"params\[0\] must be a float32.*got dtype int32"):
    jaxcomm.optim.sharded_init(streaming_diloco(optax.sgd(0.1), 4), params, mesh, P(AXES))
