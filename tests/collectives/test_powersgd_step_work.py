"""PowerSGD's collective does less work per step with the same result: every ``P`` in one
all-reduce per axis, and ``P = M Q`` of small row blocks as rank-1 terms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import accounting
from jaxcomm._src.collectives.powersgd import psum_together
from jaxcomm._src.compress.powersgd import RANK_ONE_ROWS, project_rows, rank_one_sum

AXES = ("host", "local")
SHAPES = ((1, 16, 4), (2, 256, 4), (3, 5))


def _summed(mesh, together: bool):
  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P())
  def run(*parts):
    parts = [part[0] for part in parts]
    if together:
      return psum_together(parts, ("local", "host"))
    return [jax.lax.psum(jax.lax.psum(part, "local"), "host") for part in parts]
  return run


def test_psum_together_is_one_all_reduce_per_axis_with_the_same_sums():
  mesh = jaxcomm.make_mesh(hosts=2, local=4)
  keys = jax.random.split(jax.random.PRNGKey(0), len(SHAPES))
  parts = [jax.random.normal(key, (8,) + shape) for key, shape in zip(keys, SHAPES)]
  together = _summed(mesh, True)(*parts)
  for got, expected in zip(together, _summed(mesh, False)(*parts)):
    np.testing.assert_array_equal(got, expected)
  report = accounting.measure(_summed(mesh, True), *parts, mesh=mesh)
  counts = {axes: [op.kind for op in report.collectives if op.axes == axes]
            for axes in (("local",), ("host",))}
  assert counts == {("local",): ["all-reduce"], ("host",): ["all-reduce"]}
  assert psum_together([], ("local", "host")) == []


@pytest.mark.parametrize("shape,rank", [((64, 16), 4), ((64, 256), 4), ((2, 128, 256), 4),
                                        ((RANK_ONE_ROWS, 33), 1), ((7, 5), 3)])
def test_rank_one_sum_is_the_product(shape, rank):
  """Against float64; bit for bit against the einsum it replaces on charlm's row blocks (the
  first three shapes, XLA's CPU backend)."""
  keys = jax.random.split(jax.random.PRNGKey(1))
  rows = jax.random.normal(keys[0], shape)
  q = jax.random.normal(keys[1], shape[:-1] + (rank,))
  got = np.asarray(jax.jit(project_rows)(rows, q))
  np.testing.assert_array_equal(got, jax.jit(rank_one_sum)(rows, q))
  expected = np.einsum("...ko,...kr->...or", np.asarray(rows, np.float64),
                       np.asarray(q, np.float64))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  if shape[-1] >= 16 and rank == 4:
    plain = jax.jit(lambda rows, q: jnp.einsum("...ko,...kr->...or", rows, q))(rows, q)
    np.testing.assert_array_equal(got, plain)
