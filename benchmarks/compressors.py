"""Compression ratio, error and speed of every compressor in the catalog.

For each compressor (alone, and the biased ones also inside ``error_feedback``) and each input
(random float32 matrices of 1M and 16M elements, and the gradients of a small flax MLP),
prints:

* ``ratio``: float32 bytes over the payload's bytes (counted from the payload's arrays);
* ``rel.err``: ``||C(x) - x|| / ||x||`` for one call (fixed key);
* ``GB/s``: float32 input bytes over the time of one jitted encode + decode (with the
  payload materialized, and the new state, e.g. error feedback's residual, returned), the best of
  ``--repeats`` runs (on a shared machine load only ever adds time), next to a plain copy of the same data (``copy``: ``-x``) on this backend;
* ``xcopy``: that throughput over the copy's, measured in the same run;
* ``1G b/e``: break-even against a 1 Gbit/s link: the link time of the bytes the compressor
  removes, ``(4 d - wire_bytes) / 125 MB/s``, over its encode + decode time. Below 1 the
  compressor costs more than it saves on such a link (``identity`` removes nothing: ``-``).

Compressors of any array get the input flattened to 1-D, as the engine hands them a flat
shard (PowerSGD gets the matrix). Inputs and states are donated to the jitted call (a fresh copy is made, untimed, before every
call), for the copy too: a gradient is dead once compressed, and without donation every
16M-element call would pay for a fresh 64 MB output buffer (on this CPU backend such buffers
are mapped and page-faulted anew each call, which makes a copy at 16M ten times slower than
at 4M). ``shared_quantize`` and ``terngrad(shared_scale=True)`` run alone (one device: the scale
they would agree on is their own).

Run ``python -m benchmarks.compressors --help`` for the flags.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm.compress import (Compressor, adaptive_threshold, cast, compose, count_sketch,
                              error_feedback, identity, natural, payload_nbytes, powersgd, qsgd,
                              quantize, randomk, shared_quantize, sign, sign_vote, terngrad,
                              threshold, topk)

LINK_BYTES_PER_SECOND = 125e6  # 1 Gbit/s


def catalog() -> list[Compressor]:
  """The compressors measured, with settings typical of the literature."""
  biased = [quantize(8, stochastic=False), sign(), topk(0.01), topk(0.01, chunk=65536),
            adaptive_threshold(0.01), powersgd(4)]
  return [
      identity(),
      cast(jnp.bfloat16),
      cast(jnp.float16),
      cast(jnp.float8_e4m3fn, scaled=True),
      cast(jnp.float8_e5m2, scaled=True),
      quantize(8),
      quantize(4, chunk=4096),
      quantize(2, stochastic=False, chunk=4096),
      qsgd(15),
      qsgd(15, bucket=512),
      terngrad(),
      natural(),
      sign(),
      sign_vote(),
      topk(0.01),
      topk(0.01, approximate=True),
      topk(0.01, chunk=65536),
      compose(topk(0.01), quantize(8)),
      compose(topk(0.01, chunk=65536), quantize(4)),
      randomk(0.01),
      randomk(0.01, shared=False),
      threshold(2.5, capacity=0.02),
      adaptive_threshold(0.01),
      powersgd(4),
      count_sketch(1 << 14, 5, heavy=0.01),
      shared_quantize(),
      terngrad(shared_scale=True),
  ] + [error_feedback(compressor) for compressor in biased]


def mlp_gradients(hidden: int, seed: int = 0) -> dict:
  """Gradients of a 784-hidden-hidden-10 flax MLP on a random batch (cross-entropy loss)."""
  import flax.linen as nn
  import optax

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(hidden)(x))
      x = nn.relu(nn.Dense(hidden)(x))
      return nn.Dense(10)(x)

  model = MLP()
  images = jax.random.normal(jax.random.PRNGKey(seed), (256, 784))
  labels = jax.random.randint(jax.random.PRNGKey(seed + 1), (256,), 0, 10)
  params = model.init(jax.random.PRNGKey(seed + 2), images)

  def loss(params):
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return jax.grad(loss)(params)


def fresh(tree):
  """A copy of ``tree`` that a donating call may consume."""
  return jax.block_until_ready(jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), tree))


def time_call(function, argument, repeats: int) -> float:
  """Best wall time of ``function(argument)`` on a fresh copy of ``argument`` each time,
  after one warm-up (compilation) call; the copies are made outside the timed region."""
  jax.block_until_ready(function(fresh(argument)))
  times = []
  for _ in range(repeats):
    copy = fresh(argument)
    start = time.perf_counter()
    jax.block_until_ready(function(copy))
    times.append(time.perf_counter() - start)
  return min(times)


def measure(compressor: Compressor, leaves: list[jax.Array], repeats: int) -> tuple[float, ...]:
  """(ratio, relative error, seconds, bytes removed) of one encode + decode of every leaf.

  A compressor of any array gets each leaf flattened to 1-D (untimed), as the engine hands it
  a flat shard; only a matrix method (PowerSGD) gets the matrix. On a 2-D leaf XLA's CPU
  backend cannot write the decoded tensor into the donated input's buffer through the
  reshapes to and from the 1-D payload, and adds a 64 MB temporary and a copy at 16M.
  """
  if not compressor.needs_matrix:
    leaves = [leaf.reshape(-1) for leaf in leaves]

  # States are arguments, not constants made inside jit: XLA would otherwise constant-fold
  # work that depends only on them (e.g. hashing from a fixed key) into the compile time.
  states = [compressor.init(leaf.shape, leaf.dtype) for leaf in leaves]

  def encode_all(leaves_and_states):
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    return [compressor.encode(leaf, state, key)
            for (leaf, state), key in zip(zip(*leaves_and_states), keys)]

  @functools.partial(jax.jit, donate_argnums=0)
  def roundtrip(leaves_and_states):
    # The payloads are materialized (the barrier keeps XLA from fusing encode into decode, as
    # the wire does); the decoded tensors and the new states (error feedback's residuals) are
    # the outputs, so no work is dead and a no-op's output may reuse its donated input.
    payloads, states = zip(*jax.lax.optimization_barrier(encode_all(leaves_and_states)))
    return [(compressor.decode(payload, leaf.shape), state)
            for payload, state, leaf in zip(payloads, states, leaves)]

  @jax.jit
  def payloads_and_decoded(leaves_and_states):
    return [(payload, compressor.decode(payload, leaf.shape))
            for (payload, _), leaf in zip(encode_all(leaves_and_states), leaves)]

  seconds = time_call(roundtrip, (leaves, states), repeats)
  out = payloads_and_decoded((leaves, states))
  sent = sum(payload_nbytes(payload) for payload, _ in out)
  expected = sum(compressor.wire_bytes(leaf.shape, leaf.dtype) for leaf in leaves)
  assert sent == expected, (compressor.name, sent, expected)
  dense = sum(4 * leaf.size for leaf in leaves)
  error = sum(float(jnp.sum(jnp.square(decoded - leaf))) for (_, decoded), leaf in zip(out, leaves))
  norm = sum(float(jnp.sum(jnp.square(leaf))) for leaf in leaves)
  return dense / sent, float(np.sqrt(error / norm)), seconds, dense - sent


def cells(ratio: float, error: float, seconds: float, removed: int, dense: int,
          copy_rate: float) -> str:
  rate = dense / seconds / 1e9
  breakeven = f"{removed / LINK_BYTES_PER_SECOND / seconds:8.1f}" if removed > 0 else f"{'-':>8s}"
  return f"| {ratio:7.2f} {error:8.4f} {rate:8.3f} {rate / copy_rate:6.2f} {breakeven} "


def main() -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.compressors",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", type=int, nargs="*", default=[1 << 20, 1 << 24],
                      help="float32 elements of each random input (reshaped to a square-ish "
                           "matrix so PowerSGD has a matrix); default 1M and 16M")
  parser.add_argument("--mlp-hidden", type=int, default=1024,
                      help="hidden width of the MLP whose gradients are compressed "
                           "(0 to skip); default 1024, about 1.86M parameters")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed runs per case after one compiling run; the best is "
                           "reported (default 3)")
  parser.add_argument("--only", default="",
                      help="regular expression: measure only compressors whose name matches")
  args = parser.parse_args()
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

  inputs = {}
  for size in args.sizes:
    rows = 1 << (int(np.log2(size)) // 2)
    x = jax.random.normal(jax.random.PRNGKey(size), (rows, size // rows))
    inputs[f"{size / 2**20:g}M"] = [x]
  if args.mlp_hidden:
    inputs[f"MLP-{args.mlp_hidden}"] = jax.tree.leaves(mlp_gradients(args.mlp_hidden))

  print(f"backend: {jax.default_backend()}, {jax.device_count()} device(s), jax {jax.__version__}")
  header = f"{'compressor':48s}" + "".join(f"| {label:>41s} " for label in inputs)
  print(header)
  print(f"{'':48s}" + "".join(f"| {'ratio':>7s} {'rel.err':>8s} {'GB/s':>8s} {'xcopy':>6s} "
                              f"{'1G b/e':>8s} " for _ in inputs))
  copy = jax.jit(lambda leaves: [-leaf for leaf in leaves], donate_argnums=0)
  copy_rates = {}
  row = f"{'copy (baseline)':48s}"
  for label, leaves in inputs.items():
    seconds = time_call(copy, leaves, args.repeats)
    dense = sum(4 * leaf.size for leaf in leaves)
    copy_rates[label] = dense / seconds / 1e9
    row += cells(1.0, 0.0, seconds, 0, dense, copy_rates[label])
  print(row, flush=True)
  for compressor in catalog():
    if args.only and not re.search(args.only, compressor.name):
      continue
    row = f"{compressor.name:48s}"
    for label, leaves in inputs.items():
      ratio, error, seconds, removed = measure(compressor, leaves, args.repeats)
      dense = sum(4 * leaf.size for leaf in leaves)
      row += cells(ratio, error, seconds, removed, dense, copy_rates[label])
    print(row, flush=True)


if __name__ == "__main__":
  main()
