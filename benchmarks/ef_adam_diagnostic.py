"""What error feedback in front of Adam feeds Adam, measured on one gradient stream.

One worker, ``d`` coordinates, gradients ``g_t = mu + sigma xi_t`` (``mu`` and ``sigma`` per
coordinate, heavy-tailed across coordinates: a sparse, noisy stream like a network's). Four
ways to turn it into Adam steps, all with the same Adam (lr 1, b1 0.9, b2 0.999):

* ``adam``: Adam on ``g_t`` (the reference);
* ``ef-then-adam``: top-k (or scaled sign) with classic error feedback, then Adam on what
  was sent (``compressed_allreduce(c)`` in front of ``optax.adam``);
* ``adam-then-ef``: Adam on ``g_t``, then its update compressed with error feedback
  (:func:`jaxcomm.optim.compress_updates`).

Printed per way: the RMS of one step and the median of Adam's ``sqrt(nu)`` relative to the
reference's, and the cosine and norm ratio of the summed steps after ``T`` steps against the
reference's (what moved the parameters).

  python -m benchmarks.ef_adam_diagnostic
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import jaxcomm


def _ef(compressor, size):
  """``step(x, residual, key) -> (sent, residual)``: classic error feedback with ``compressor``."""
  def step(x, residual, key):
    corrected = x + residual
    payload, _ = compressor.encode(corrected, compressor.init((size,), jnp.float32), key)
    sent = compressor.decode(payload, (size,))
    return sent, corrected - sent
  return step


def run(compressor, order: str, size: int, steps: int, seed: int = 0):
  """``(summed steps, rms of the last step, sqrt(nu) of Adam at the end)``."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  mu = jax.random.t(keys[0], 2.0, (size,)) * 0.1
  sigma = jnp.abs(jax.random.t(keys[1], 2.0, (size,)))
  adam = optax.adam(1.0)
  ef = _ef(compressor, size) if compressor is not None else None

  def body(carry, key):
    state, residual, total = carry
    g = mu + sigma * jax.random.normal(key, (size,))
    if ef is not None and order == "ef-then-adam":
      g, residual = ef(g, residual, key)
    update, state = adam.update(g, state)
    if ef is not None and order == "adam-then-ef":
      update, residual = ef(update, residual, key)
    return (state, residual, total + update), jnp.sqrt(jnp.mean(update ** 2))

  init = (adam.init(jnp.zeros(size)), jnp.zeros(size), jnp.zeros(size))
  (state, _, total), rms = jax.lax.scan(body, init, jax.random.split(keys[2], steps))
  return total, rms[-steps // 10:].mean(), jnp.sqrt(state[0].nu)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", type=int, default=100_000)
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args()
  reference, ref_rms, ref_nu = run(None, "adam", args.size, args.steps)
  print(f"{'compressor':<12} {'order':<13} {'step rms':>9} {'sqrt(nu)':>9} "
        f"{'cos(sum)':>9} {'|sum|':>7}   (ratios to adam's)")
  for name, compressor in (("top-1%", jaxcomm.topk(0.01)), ("sign", jaxcomm.sign())):
    for order in ("ef-then-adam", "adam-then-ef"):
      total, rms, nu = run(compressor, order, args.size, args.steps)
      cosine = jnp.vdot(total, reference) / jnp.linalg.norm(total) / jnp.linalg.norm(reference)
      print(f"{name:<12} {order:<13} {rms / ref_rms:9.3f} {jnp.median(nu / ref_nu):9.2f} "
            f"{cosine:9.3f} {jnp.linalg.norm(total) / jnp.linalg.norm(reference):7.3f}")


if __name__ == "__main__":
  main()
