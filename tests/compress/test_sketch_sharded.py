"""The count sketch's chunk loop inside shard_map: its carry follows the data's mesh axes."""

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxcomm

AXES = ("host", "local")


def test_count_sketch_on_device_local_data_inside_shard_map_equals_outside():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  compressor = jaxcomm.compress.count_sketch(64, 3)
  state = compressor.init((3000,), np.float32)
  roundtrip = lambda v: compressor.decode(compressor.encode(v, state, None)[0], v.shape)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))
  def per_device(x):
    return roundtrip(x[0])[None]

  x = jax.random.normal(jax.random.PRNGKey(0), (8, 3000))
  # The blocks' sums into a row are reduced in another order under vmap: float rounding,
  # a few 1e-6 on estimates of order 1 (the scatter-adds before session 12 ran in one order).
  np.testing.assert_allclose(per_device(x), jax.vmap(roundtrip)(x), rtol=1e-6, atol=1e-5)
