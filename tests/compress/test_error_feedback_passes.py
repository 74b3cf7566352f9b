"""Error feedback's non-finite check from a plain sum of the residual (the CPU's formulation):
the same flag, payload and state as a check of every entry, bit for bit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm import compress
from jaxcomm._src.compress import error_feedback as error_feedback_module
from jaxcomm._src.compress.base import subtract_decoded
from jaxcomm._src.nonfinite import has_nonfinite
from platform_paths import use_accelerator_path

# NaN, the infinities, and finite values whose sum overflows to Inf (the fallback's case).
SPECIALS = (np.nan, np.inf, -np.inf, 3e38, -3e38)


def _values(seed: int, size: int, specials: int, choices=SPECIALS) -> np.ndarray:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(size).astype(np.float32)
  where = rng.choice(size, min(specials, size), replace=False)
  x[where] = rng.choice(choices, where.shape[0])
  return x


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(size=st.integers(1, 3000), specials=st.sampled_from([0, 1, 2, 5, 300]),
       finite_only=st.booleans(), seed=st.integers(0, 2**16))
def test_sum_check_is_the_check_of_every_entry(size, specials, finite_only, seed):
  """Finite values whose sum overflows (``finite_only``: only +-3e38 planted) are finite;
  one NaN or Inf anywhere is not."""
  choices = SPECIALS[3:] if finite_only else SPECIALS
  unsent = jnp.asarray(_values(seed, size, specials, choices))
  fast = jax.jit(error_feedback_module._unsent_nonfinite)(unsent)
  assert bool(fast) == bool(has_nonfinite(unsent))


def test_overflowing_sum_of_finite_entries_is_finite():
  unsent = jnp.array([3e38, 3e38, 1.0], jnp.float32)
  assert not np.isfinite(np.float32(jnp.sum(unsent)))
  assert not bool(jax.jit(error_feedback_module._unsent_nonfinite)(unsent))


def _plain_encode(inner, x, state, key):
  """Error feedback as it was: the whole residual checked entry by entry, then kept or not."""
  corrected = x.astype(jnp.float32) + state.residual
  payload, inner_state = inner.encode(corrected, state.inner, key)
  unsent = subtract_decoded(inner, corrected, payload)
  bad = has_nonfinite(unsent)
  keep = lambda old, new: jnp.where(bad, old, new) if jnp.issubdtype(new.dtype, jnp.inexact) else new
  return payload, compress.ErrorFeedbackState(
      jnp.where(bad, state.residual, unsent), jax.tree.map(keep, state.inner, inner_state))


INNER = {
    "int8_nearest": lambda: compress.quantize(8, stochastic=False),
    "sign": compress.sign,
    "threshold": lambda: compress.threshold(0.5, capacity=0.1),
    "adaptive_threshold": lambda: compress.adaptive_threshold(0.05),
    "powersgd": lambda: compress.powersgd(2),
}


def _inputs(shape):
  size = int(np.prod(shape))
  yield jnp.asarray(_values(0, size, 0)).reshape(shape)
  yield jnp.asarray(_values(1, size, 3)).reshape(shape)           # NaN / Inf / huge
  yield jnp.asarray(_values(2, size, 4, SPECIALS[3:])).reshape(shape)  # huge only
  yield jnp.full(shape, 1e38, jnp.float32)                       # sums overflow, finite


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("name", sorted(INNER))
def test_error_feedback_state_and_payload_are_the_plain_checks(name, accelerator, monkeypatch,
                                                               request):
  """Three steps from a nonzero residual, with NaN, infinities and finite inputs whose
  residual sums overflow: payloads and states equal the entry-by-entry check's, bit for bit,
  and the residual is never NaN or Inf."""
  if accelerator:
    use_accelerator_path(monkeypatch, request)
  inner = INNER[name]()
  compressor = compress.error_feedback(inner)
  shape = (48, 40) if inner.needs_matrix else (601,)
  state = compressor.init(shape, jnp.float32)
  state = state._replace(residual=0.1 * jax.random.normal(jax.random.PRNGKey(5), shape))
  encode = jax.jit(compressor.encode)
  plain = jax.jit(lambda x, state, key: _plain_encode(inner, x, state, key))
  for step, x in enumerate(_inputs(shape)):
    key = jax.random.PRNGKey(step)
    payload, new_state = encode(x, state, key)
    expected_payload, expected_state = plain(x, state, key)
    chex.assert_trees_all_equal(payload, expected_payload)
    chex.assert_trees_all_equal(new_state, expected_state)
    chex.assert_tree_all_finite(new_state.residual)
    state = new_state
