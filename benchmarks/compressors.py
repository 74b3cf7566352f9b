"""Compression ratio, error and speed of every compressor in the catalog.

For each compressor (alone, and the biased ones also inside ``error_feedback``) and each input
(random float32 matrices of 1M and 16M elements, and the gradients of a small flax MLP),
prints:

* ``ratio``: float32 bytes over the payload's bytes (counted from the payload's arrays);
* ``rel.err``: ``||C(x) - x|| / ||x||`` for one call (fixed key);
* ``GB/s``: float32 input bytes over the time of one encode and one decode, each a jitted call
  (the payload materialized between them, and the new state, e.g. error feedback's residual,
  returned), the best of ``--repeats`` runs (on a shared machine load only ever adds time),
  next to a plain copy of the same data (``copy``: ``-x``) on this backend;
* ``xcopy``: that throughput over the copy's, measured in the same run;
* ``1G b/e``: break-even against a 1 Gbit/s link: the link time of the bytes the compressor
  removes, ``(4 d - wire_bytes) / 125 MB/s``, over its encode + decode time. Below 1 the
  compressor costs more than it saves on such a link (``identity`` removes nothing: ``-``);
* ``CPU ms``: the process CPU time (all threads) of the fastest of those calls, which a
  loaded machine disturbs less than the wall time.

With ``--tree LABEL=PATH`` every compressor is also built from the ``jaxcomm`` of another
checkout (e.g. a ``git archive`` of an older commit) and printed as ``LABEL:name`` under this
tree's row; the two versions' timed calls alternate, so load changes hit both alike and the
before/after table comes from one command in one process.

Compressors of any array get the input flattened to 1-D, as the engine hands them a flat
shard (PowerSGD gets the matrix). Inputs and states are donated to the encode (a fresh copy
is made, untimed, before every call), for the copy too: a gradient is dead once compressed;
the decode writes into donated buffers of the input's size (a receiver's). Without donation
every 16M-element call would pay for a fresh 64 MB output buffer (on this CPU backend such buffers
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

import jaxcomm.compress
from jaxcomm.compress import Compressor, payload_nbytes

from benchmarks.common import imported_from, parse_trees

LINK_BYTES_PER_SECOND = 125e6  # 1 Gbit/s


def catalog(compress=jaxcomm.compress) -> list[Compressor]:
  """The compressors measured, with settings typical of the literature, built from the
  ``jaxcomm.compress`` module ``compress`` (this checkout's by default)."""
  c = compress
  biased = [c.quantize(8, stochastic=False), c.sign(), c.topk(0.01), c.topk(0.01, chunk=65536),
            c.adaptive_threshold(0.01), c.powersgd(4)]
  return [
      c.identity(),
      c.cast(jnp.bfloat16),
      c.cast(jnp.float16),
      c.cast(jnp.float8_e4m3fn, scaled=True),
      c.cast(jnp.float8_e5m2, scaled=True),
      c.quantize(8),
      c.quantize(4, chunk=4096),
      c.quantize(2, stochastic=False, chunk=4096),
      c.qsgd(15, bucket=None),
      c.qsgd(15, bucket=512),
      c.terngrad(),
      c.natural(),
      c.sign(),
      c.sign_vote(),
      c.topk(0.01),
      c.topk(0.01, approximate=True),
      c.topk(0.01, chunk=65536),
      c.compose(c.topk(0.01), c.quantize(8)),
      c.compose(c.topk(0.01, chunk=65536), c.quantize(4)),
      c.randomk(0.01),
      c.randomk(0.01, shared=False),
      c.threshold(2.5, capacity=0.02),
      c.adaptive_threshold(0.01),
      c.powersgd(4),
      c.count_sketch(1 << 14, 5, heavy=0.01),
      c.shared_quantize(),
      c.terngrad(shared_scale=True),
  ] + [c.error_feedback(compressor) for compressor in biased]


def catalog_from_tree(path: str) -> list[Compressor]:
  """:func:`catalog` built from the ``jaxcomm`` of the checkout at ``path``."""
  with imported_from(path):
    from jaxcomm import compress
    return catalog(compress)


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


def time_calls(calls, repeats: int) -> list[tuple[float, float]]:
  """Best wall and best process CPU seconds of each ``function(argument)`` in ``calls``, on a
  fresh copy of ``argument`` each time, after one warm-up (compilation) call each. The calls
  take turns within every repeat, and the copies are made outside the timed region."""
  for function, argument in calls:
    jax.block_until_ready(function(fresh(argument)))
  wall, cpu = [[] for _ in calls], [[] for _ in calls]
  for _ in range(repeats):
    for index, (function, argument) in enumerate(calls):
      copy = fresh(argument)
      start, cpu_start = time.perf_counter(), time.process_time()
      jax.block_until_ready(function(copy))
      wall[index].append(time.perf_counter() - start)
      cpu[index].append(time.process_time() - cpu_start)
  return [(min(seconds), min(cpu_seconds)) for seconds, cpu_seconds in zip(wall, cpu)]


def roundtrip(compressor: Compressor, leaves: list[jax.Array]):
  """``(function, argument)``: one encode and one decode of every leaf, and their argument.

  A compressor of any array gets each leaf flattened to 1-D (untimed), as the engine hands it
  a flat shard; only a matrix method (PowerSGD) gets the matrix. On a 2-D leaf XLA's CPU
  backend cannot write the decoded tensor into the donated input's buffer through the
  reshapes to and from the 1-D payload, and adds a 64 MB temporary and a copy at 16M.

  Encode and decode are two jitted calls, so the payloads are materialized between them, as
  on the wire (in one call XLA's CPU backend drops an ``optimization_barrier`` and fuses the
  two). The decoded tensors are written into buffers of the argument that hold nothing (a
  receiver's gradient buffers), and the new states (error feedback's residuals) are returned:
  no work is dead, and a no-op's decode may return its donated payload.
  """
  if not compressor.needs_matrix:
    leaves = [leaf.reshape(-1) for leaf in leaves]
  # States are arguments, not constants made inside jit: XLA would otherwise constant-fold
  # work that depends only on them (e.g. hashing from a fixed key) into the compile time.
  states = [compressor.init(leaf.shape, leaf.dtype) for leaf in leaves]
  encode = jax.jit(lambda leaves_and_states: encode_all(compressor, leaves_and_states),
                   donate_argnums=0)

  @functools.partial(jax.jit, donate_argnums=(0, 1), keep_unused=True)
  def decode(payloads, receivers):
    del receivers  # donated: the decoded tensors may be written into them
    return [compressor.decode(payload, leaf.shape) for payload, leaf in zip(payloads, leaves)]

  def function(argument):
    leaves_and_states, receivers = argument
    payloads, states = zip(*encode(leaves_and_states))
    return decode(list(payloads), receivers), states

  return function, ((leaves, states), leaves)


def encode_all(compressor: Compressor, leaves_and_states) -> list:
  leaves, states = leaves_and_states
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  return [compressor.encode(leaf, state, key) for leaf, state, key in zip(leaves, states, keys)]


def accuracy(compressor: Compressor, function_and_argument) -> tuple[float, float, int]:
  """(ratio, relative error, bytes removed) of one encode + decode of a :func:`roundtrip`'s
  argument, with the payload's bytes checked against ``wire_bytes``."""
  (leaves, states), _ = function_and_argument[1]

  @jax.jit
  def payloads_and_decoded(leaves_and_states):
    return [(payload, compressor.decode(payload, leaf.shape))
            for (payload, _), leaf in zip(encode_all(compressor, leaves_and_states), leaves)]

  out = payloads_and_decoded((leaves, states))
  sent = sum(payload_nbytes(payload) for payload, _ in out)
  expected = sum(compressor.wire_bytes(leaf.shape, leaf.dtype) for leaf in leaves)
  assert sent == expected, (compressor.name, sent, expected)
  dense = sum(4 * leaf.size for leaf in leaves)
  error = sum(float(jnp.sum(jnp.square(decoded - leaf))) for (_, decoded), leaf in zip(out, leaves))
  norm = sum(float(jnp.sum(jnp.square(leaf))) for leaf in leaves)
  return dense / sent, float(np.sqrt(error / norm)), dense - sent


def cells(ratio: float, error: float, removed: int, seconds: float, cpu_seconds: float,
          dense: int, copy_rate: float) -> str:
  rate = dense / seconds / 1e9
  breakeven = f"{removed / LINK_BYTES_PER_SECOND / seconds:8.1f}" if removed > 0 else f"{'-':>8s}"
  return (f"| {ratio:7.2f} {error:8.4f} {rate:8.3f} {rate / copy_rate:6.2f} {breakeven} "
          f"{1e3 * cpu_seconds:8.1f} ")


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
  parser.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                      help="also measure every compressor as built from the checkout at PATH, "
                           "in turn with this checkout's")
  args = parser.parse_args()
  args.tree = parse_trees(parser, args.tree)
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

  inputs = {}
  for size in args.sizes:
    rows = 1 << (int(np.log2(size)) // 2)
    x = jax.random.normal(jax.random.PRNGKey(size), (rows, size // rows))
    inputs[f"{size / 2**20:g}M"] = [x]
  if args.mlp_hidden:
    inputs[f"MLP-{args.mlp_hidden}"] = jax.tree.leaves(mlp_gradients(args.mlp_hidden))

  trees = [{compressor.name: compressor for compressor in catalog_from_tree(path)}
           for _, path in args.tree]
  width = 48 + max([len(label) + 1 for label, _ in args.tree], default=0)
  print(f"backend: {jax.default_backend()}, {jax.device_count()} device(s), jax {jax.__version__}")
  print(f"{'compressor':{width}s}" + "".join(f"| {label:>50s} " for label in inputs))
  print(f"{'':{width}s}" + "".join(f"| {'ratio':>7s} {'rel.err':>8s} {'GB/s':>8s} {'xcopy':>6s} "
                                   f"{'1G b/e':>8s} {'CPU ms':>8s} " for _ in inputs))
  copy = jax.jit(lambda leaves: [-leaf for leaf in leaves], donate_argnums=0)
  copy_rates = {}
  row = f"{'copy (baseline)':{width}s}"
  for label, leaves in inputs.items():
    [(seconds, cpu_seconds)] = time_calls([(copy, leaves)], args.repeats)
    dense = sum(4 * leaf.size for leaf in leaves)
    copy_rates[label] = dense / seconds / 1e9
    row += cells(1.0, 0.0, 0, seconds, cpu_seconds, dense, copy_rates[label])
  print(row, flush=True)
  for compressor in catalog():
    if args.only and not re.search(args.only, compressor.name):
      continue
    versions = {compressor.name: compressor}
    versions.update({f"{label}:{compressor.name}": tree[compressor.name]
                     for (label, _), tree in zip(args.tree, trees) if compressor.name in tree})
    rows = {name: f"{name:{width}s}" for name in versions}
    for label, leaves in inputs.items():
      calls = [roundtrip(version, leaves) for version in versions.values()]
      dense = sum(4 * leaf.size for leaf in leaves)
      for name, version, call, timed in zip(versions, versions.values(), calls,
                                            time_calls(calls, args.repeats)):
        rows[name] += cells(*accuracy(version, call), *timed, dense, copy_rates[label])
    print("\n".join(rows.values()), flush=True)


if __name__ == "__main__":
  main()
