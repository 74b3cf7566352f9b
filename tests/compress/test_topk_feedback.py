"""Top-k inside error feedback: its residual and non-finite check from the payload alone
(``subtract_decoded``, ``unsent_nonfinite``) are exactly the dense reference's."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm.compress import error_feedback, topk
from jaxcomm._src.nonfinite import has_nonfinite

KEY = jax.random.PRNGKey(0)
SPECIALS = (np.nan, np.inf, -np.inf, 1e5)  # 1e5 overflows float16 values


def _input(seed: int, size: int, specials: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(size).astype(np.float32)
  where = rng.choice(size, min(specials, size), replace=False)
  x[where] = rng.choice(SPECIALS, where.shape[0])
  return x


def _dense(compressor):
  """The same compressor without its payload-only shortcuts: a dense decode, a subtraction
  and a check of the whole residual."""
  return compressor._replace(subtract_decoded=None, unsent_nonfinite=None)


COMPRESSORS = st.sampled_from([
    (0.05, None, jnp.float32), (0.05, None, jnp.float16), (0.2, None, jnp.bfloat16),
    (0.05, 64, jnp.float32), (0.1, 100, jnp.float16)])


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(size=st.integers(1, 2000), specials=st.sampled_from([0, 1, 3, 200]), setting=COMPRESSORS,
       seed=st.integers(0, 2**16))
def test_kept_values_tell_whether_the_residual_is_finite(size, specials, setting, seed):
  density, chunk, value_dtype = setting
  compressor = topk(density, chunk=chunk, value_dtype=value_dtype)
  x = jnp.asarray(_input(seed, size, specials))

  @jax.jit
  def flags(x):
    payload, _ = compressor.encode(x, (), KEY)
    return (compressor.unsent_nonfinite(payload),
            has_nonfinite(x - compressor.decode(payload, x.shape)))

  from_payload, from_residual = flags(x)
  assert bool(from_payload) == bool(from_residual)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(size=st.integers(1, 2000), specials=st.sampled_from([0, 0, 1, 50]), setting=COMPRESSORS,
       bound=st.sampled_from([None, 0.5, 2.0]), seed=st.integers(0, 2**16))
def test_error_feedback_state_is_the_dense_references(size, specials, setting, bound, seed):
  density, chunk, value_dtype = setting
  compressor = topk(density, chunk=chunk, value_dtype=value_dtype)
  x = jnp.asarray(_input(seed, size, specials))
  residual = jnp.asarray(_input(seed + 1, size, 0))

  def step(inner):
    wrapped = error_feedback(inner, bound=bound)
    state = wrapped.init(x.shape, x.dtype)._replace(residual=residual)
    return jax.jit(lambda x, state: wrapped.encode(x, state, KEY))(x, state)

  (payload, state), (reference_payload, reference_state) = step(compressor), step(
      _dense(compressor))
  for leaf, reference in zip(jax.tree.leaves(payload), jax.tree.leaves(reference_payload)):
    np.testing.assert_array_equal(np.asarray(leaf).view(np.uint8),
                                  np.asarray(reference).view(np.uint8))
  if bound is not None and jax.default_backend() != "cpu":
    # The bound's norm of the residual is a reduction that a GPU fuses with the scatter or
    # the dense subtraction differently: the scale, so each kept entry, 1 ulp apart (an
    # H200, session 20). Bit for bit on XLA's CPU backend.
    np.testing.assert_allclose(state.residual, reference_state.residual, rtol=1e-6, atol=0)
    return
  np.testing.assert_array_equal(np.asarray(state.residual).view(np.uint8),
                                np.asarray(reference_state.residual).view(np.uint8))


def test_approximate_selection_keeps_the_dense_check():
  assert topk(0.01, approximate=True).unsent_nonfinite is None
  assert topk(0.01).unsent_nonfinite is not None
  assert error_feedback(topk(0.01)).unsent_nonfinite is None


def test_kept_values_tell_on_the_accelerators_selection(monkeypatch, request):
  # The accelerators' formulation of the selection (sampled path and all) keeps NaN and Inf
  # too; 40,000 elements take the sampled path.
  from platform_paths import use_accelerator_path
  use_accelerator_path(monkeypatch, request)
  for specials, chunk in ((0, None), (1, None), (30, None), (1, 4096)):
    compressor = topk(0.01, chunk=chunk, value_dtype=jnp.float16)
    x = jnp.asarray(_input(specials, 40_000, specials))
    payload, _ = jax.jit(lambda x: compressor.encode(x, (), KEY))(x)
    residual = x - compressor.decode(payload, x.shape)
    assert bool(compressor.unsent_nonfinite(payload)) == bool(has_nonfinite(residual))
    assert bool(has_nonfinite(residual)) == (specials > 0)
