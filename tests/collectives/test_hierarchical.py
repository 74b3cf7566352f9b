"""The two-level allreduce against dense references on simulated meshes."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.collectives.hierarchical import reduce_shards, scattered_check_exact
from jaxcomm._src.nonfinite import agree, any_nonfinite
from jaxcomm.collectives import init_states, level, prescattered
import fast_random

AXES = ("host", "local")


def _allreduce_fn(mesh, compressor, shape, feedback=False, strategy=None):
  """Jitted ``run(x_per_device, key) -> (mean, slow-level state)``, two levels."""
  levels = (level("local"), level("host", compressor, feedback=feedback, strategy=strategy))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXES), P()),
                     out_specs=(P(), P(AXES)))
  def run(x, key):
    states = init_states(levels, int(np.prod(shape)), x.dtype)
    mean, states = jaxcomm.collectives.hierarchical_allreduce(x[0], levels, states, key)
    return mean, jax.tree.map(lambda s: s[None], states[1])

  return run


def _allreduce(mesh, compressor, x_per_device, key=jax.random.PRNGKey(0), **kwargs):
  return _allreduce_fn(mesh, compressor, x_per_device.shape[1:], **kwargs)(x_per_device, key)


@pytest.mark.parametrize("hosts, local", [(2, 4), (1, 8), (8, 1), (4, 2)])
@pytest.mark.parametrize("shape", [(5, 7), (1,)])
def test_identity_equals_pmean(hosts, local, shape):
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  x = fast_random.normal(jax.random.PRNGKey(1), (8, *shape))
  mean, _ = _allreduce(mesh, jaxcomm.identity(), x)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P())
  def pmean(v):
    return jax.lax.pmean(v[0], AXES)

  chex.assert_trees_all_close(mean, pmean(x), rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(mean, jnp.mean(x, axis=0), rtol=1e-5, atol=1e-6)


def test_full_precision_without_compressor_equals_mean_in_input_dtype():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  x = fast_random.normal(jax.random.PRNGKey(2), (8, 10)).astype(jnp.bfloat16)
  mean, _ = _allreduce(mesh, None, x)
  assert mean.dtype == jnp.bfloat16
  chex.assert_trees_all_close(mean.astype(jnp.float32), jnp.mean(x.astype(jnp.float32), 0),
                              atol=2e-2)


def test_topk_with_error_feedback_matches_a_numpy_reference():
  """Each device's host-summed shard is top-k'ed; hosts' decoded shards are summed."""
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  x = np.asarray(fast_random.normal(jax.random.PRNGKey(3), (8, 12)))
  mean, states = _allreduce(mesh, jaxcomm.topk(k=2), jnp.asarray(x), feedback=True,
                            strategy="gather")
  per_host = (x / 8).reshape(2, 4, 12).sum(axis=1)          # fast reduce: (host, 12)
  shards = per_host.reshape(2, 4, 3)                          # device (h, l) owns shard l
  expected = np.zeros((4, 3))
  residuals = np.zeros((2, 4, 3))
  for h in range(2):
    for l in range(4):
      shard = shards[h, l]
      keep = np.argsort(-np.abs(shard), kind="stable")[:2]
      sent = np.zeros(3)
      sent[keep] = shard[keep]
      expected[l] += sent
      residuals[h, l] = shard - sent
  np.testing.assert_allclose(mean, expected.reshape(12), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(states.residual.reshape(2, 4, 3), residuals, rtol=1e-5, atol=1e-6)


def test_unbiased_int8_mean_over_many_keys():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  x = fast_random.normal(jax.random.PRNGKey(4), (8, 16))
  run = _allreduce_fn(mesh, jaxcomm.quantize(2), (16,))
  samples = jnp.stack([run(x, jax.random.PRNGKey(k))[0] for k in range(400)])
  standard_error = jnp.std(samples, axis=0) / np.sqrt(len(samples))
  assert float(jnp.median(jnp.std(samples, axis=0))) > 0.01  # the rounding really is random
  error = jnp.abs(jnp.mean(samples, 0) - jnp.mean(x, 0))
  assert bool(jnp.all(error <= 5 * standard_error + 1e-6)), (error, standard_error)


def test_missing_axis_and_outside_shard_map_raise_clearly():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(("data", "model")), out_specs=P())
  def run(x):
    return jaxcomm.collectives.hierarchical_allreduce(x[0], (level("local"), level("host")), ((), ()),
                                          jax.random.PRNGKey(0))[0]

  with pytest.raises(ValueError, match="mesh axis 'local' is not available"):
    jax.jit(run)(jnp.zeros((8, 3)))
  with pytest.raises(ValueError, match="outside jax.shard_map"):
    jaxcomm.collectives.hierarchical_allreduce(jnp.zeros(3), (level("local"), level("host")), ((), ()),
                                   jax.random.PRNGKey(0))


def _agreed_checks(mesh, levels, x):
  """``(flag from reduce_shards, flag from every input)`` on every device, each agreed."""

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))
  def run(x):
    states = init_states(levels, x[0].size, x.dtype)
    reduced = reduce_shards([x[0]], [levels], [states], [jax.random.PRNGKey(0)])
    return jnp.stack([agree(reduced.nonfinite[0], AXES), any_nonfinite(x[0], AXES)])[None]

  return np.asarray(run(x))


TOPOLOGIES = {
    "dense, bf16 input": ((2, 4), (level("local"), level("host")), jnp.bfloat16),
    "sign over hosts": ((2, 4), (level("local"), level("host", jaxcomm.sign())), jnp.float32),
    "one host": ((1, 8), (level("local"), level("host", jaxcomm.sign())), jnp.float32),
    "fp16 dense level": ((2, 4), (level("local", dtype=jnp.float16), level("host")),
                         jnp.float32),
    "compressed first": ((4, 2), (level("host", jaxcomm.sign()), level("local")), jnp.float32),
}


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_flag_is_exact_on_every_device(name, bad):
  """The shard check (where allowed) flags exactly the steps the full check flags: one bad
  entry on one device, at any position (first, last, inside one device's shard), and never
  finite inputs at the dtype's largest value on every device, nor an empty array."""
  (hosts, local), levels, dtype = TOPOLOGIES[name]
  mesh = jaxcomm.make_mesh(hosts=hosts, local=local)
  largest = float(jnp.finfo(dtype).max)
  extremes = jnp.full((8, 37), largest, dtype).at[:, 1::2].set(-largest)
  np.testing.assert_array_equal(_agreed_checks(mesh, levels, extremes), False)
  np.testing.assert_array_equal(_agreed_checks(mesh, levels, jnp.zeros((8, 0), dtype)), False)
  x = np.asarray(fast_random.normal(jax.random.PRNGKey(5), (8, 37)), np.float32)
  for device, position in [(0, 0), (5, 36), (3, 17), (7, 9)]:
    poisoned = x.copy()
    poisoned[device, position] = bad
    np.testing.assert_array_equal(_agreed_checks(mesh, levels, jnp.asarray(poisoned, dtype)),
                                  True)


def test_shard_check_is_used_where_exact_and_only_there():
  sizes = {"host": 2, "local": 4}.__getitem__
  dense = (level("local"), level("host", jaxcomm.sign()))
  assert scattered_check_exact(dense, jnp.float32, sizes)
  assert scattered_check_exact((level("local", dtype=jnp.float32), level("host")), jnp.float32,
                               sizes)
  assert not scattered_check_exact((level("local", dtype=jnp.float16), level("host")),
                                   jnp.float32, sizes)
  assert not scattered_check_exact((level("host", jaxcomm.sign()), level("local")), jnp.float32,
                                   sizes)
  assert not scattered_check_exact(dense, jnp.float32, {"host": 1, "local": 8}.__getitem__)
  with prescattered(("local",)):  # the first dense level is done: check the input
    assert not scattered_check_exact(dense, jnp.float32, sizes)
