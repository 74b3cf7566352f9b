"""PowerSGD's Gram-Schmidt in the transposed layout, and the step's one padded batch of it.

``orthogonalize_t`` (the same Gram-Schmidt on the rows of ``P^T``) replaced the ``(m, r)``
column form that ``orthogonalize`` ran until session 18, and the collective now
orthogonalizes every leaf's ``P^T`` in one batch zero-padded to the largest ``m``. Both are the
same algorithm up to the order of each reduction's sum: checked here against the former
form (:func:`_column_by_column`, its code), against float64, and on zero, dependent and
non-finite columns, where the former behaviour is kept.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gram_schmidt_reference import gram_schmidt_float64
from jaxcomm._src.collectives.powersgd import orthogonalize_batched
from jaxcomm._src.compress.powersgd import PRECISION, orthogonalize, orthogonalize_t

# Equal up to rounding: float32 columns of norm <= 1, compared elementwise.
TOLERANCE = 1e-5


def _column_by_column(p, epsilon=1e-8):
  """``orthogonalize`` as it was before session 18 (``p`` of shape ``(..., m, r)``)."""
  columns = []
  for index in range(p.shape[-1]):
    column = p[..., index]
    for previous in columns:
      overlap = jnp.einsum("...m,...m->...", previous, column, precision=PRECISION)
      column = column - overlap[..., None] * previous
    columns.append(column / (jnp.linalg.norm(column, axis=-1, keepdims=True) + epsilon))
  return jnp.stack(columns, axis=-1)


def _degenerate(key, batch, m, rank, kinds):
  """A ``(batch, m, rank)`` batch whose columns are random, zero, or copies of column 0,
  as ``kinds`` (one per column) says."""
  p = jax.random.normal(key, (batch, m, rank))
  columns = [jnp.zeros((batch, m)) if kind == "zero" else p[..., 0] if kind == "copy"
             else p[..., index] for index, kind in enumerate(kinds)]
  return jnp.stack(columns, axis=-1)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 300), rank=st.integers(1, 4), batch=st.integers(1, 3),
       seed=st.integers(0, 2**16))
@example(m=3, rank=3, batch=1, seed=32540)  # cond 1,044
def test_transposed_gram_schmidt_is_the_former_one_up_to_rounding(m, rank, batch, seed):
  p = jax.random.normal(jax.random.PRNGKey(seed), (batch, m, rank))
  got = np.asarray(jax.jit(orthogonalize_t)(jnp.swapaxes(p, -1, -2)))
  assert got.shape == (batch, rank, m)
  got = np.swapaxes(got, -1, -2)
  # One computation in two layouts: bit for bit on XLA's CPU backend; a GPU's reductions
  # round the two layouts differently (an H200: up to 1.8e-7 relative, session 20).
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(got, jax.jit(orthogonalize)(p))
  else:
    np.testing.assert_allclose(got, jax.jit(orthogonalize)(p), rtol=1e-6, atol=1e-7)
  former = np.asarray(jax.jit(_column_by_column)(p))
  independent = min(m, rank)  # past the m-th, columns are rounding noise (see orthogonalize)
  # Gram-Schmidt's rounding error, and its loss of orthogonality, grow with the condition
  # number of the independent columns (about cond * eps); a random square matrix can have
  # cond ~ 1,000 (test_lowrank_vote_config.py has such a case).
  cond = max(np.linalg.cond(np.asarray(p[index, :, :independent])) for index in range(batch))
  slack = 16 * cond * np.finfo(np.float32).eps
  np.testing.assert_allclose(got[..., :independent], former[..., :independent],
                             atol=max(TOLERANCE, slack))
  assert np.all(np.linalg.norm(got, axis=-2) <= 1 + 1e-6)
  if m >= rank:
    for index in range(batch):
      np.testing.assert_allclose(got[index], gram_schmidt_float64(np.asarray(p[index])),
                                 atol=max(2e-4, slack))
      np.testing.assert_allclose(got[index].T @ got[index], np.eye(rank),
                                 atol=max(1e-5, slack / 4))


@settings(max_examples=20, deadline=None)
@given(kinds=st.lists(st.sampled_from(["random", "random", "zero", "copy"]), min_size=1,
                      max_size=4),
       m=st.integers(4, 64), seed=st.integers(0, 2**16))
# A right-looking order (each normalized row's overlaps with all later rows in one
# reduction) gave this copy a norm of 1.09 and the last column 1.002 under the suite's XLA
# flags: XLA computed the copy's cancelling difference once for its norm and once for the
# division, rounded differently.
@example(kinds=["random", "copy", "random", "random"], m=4, seed=0)
def test_zero_and_dependent_columns_as_before(kinds, m, seed):
  """A zero column stays exactly zero (and changes no other column), a copy of an earlier
  column keeps only rounding noise of norm at most 1; the independent columns before the
  first copy are the former Gram-Schmidt's up to rounding (later ones are orthogonalized
  against that noise, in the former form too, so they depend on how it rounded)."""
  kinds[0] = "random" if kinds[0] == "copy" else kinds[0]
  p = _degenerate(jax.random.PRNGKey(seed), 2, m, len(kinds), kinds)
  got = np.asarray(jax.jit(orthogonalize)(p))
  former = np.asarray(jax.jit(_column_by_column)(p))
  assert np.all(np.isfinite(got))
  assert np.all(np.linalg.norm(got, axis=-2) <= 1 + 1e-6)
  copies = [index for index, kind in enumerate(kinds) if kind == "copy"]
  independent = [index for index, kind in enumerate(kinds[:min(copies, default=len(kinds))])
                 if kind == "random"]
  for index, kind in enumerate(kinds):
    if kind == "zero":
      np.testing.assert_array_equal(got[..., index], 0.0)
      np.testing.assert_array_equal(former[..., index], 0.0)
  if not independent:
    return
  alone = np.asarray(orthogonalize(p[..., independent]))
  np.testing.assert_allclose(got[..., independent], former[..., independent], atol=TOLERANCE)
  np.testing.assert_allclose(got[..., independent], alone, atol=TOLERANCE)


def test_epsilon_zero_makes_a_zero_column_nan_as_before():
  p = jnp.stack([jnp.arange(1.0, 6.0), jnp.zeros(5)], axis=1)
  got, former = np.asarray(orthogonalize(p, 0.0)), np.asarray(_column_by_column(p, 0.0))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(former))
  assert np.all(np.isnan(got[:, 1]))
  np.testing.assert_allclose(got[:, 0], former[:, 0], atol=TOLERANCE)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [(0, 0), (3, 1), (0, 3)])
def test_non_finite_entries_spread_as_before(value, position):
  p = jax.random.normal(jax.random.PRNGKey(2), (7, 4)).at[position].set(value)
  got, former = np.asarray(orthogonalize(p)), np.asarray(_column_by_column(p))
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(former))
  assert not np.all(np.isfinite(got[:, position[1]:]))


@settings(max_examples=10, deadline=None)
@given(widths=st.lists(st.sampled_from([1, 5, 16, 64, 256]), min_size=1, max_size=4),
       stacks=st.lists(st.integers(1, 3), min_size=4, max_size=4),
       rank=st.integers(1, 4), zero_column=st.booleans(), seed=st.integers(0, 2**16))
def test_one_padded_batch_is_each_stacks_gram_schmidt(widths, stacks, rank, zero_column, seed):
  """The collective's batch of every leaf's ``P^T`` (zero-padded to the widest ``m``) gives
  each stack what its own ``orthogonalize_t`` and the former per-leaf Gram-Schmidt give, up to
  rounding; zero columns stay exactly zero."""
  keys = jax.random.split(jax.random.PRNGKey(seed), len(widths))
  factors = [jax.random.normal(key, (stack, rank, width))
             for key, stack, width in zip(keys, stacks, widths)]
  if zero_column:
    factors = [factor.at[:, -1].set(0.0) for factor in factors]
  got = jax.jit(lambda factors: orthogonalize_batched(factors, 1e-8))(factors)
  for factor, result in zip(factors, got):
    assert result.shape == factor.shape
    independent = min(rank - zero_column, factor.shape[-1])
    alone = np.asarray(orthogonalize_t(factor))
    former = np.swapaxes(np.asarray(_column_by_column(jnp.swapaxes(factor, -1, -2))), -1, -2)
    np.testing.assert_allclose(result[:, :independent], alone[:, :independent], atol=TOLERANCE)
    np.testing.assert_allclose(result[:, :independent], former[:, :independent],
                               atol=TOLERANCE)
    if zero_column:
      np.testing.assert_array_equal(result[:, -1], 0.0)
    assert np.all(np.linalg.norm(np.asarray(result), axis=-1) <= 1 + 1e-6)


def test_no_factorized_leaves_no_batch():
  assert orthogonalize_batched([], 1e-8) == []
