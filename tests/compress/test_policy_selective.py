"""Per-leaf policies and selective gradient compression."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomm.compress import policy, quantize, selective, sign, topk

PARAMS = {
    "params": {
        "Embed_0": {"embedding": jnp.zeros((1000, 64))},
        "Dense_0": {"kernel": jnp.zeros((64, 512)), "bias": jnp.zeros((512,))},
        "LayerNorm_0": {"scale": jnp.zeros((512,)), "bias": jnp.zeros((512,))},
        "attention": {"query": {"kernel": jnp.zeros((512, 512))}},
        "head": {"kernel": jnp.zeros((512, 10))},
    }
}


def test_policy_defaults_keep_small_biases_norms_embeddings_dense():
  default = topk(0.01)
  decided = policy(default).describe(PARAMS)
  assert decided == {
      "params/Dense_0/bias": "full precision",
      "params/Dense_0/kernel": default.name,
      "params/Embed_0/embedding": "full precision",
      "params/LayerNorm_0/bias": "full precision",
      "params/LayerNorm_0/scale": "full precision",
      "params/attention/query/kernel": default.name,
      "params/head/kernel": "full precision",  # 20 KB < 64 KiB
  }


def test_policy_user_rules_win_in_order():
  int8 = quantize(8)
  chosen = policy(topk(0.01), rules=[(r"attention", int8), (r"embed", sign()),
                                     (r"query", None)], min_bytes=0)
  leaves = dict(zip(chosen.describe(PARAMS), chosen.assign(PARAMS)))
  assert leaves["params/attention/query/kernel"] is int8
  assert leaves["params/Embed_0/embedding"].name == "sign()"
  assert leaves["params/head/kernel"].name == "topk(0.01)"
  assert leaves["params/LayerNorm_0/scale"] is None
  assert policy(None).assign(PARAMS) == [None] * 7


@pytest.mark.parametrize("kwargs, error, name", [
    ({"rules": [("x", "topk")]}, TypeError, "rules"),
    ({"min_bytes": -1}, ValueError, "min_bytes"),
    ({"full_precision": [3]}, TypeError, "full_precision"),
])
def test_policy_validates(kwargs, error, name):
  with pytest.raises(error, match=name):
    policy(topk(0.01), **kwargs)


def test_selective_picks_by_noise_ratio_every_k_steps():
  sel = selective(0.2, 0.8, period=20, beta=0.9, topk_density=0.1)
  grads_like = {"signal": jnp.zeros(64), "mixed": jnp.zeros(64), "noise": jnp.zeros(64)}
  stats = sel.init(grads_like)
  assert sel.choose(stats) == [None, None, None]
  direction = jnp.ones(64)
  update = jax.jit(sel.update)
  for step in range(40):
    noise = jax.random.normal(jax.random.PRNGKey(step), (3, 64))
    grads = {"signal": direction + 0.05 * noise[0],
             "mixed": direction + 1.0 * noise[1],
             "noise": 0.01 * direction + noise[2]}
    stats = update(grads, stats)
  ratios = np.asarray(jax.device_get(sel.noise_ratios(stats)))
  # jax.tree.leaves order is sorted by key: mixed, noise, signal.
  assert ratios[2] < 0.2 < ratios[0] < 0.8 <= ratios[1], ratios
  mixed, noise, signal = sel.choose(stats)
  assert signal is None and mixed.name == "topk(0.1)" and noise.name == "sign()"
  before = stats
  stats = update({"signal": direction.at[0].set(jnp.nan), "mixed": direction,
                  "noise": direction}, stats)
  jax.tree.map(np.testing.assert_array_equal, stats, before)


@pytest.mark.parametrize("kwargs, name", [
    ({"tau_low": -0.1, "tau_high": 0.5}, "tau_low"),
    ({"tau_low": 0.5, "tau_high": 0.4}, "tau_high"),
    ({"tau_low": 0.5, "tau_high": 1.5}, "tau_high"),
    ({"tau_low": 0.1, "tau_high": 0.5, "period": 0}, "period"),
    ({"tau_low": 0.1, "tau_high": 0.5, "beta": 1.0}, "beta"),
    ({"tau_low": 0.1, "tau_high": 0.5, "topk_density": 0.0}, "topk_density"),
])
def test_selective_validates(kwargs, name):
  with pytest.raises(ValueError, match=name):
    selective(**kwargs)
