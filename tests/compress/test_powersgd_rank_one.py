"""PowerSGD's ``P = M Q`` of small row blocks as rank-1 terms: the same product, less work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm._src.compress.powersgd import RANK_ONE_ROWS, project_rows, project_rows_t, rank_one_sum

# charlm's row blocks on 2x4 (``rows = M^T`` per device), where the method must stay bit-identical.
CHARLM_BLOCKS = [(64, 16), (64, 256), (2, 128, 256)]


@pytest.mark.parametrize("shape,rank", [(shape, 4) for shape in CHARLM_BLOCKS]
                         + [((RANK_ONE_ROWS, 33), 1), ((7, 5), 3)])
def test_rank_one_sum_is_the_product(shape, rank):
  """``project_rows`` takes the rank-1 path up to ``RANK_ONE_ROWS`` rows (``project_rows_t``
  is its transpose, ``rank_one_sum`` itself); it equals the float64 product up to rounding,
  and on charlm's blocks the einsum it replaces bit for bit."""
  keys = jax.random.split(jax.random.PRNGKey(1))
  rows = jax.random.normal(keys[0], shape)
  q = jax.random.normal(keys[1], shape[:-1] + (rank,))
  got = np.asarray(jax.jit(project_rows)(rows, q))
  transposed = jax.jit(rank_one_sum)(rows, q)
  np.testing.assert_array_equal(jax.jit(project_rows_t)(rows, q), transposed)
  np.testing.assert_array_equal(got, np.swapaxes(transposed, -1, -2))
  expected = np.einsum("...ko,...kr->...or", np.asarray(rows, np.float64),
                       np.asarray(q, np.float64))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  if shape in CHARLM_BLOCKS and jax.default_backend() == "cpu":
    # The GEMM it replaces is XLA's CPU backend's (an H200's differed in the last bits).
    plain = jax.jit(lambda rows, q: jnp.einsum("...ko,...kr->...or", rows, q))(rows, q)
    np.testing.assert_array_equal(got, plain)

