"""Benchmark: sequence-parallel attention fwd+bwd time and per-device memory vs S and P.

For every sequence length and device count it compiles the forward and backward pass
(``jax.vjp``) of ``ring_attention`` or ``ulysses_attention`` over a 1-D mesh, reads the
per-device temporary memory from ``compiled.memory_analysis()``, and times the median of
``--repeats`` runs after one warm-up. The reference row ``ref`` is
``jax.nn.dot_product_attention`` on one device with the whole sequence (cuDNN on a GPU where
it applies, XLA elsewhere: ``jaxcomm.parallel.dense_attention``).

On CPU the devices are simulated (``jax_num_cpu_devices``): all of them share the host's
cores, so wall time for P > 1 measures total work plus collectives, not a parallel speedup.
Memory per device is what each device would need on real hardware.

Usage::

  python -m benchmarks.attention                       # defaults, a few minutes on 2 cores
  python -m benchmarks.attention --seq-lens 32768 65536 --devices 1 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomm.parallel import dense_attention, ring_attention, ulysses_attention

_DTYPES = ("float32", "bfloat16")


def _parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.attention",
      description="Fwd+bwd time and per-device memory of sequence-parallel attention versus "
                  "sequence length and device count, next to single-device attention.")
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048],
                      help="total sequence lengths S (default: 512 1024 2048)")
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8],
                      help="device counts P on the sequence axis (default: 1 2 4 8)")
  parser.add_argument("--attention", choices=("ring", "ulysses"), default="ring",
                      help="sequence-parallel attention to measure (default: ring)")
  parser.add_argument("--layout", choices=("contiguous", "zigzag", "striped"),
                      default="zigzag", help="sequence layout (default: zigzag)")
  parser.add_argument("--no-causal", dest="causal", action="store_false",
                      help="attend to all keys (default: causal mask)")
  parser.add_argument("--batch", type=int, default=1, help="batch size B (default: 1)")
  parser.add_argument("--heads", type=int, default=8, help="query heads H (default: 8)")
  parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default: 8)")
  parser.add_argument("--head-dim", type=int, default=64, help="head dim D (default: 64)")
  parser.add_argument("--dtype", choices=_DTYPES, default="float32",
                      help="input dtype; accumulation is fp32 (default: float32)")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed runs per configuration, median reported (default: 3)")
  return parser.parse_args(argv)


def _timed(fn, args, repeats):
  jax.block_until_ready(fn(*args))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _measure(attend, args, repeats):
  """(seconds, temp bytes per device) of the fwd+bwd of ``attend``."""

  def fwd_bwd(q, k, v, d_out):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(d_out)

  compiled = jax.jit(fwd_bwd).lower(*args).compile()
  return _timed(compiled, args, repeats), compiled.memory_analysis().temp_size_in_bytes


def _forward_wire_bytes(options, seq, size, itemsize) -> int:
  """Bytes each device sends in the forward pass, from the formulas in the docstrings."""
  local = options.batch * (seq // size) * options.head_dim * itemsize
  if options.attention == "ring":
    # P - 1 steps, each a ppermute of one K and one V block.
    return (size - 1) * 2 * local * options.kv_heads
  # All-to-all of q, k, v and the output: (P - 1) / P of each local array leaves the device.
  kv_heads = max(options.kv_heads, size) if options.kv_heads % size else options.kv_heads
  return (size - 1) * local * (2 * options.heads + 2 * kv_heads) // size


def main(argv=None) -> None:
  options = _parse(argv)
  # Simulated CPU devices must be requested before the backend starts; no effect on GPUs.
  jax.config.update("jax_num_cpu_devices", max(options.devices))
  dtype = jnp.dtype(options.dtype)
  sharded_fn = ring_attention if options.attention == "ring" else ulysses_attention
  print(f"# {options.attention} attention, layout={options.layout}, causal={options.causal}, "
        f"B={options.batch}, H={options.heads}, H_kv={options.kv_heads}, D={options.head_dim}, "
        f"{options.dtype}; backend={jax.default_backend()}, "
        f"{len(jax.devices())} devices ({jax.devices()[0].device_kind})")
  print("| S | P | fwd+bwd ms | tokens/s | temp MiB / device | time vs ref | temp vs ref | "
        "fwd wire bytes / device (formula) |")
  print("|---|---|---|---|---|---|---|---|")
  for seq in options.seq_lens:
    keys = jax.random.split(jax.random.key(seq), 4)
    q_shape = (options.batch, seq, options.heads, options.head_dim)
    kv_shape = (options.batch, seq, options.kv_heads, options.head_dim)
    args = (jax.random.normal(keys[0], q_shape, dtype), jax.random.normal(keys[1], kv_shape, dtype),
            jax.random.normal(keys[2], kv_shape, dtype), jax.random.normal(keys[3], q_shape, dtype))
    # cuDNN flash attention on a GPU where it applies, XLA elsewhere (as the ring's blocks).
    reference = functools.partial(dense_attention, causal=options.causal)
    ref_time, ref_temp = _measure(reference, args, options.repeats)
    tokens = options.batch * seq
    print(f"| {seq} | ref | {1e3 * ref_time:.1f} | {tokens / ref_time:,.0f} | "
          f"{ref_temp / 2**20:.1f} | 1.00 | 1.00 | - |", flush=True)
    for size in options.devices:
      mesh = jax.make_mesh((size,), ("seq",), axis_types=(AxisType.Auto,),
                           devices=jax.devices()[:size])
      attend = jax.shard_map(
          functools.partial(sharded_fn, axis_name="seq", causal=options.causal,
                            layout=options.layout),
          mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
      # Inputs are measured in layout order; the permutation is the caller's, done once.
      elapsed, temp = _measure(attend, args, options.repeats)
      wire = _forward_wire_bytes(options, seq, size, dtype.itemsize)
      print(f"| {seq} | {size} | {1e3 * elapsed:.1f} | {tokens / elapsed:,.0f} | "
            f"{temp / 2**20:.1f} | {elapsed / ref_time:.2f} | {temp / ref_temp:.2f} | "
            f"{wire:,} |", flush=True)


if __name__ == "__main__":
  main()
