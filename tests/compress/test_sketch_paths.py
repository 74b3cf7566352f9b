"""The count sketch's two formulations: a loop over steps of blocks for the CPU, all blocks at
once for accelerators. Both are run here on the CPU and must agree: same hashes, so the same
table up to the order of float sums, and the same estimates from one table."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compress import count_sketch
from jaxcomm._src.compress.sketch import (_estimates_at_once, _estimates_in_steps,
                                          _heavy_hitters, _heavy_in_steps, _table_at_once,
                                          _table_in_steps)


# Unrolled steps (512x5, 16384x5), one unrolled step (1006x1), vmapped slices over several
# steps (4096x2, 64x3), blocks narrower than the unrolling (7x1), two sign words (33, 64 rows),
# partial last blocks, and inputs of one block or less.
@pytest.mark.parametrize("size,width,depth,seed", [
    (20000, 512, 5, 0), ((1 << 20) + 3, 16384, 5, 1), (50304, 1006, 1, 2),
    ((1 << 19) + 7, 4096, 2, 3), (1000, 64, 3, 4), (2501, 7, 1, 5), (1200, 100, 33, 6),
    (700, 50, 64, 7), (300, 512, 5, 8), (1, 16, 3, 9)])
def test_accelerator_path_equals_cpu_path(size, width, depth, seed):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal(size).astype(np.float32))
  key = jax.random.fold_in(jax.random.PRNGKey(seed), size)
  in_steps = jax.jit(lambda x, key: _table_in_steps(x, key, width, depth))(x, key)
  at_once = jax.jit(lambda x, key: _table_at_once(x, key, width, depth))(x, key)
  # Each bucket sums about size / width signed normals: float32 rounding of the order of
  # 1e-7 sqrt(size / width) sqrt(blocks), far below any one element's contribution.
  np.testing.assert_allclose(at_once, in_steps, rtol=1e-5, atol=1e-5)
  estimates = jax.jit(lambda table, key: (_estimates_in_steps(table, key, size),
                                          _estimates_at_once(table, key, size)))
  np.testing.assert_array_equal(*estimates(in_steps, key))


def _lowered(function, argument, platform):
  return jax.jit(function).trace(argument).lower(lowering_platforms=(platform,)).as_text()


def test_accelerator_lowering_has_no_loop_and_cpu_lowering_loops():
  """Lowered for a GPU, encode and decode (without ``heavy``, whose selection is
  ``largest_k``'s) have no while loop, whatever the input size; for the CPU they loop over
  steps. ``platform_dependent`` keeps only the platform's branch."""
  size = 1 << 22
  compressor = count_sketch(16384, 5)
  state = compressor.init((size,), jnp.float32)
  x = jax.ShapeDtypeStruct((size,), jnp.float32)
  encode = lambda x: compressor.encode(x, state, None)[0]
  payload = jax.eval_shape(encode, x)
  decode = lambda payload: compressor.decode(payload, (size,))
  for function, argument in ((encode, x), (decode, payload)):
    assert "stablehlo.while" not in _lowered(function, argument, "cuda")
    assert "stablehlo.while" in _lowered(function, argument, "cpu")


def test_accelerator_functions_compile_to_a_few_fused_ops_without_a_loop():
  """Compiled, neither holds a loop; for the CPU, the table is one reduction of one fused
  elementwise input and the estimates one fused elementwise op (no per-block kernels). An
  H200's compiler made 7 fusions of the table, none a loop (session 15)."""
  size, width, depth = 1 << 22, 512, 5
  x = jax.ShapeDtypeStruct((size,), jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  table = jax.ShapeDtypeStruct((depth, width), jnp.float32)
  for function, arguments, most in (
      (lambda x, key: _table_at_once(x, key, width, depth), (x, key), 2),
      (lambda table, key: _estimates_at_once(table, key, size), (table, key), 1)):
    compiled = jax.jit(function).trace(*arguments).lower().compile().as_text()
    entry = compiled[compiled.index("ENTRY"):]
    assert " while(" not in compiled
    if jax.default_backend() == "cpu":
      assert entry.count(" fusion(") <= most


# Whole steps only (1M in blocks of 16,384, 5 rows: 8 steps), whole steps and a partial one
# (1M + 3; 300,000 in blocks of 512; 2 rows of 4,096 over steps of 64 blocks), one step
# (40,000 in blocks of 100), a partial step alone (blocks of 65,536), 7 rows; normal values,
# values with many ties, and zeros (whose threshold is not a normal float: the exact branch).
@pytest.mark.parametrize("size,width,depth,heavy", [
    (1 << 20, 16384, 5, 0.01), ((1 << 20) + 3, 16384, 5, 0.01), (300000, 512, 5, 0.02),
    ((1 << 19) + 7, 4096, 2, 0.01), (40000, 100, 3, 0.05), (40000, 65536, 3, 0.01),
    (1 << 18, 1024, 7, 0.001)])
@pytest.mark.parametrize("values", ["normal", "ties", "zeros"])
def test_cpu_heavy_hitters_equal_the_estimates_selected_by_largest_k(size, width, depth, heavy,
                                                                     values):
  """The CPU's heavy-hitter decode (the estimates written in one loop with the candidates'
  bit words, the sample and the candidates recomputed from the table) keeps the same
  estimates, bit for bit, as the estimates selected by ``largest_k`` and masked."""
  x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
  x = {"normal": x, "ties": np.round(2 * x), "zeros": 0 * x}[values]
  compressor, encode, decode, kept = _heavy_hitter_functions(size, width, depth, heavy)
  payload, _ = encode(jnp.asarray(x), compressor.init((size,), jnp.float32))
  decoded = decode(payload.table, payload.key)
  np.testing.assert_array_equal(*decoded)
  assert np.count_nonzero(decoded[0]) == (0 if values == "zeros" else kept)


@functools.cache
def _heavy_hitter_functions(size, width, depth, heavy):
  """``(compressor, encode, decode, kept)`` of one sketch shape, jitted once and shared by its
  three kinds of values (the same shapes: one compilation each instead of three)."""
  compressor = count_sketch(width, depth, heavy=heavy, seed=depth)
  kept = max(1, int(np.floor(heavy * size)))
  encode = jax.jit(lambda x, state: compressor.encode(x, state, None))
  decode = jax.jit(lambda table, key: (_heavy_in_steps(table, key, size, kept), _heavy_hitters(
      _estimates_in_steps(table, key, size), kept)))
  return compressor, encode, decode, kept


@pytest.mark.parametrize("size,width", [(50304, 1006), (16 * 512 + 5, 512)])
def test_one_row_unrolled_step_is_the_blocks_signed_rotated_and_summed_in_order(size, width):
  """One row over a single unrolled step (charlm's shard, and 17 blocks with a partial last
  one): the table is the blocks' signed rotations added in block order, and the estimates
  each element's signed bucket, bit for bit against that reference in numpy (no fused
  multiply-add in float32 sums)."""
  from jaxcomm._src.compress.sketch import _blocks, sketch_hashes
  total, steps, _, unrolled = _blocks(size, width, 1)
  assert steps == 1 and unrolled
  x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
  key = jax.random.fold_in(jax.random.PRNGKey(0), size)
  table, estimates = jax.jit(lambda x, key: (
      (table := _table_in_steps(x, key, width, 1)), _estimates_in_steps(table, key, size)))(
          jnp.asarray(x), key)
  hashes = sketch_hashes(key, 0, total, total, width, 1)
  signs = np.where(np.asarray(hashes.signs[0]) & 1, 1.0, -1.0).astype(np.float32)
  shifts = np.asarray(hashes.shifts[0])
  signed = np.pad(x, (0, total * width - size)).reshape(total, width) * signs
  buckets = (np.arange(width)[None, :] + shifts[:, None]) % width
  expected = np.zeros(width, np.float32)
  for block in range(total):
    rotated = np.zeros(width, np.float32)
    rotated[buckets[block]] = signed[block]
    expected = expected + rotated
  np.testing.assert_array_equal(table, (np.zeros(width, np.float32) + expected)[None])
  np.testing.assert_array_equal(estimates, (signs * expected[buckets]).reshape(-1)[:size])
