"""``compressed_allreduce(powersgd(r))`` sends the rank-r factors, as powersgd_allreduce does."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from update_helpers import measure_update, update_fn
import fast_random

M, N, BIAS, RANK = 48, 32, 32, 2


def _params():
  return {"w": jnp.zeros((M, N)), "b": jnp.zeros(BIAS)}


def test_inter_host_bytes_are_the_factors_of_powersgd_allreduce():
  hosts, local = 4, 2
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  routed = measure_update(jaxcomm.compressed_allreduce(jaxcomm.powersgd(RANK),
                                                       nonfinite="propagate"), _params(), mesh)
  direct = measure_update(jaxcomm.powersgd_allreduce(RANK), _params(), mesh)
  ring = 2 * (hosts - 1) / hosts
  # P (N x r) of the (out, rest) = (N, M) matrix and this device's M / local rows of Q
  # (M x r); the bias is psum-ed dense.
  expected = ring * 4 * (RANK * (N + M // local) + BIAS)
  assert routed.link_bytes()["host"] == pytest.approx(expected)
  assert direct.link_bytes()["host"] == pytest.approx(expected)
  dense = measure_update(jaxcomm.compressed_allreduce(nonfinite="propagate"), _params(), mesh)
  assert routed.link_bytes()["host"] < dense.link_bytes()["host"]


def test_skip_adds_only_the_four_byte_agreement():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  skip = measure_update(jaxcomm.compressed_allreduce(jaxcomm.powersgd(RANK)), _params(), mesh)
  expected = 4 * (RANK * (N + M // 4) + BIAS) + 2 * 7 / 8 * 4
  assert skip.link_bytes()["host"] == pytest.approx(expected)


def test_updates_equal_powersgd_allreduce_with_the_compressor_parameters():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": fast_random.normal(jax.random.PRNGKey(0), (8, M, N)),
           "b": fast_random.normal(jax.random.PRNGKey(1), (8, BIAS))}
  outputs = []
  for tx in (jaxcomm.compressed_allreduce(jaxcomm.powersgd(RANK, seed=3), nonfinite="propagate"),
             jaxcomm.powersgd_allreduce(RANK, seed=3)):
    state, update = update_fn(tx, _params(), mesh)
    first, state = update(grads, state)
    second, _ = update(grads, state)
    outputs.append((first, second))
  chex.assert_trees_all_equal(outputs[0], outputs[1])
  np.testing.assert_allclose(outputs[0][0]["b"], jnp.mean(grads["b"], 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    ({"strategy": "gather"}, "strategy"),
    ({"bucket_bytes": 1 << 20}, "bucket_bytes"),
    ({"residual_dtype": jnp.bfloat16}, "residual_dtype"),
])
def test_options_the_matrix_collective_cannot_honour_raise(kwargs, name):
  with pytest.raises(ValueError, match=rf"powersgd\(2\) runs its own matrix collective, "
                     rf"which takes no {name}="):
    jaxcomm.compressed_allreduce(jaxcomm.powersgd(2), **kwargs)


def test_nonfinite_modes_keep_their_meaning():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": jnp.ones((8, M, N)).at[3, 0, 0].set(jnp.nan), "b": jnp.ones((8, BIAS))}
  for mode in ("skip", "zero"):
    tx = jaxcomm.compressed_allreduce(jaxcomm.powersgd(RANK), nonfinite=mode)
    state, update = update_fn(tx, _params(), mesh)
    out, _ = update(grads, state)
    assert bool(jnp.all(jnp.isfinite(out["w"]))), mode
    if mode == "skip":
      assert float(jnp.abs(out["w"]).max()) == 0.0


def test_gradzip_sends_each_hosts_sketch_summed_over_hosts():
  hosts, local = 4, 2
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  compressor = jaxcomm.compress.gradzip(RANK)
  report = measure_update(jaxcomm.compressed_allreduce(compressor, nonfinite="propagate"),
                          _params(), mesh)
  # the (N, M) matrix view's long side M times r float32 values + the 8-byte key; bias dense
  payload = compressor.wire_bytes((M, N), jnp.float32) + compressor.wire_bytes((BIAS,),
                                                                               jnp.float32)
  assert payload == 4 * RANK * M + 8 + 4 * BIAS
  # the 8-byte key is replicated (every host drew it from the same seed): psum leaves it out
  assert report.link_bytes()["host"] == pytest.approx(2 * (hosts - 1) / hosts * (payload - 8))


def test_gradzip_mean_is_the_sketch_of_the_mean_and_feedback_telescopes():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  grads = {"w": fast_random.normal(jax.random.PRNGKey(0), (8, M, N)),
           "b": fast_random.normal(jax.random.PRNGKey(1), (8, BIAS))}
  compressor = jaxcomm.compress.gradzip(RANK, seed=5)
  tx = jaxcomm.compressed_allreduce(compressor, nonfinite="propagate")
  state, update = update_fn(tx, _params(), mesh)
  sent = jax.tree.map(jnp.zeros_like, _params())
  for _ in range(3):
    out, state = update(grads, state)
    sent = jax.tree.map(jnp.add, sent, out)
  mean = jax.tree.map(lambda g: jnp.mean(g, 0), grads)
  np.testing.assert_allclose(out["b"], mean["b"], rtol=1e-5, atol=1e-6)
  # error feedback: the 3 means sent plus what both hosts still hold is 3 true means
  pending = state.residual[1].reshape(2, M, N).sum(0)  # residuals are per host, P('host')
  np.testing.assert_allclose(sent["w"] + pending, 3 * mean["w"], rtol=1e-4, atol=1e-5)
  assert float(jnp.linalg.norm(pending)) > 0.1 * float(jnp.linalg.norm(mean["w"]))
