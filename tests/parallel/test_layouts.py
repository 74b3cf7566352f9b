"""Layouts: permutations, positions, the causal block schedule and its load balance."""

import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from jaxcomm.parallel import (LAYOUTS, BlockKind, block_schedule, from_layout,
                              layout_permutation, shard_positions, tile_counts, to_layout)


def test_zigzag_and_striped_examples():
  np.testing.assert_array_equal(layout_permutation("zigzag", 8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(layout_permutation("striped", 8, 2), [0, 2, 4, 6, 1, 3, 5, 7])
  np.testing.assert_array_equal(layout_permutation("contiguous", 4, 2), [0, 1, 2, 3])


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(layout=st.sampled_from(LAYOUTS), shards=st.sampled_from([1, 2, 3, 4, 8]),
                  multiple=st.integers(1, 5))
def test_round_trip_and_positions(layout, shards, multiple):
  seq = 2 * shards * multiple
  x = jnp.arange(3 * seq).reshape(3, seq)
  laid_out = to_layout(x, layout, shards)
  np.testing.assert_array_equal(from_layout(laid_out, layout, shards), x)
  perm = layout_permutation(layout, seq, shards)
  assert sorted(perm) == list(range(seq))
  local = seq // shards
  for r in range(shards):
    positions = np.asarray(shard_positions(layout, local, shards, r))
    np.testing.assert_array_equal(positions, perm[r * local:(r + 1) * local])
    assert np.all(np.diff(positions) > 0)  # the schedule's local causal masks rely on this


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(layout=st.sampled_from(LAYOUTS), shards=st.sampled_from([1, 2, 3, 4, 8]),
                  multiple=st.integers(1, 3))
def test_schedule_computes_exactly_the_unmasked_pairs(layout, shards, multiple):
  """Brute force: the mask a block kind implies equals the global causal mask of the block."""
  seq = 2 * shards * multiple
  local = seq // shards
  perm = layout_permutation(layout, seq, shards)
  table = block_schedule(layout, shards, causal=True)
  rows, cols = np.meshgrid(np.arange(local), np.arange(local), indexing="ij")
  half = local // 2
  for r in range(shards):
    for s in range(shards):
      want = perm[r * local:(r + 1) * local][:, None] >= perm[s * local:(s + 1) * local][None]
      kind = BlockKind(table[r, s])
      implied = {
          BlockKind.SKIP: np.zeros_like(want),
          BlockKind.FULL: np.ones_like(want),
          BlockKind.CAUSAL: cols <= rows,
          BlockKind.STRICT: cols < rows,
          BlockKind.LEADING_KEYS: cols < half,
          BlockKind.TRAILING_QUERIES: rows >= half,
      }[kind]
      np.testing.assert_array_equal(implied, want, err_msg=f"{layout} r={r} s={s} {kind!r}")


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_causal_load_balance(shards, capsys):
  zigzag = tile_counts("zigzag", shards, causal=True)
  striped = tile_counts("striped", shards, causal=True)
  contiguous = tile_counts("contiguous", shards, causal=True)
  assert np.all(zigzag == zigzag[0]) and zigzag[0] == 2 * shards + 2
  assert np.all(striped == striped[0])
  np.testing.assert_array_equal(contiguous, 4 * np.arange(1, shards + 1))
  with capsys.disabled():
    print(f"\nP={shards} tiles per device under a causal mask: contiguous {contiguous.tolist()} "
          f"(max/min {contiguous.max() / contiguous.min():.0f}x), zigzag {zigzag.tolist()}, "
          f"striped {striped.tolist()}")
  # Zigzag skips the fully masked half of every off-diagonal block: about half the work.
  assert zigzag.sum() < 0.5 * 4 * shards * shards + 4 * shards


def test_non_causal_computes_every_block():
  for layout in LAYOUTS:
    assert np.all(block_schedule(layout, 4, causal=False) == BlockKind.FULL)


def test_bad_layout_and_length():
  with pytest.raises(ValueError, match="layout='diagonal'"):
    to_layout(jnp.zeros((1, 8)), "diagonal", 2)
  with pytest.raises(ValueError, match="sequence length 12 .* layout='zigzag'"):
    to_layout(jnp.zeros((1, 12)), "zigzag", 4)
  with pytest.raises(ValueError, match="layout='rows'"):
    block_schedule("rows", 2, causal=True)
