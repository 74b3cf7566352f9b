"""The linear-time top-k selection inside shard_map: loop carries follow the data's mesh axes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.compress.select import MIN_FAST_SIZE

AXES = ("host", "local")


def test_topk_on_device_local_data_inside_shard_map_equals_outside():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  compressor = jaxcomm.topk(0.1)
  roundtrip = lambda v: compressor.decode(compressor.encode(v, (), None)[0], v.shape)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))
  def per_device(x):
    return roundtrip(x[0])[None]

  x = jax.random.normal(jax.random.PRNGKey(0), (8, 2 * MIN_FAST_SIZE))
  # The reference jitted too: run op by op, its compilations cost five times the CPU.
  np.testing.assert_array_equal(per_device(x), jax.jit(jax.vmap(roundtrip))(x))
  assert int(jnp.sum(per_device(x)[3] != 0)) == int(0.1 * 2 * MIN_FAST_SIZE)
