"""The accelerators' formulations of the selection (``backends.by_platform``'s ``accelerator``
functions), run on the CPU: the same values, sets and order as the CPU's.

``jax.lax.platform_dependent`` compiles only the running platform's function, so the tests
replace ``backends.by_platform`` with one that always takes the accelerator's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm.compress import adaptive_threshold, threshold, topk
from jaxcomm._src.compress import select
from jaxcomm._src.compress.select import MIN_FAST_SIZE, accelerator_kth, kth_largest_bits

from platform_paths import patch_accelerator_path

KEY = jax.random.PRNGKey(5)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(rows=st.integers(1, 3), size=st.integers(1, 3000), share=st.floats(0.0, 1.0),
       levels=st.sampled_from([2, 16, None]), empty=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2**16))
def test_accelerator_kth_is_the_cpu_kth(rows, size, share, levels, empty, seed):
  # Rounded magnitudes give exact ties at the k-th value; -1 marks an empty slot. Every row
  # keeps at least k non-negative entries, as the callers guarantee.
  rng = np.random.default_rng(seed)
  magnitude = np.abs(rng.standard_normal((rows, size))).astype(np.float32)
  if levels is not None:
    magnitude = np.round(magnitude * levels) / levels
  bits = np.where(rng.random((rows, size)) < empty, -1, magnitude.view(np.int32))
  k = max(1, int(share * np.min(np.sum(bits >= 0, axis=1))))
  if np.min(np.sum(bits >= 0, axis=1)) == 0:
    bits[:, 0] = 0
  bits = jnp.asarray(bits)

  # One compilation an example holds all four selections (the suite is compile-bound: four
  # separate ones cost about three times as much); each is its own path's computation.
  @jax.jit
  def both_paths(bits):
    return (accelerator_kth(bits, k), kth_largest_bits(bits, k),
            accelerator_kth(bits[0], k), kth_largest_bits(bits[0], k))

  accelerator, cpu, accelerator_row, cpu_row = both_paths(bits)
  np.testing.assert_array_equal(accelerator, cpu)
  assert accelerator_row.shape == cpu_row.shape == () and int(accelerator_row) == int(cpu_row)


def test_accelerator_kth_of_special_patterns():
  # NaN patterns order above infinity, which orders above every finite magnitude.
  special = np.array([np.nan, np.inf, 3.0, 0.0, np.finfo(np.float32).tiny, 1e-45], np.float32)
  bits = jnp.asarray(np.tile(np.abs(special).view(np.int32), 50))
  for k in (1, 50, 51, 101, 150, 300):
    assert int(accelerator_kth(bits, k)) == int(kth_largest_bits(bits, k))


def _encodings(compressor, x):
  return jax.tree.map(np.asarray, jax.jit(compressor.encode)(x, (), KEY)[0])


def _both_paths(compute):
  """``compute`` jitted once with the CPU's formulation and once with the accelerators', both
  traced into one compilation: ``(cpu, accelerator)``. By_platform is replaced while the
  second is traced. Two ``jax.jit`` calls of one function would not do: JAX reuses the first
  trace for the second (same function, same shapes), so the accelerators' formulation would
  never be traced and both results would be the CPU's."""
  @jax.jit
  def both(*args):
    cpu = compute(*args)
    with pytest.MonkeyPatch.context() as monkeypatch:
      patch_accelerator_path(monkeypatch)
      return cpu, compute(*args)
  return both


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(rows=st.integers(1, 2), extra=st.integers(0, 3000), density=st.floats(0.001, 0.03),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_largest_k_selects_the_same_positions_on_both_paths(rows, extra, density, ties, seed):
  size = MIN_FAST_SIZE + extra  # the sampled path: sample, compaction, buffer search, ties
  values = np.random.default_rng(seed).standard_normal((rows, size))
  if ties:
    values = np.round(values * 8) / 8
  values = jnp.asarray(values, jnp.float32)
  k = max(1, int(density * size))

  cpu, accelerator = _both_paths(lambda v: select.largest_k(v, k, by_magnitude=True))(values)
  np.testing.assert_array_equal(accelerator, cpu)


@pytest.mark.parametrize("compressor", [
    topk(0.01), topk(0.01, chunk=4096), threshold(2.0, capacity=0.02),
    threshold(1.0, capacity=0.02), adaptive_threshold(0.01, capacity=0.02)],
    ids=lambda c: c.name)
@pytest.mark.parametrize("ties", [False, True])
def test_compressors_send_the_same_payload_on_both_paths(compressor, ties):
  # threshold(1.0) overflows its capacity: the largest of those above win the slots.
  x = np.random.default_rng(7).standard_normal(3 * MIN_FAST_SIZE + 77)
  if ties:
    x = np.round(x * 4) / 4
  x = jnp.asarray(x, jnp.float32)
  cpu, accelerator = _encoded_on_both_paths(compressor)(x)
  jax.tree.map(np.testing.assert_array_equal, accelerator, cpu)


@functools.cache
def _encoded_on_both_paths(compressor):
  """One compilation per compressor, shared by its two inputs (with and without ties)."""
  return _both_paths(lambda x: compressor.encode(x, (), KEY)[0])


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator backend")
@pytest.mark.parametrize("compressor", [
    topk(0.01), topk(0.01, chunk=65536), threshold(2.5, capacity=0.02),
    threshold(1.0, capacity=0.02), adaptive_threshold(0.01, capacity=0.02)],
    ids=lambda c: c.name)
def test_the_accelerator_sends_the_cpu_payload(compressor):
  # The compiled accelerator path itself (not its CPU compilation) against the CPU backend.
  x = jax.random.normal(KEY, (1 << 22,))
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    expected = _encodings(compressor, jax.device_put(x, cpu))
  jax.tree.map(np.testing.assert_array_equal, _encodings(compressor, x), expected)
