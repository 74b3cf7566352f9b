"""costmodel_projection: modeled gradient-allreduce time per step of a large model, no compiling.

For a named transformer (default: a 7B LLaMA, 291 fp32 gradient leaves) on ``--hosts`` hosts of
``--local`` devices, prints per method the bytes each device sends per step over the slow
(inter-host) and fast (intra-host) links and the alpha-beta time on each, from
:func:`jaxcomm.costmodel.project`, once per slow link given. Nothing is compiled or run:
these are model figures, not measurements.

Run ``python -m benchmarks.costmodel_projection --help`` for the flags.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import jaxcomm
from jaxcomm import costmodel, links


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.costmodel_projection",
      description=__doc__.split("\n\n")[0],
      epilog="Links: " + ", ".join(
          f"{name} ({spec.bandwidth_bytes_per_s / 1e9:g} GB/s, {spec.latency_s * 1e6:g} us)"
          for name, spec in links.PRESETS.items()),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--model", default="llama-7b", choices=tuple(costmodel.TRANSFORMERS),
                      help="transformer whose gradient shapes are projected")
  parser.add_argument("--hosts", type=int, default=8, help="hosts H (slow axis)")
  parser.add_argument("--local", type=int, default=8, help="devices per host G (fast axis)")
  parser.add_argument("--fast", default="nvlink4", help="fast (intra-host) link preset")
  parser.add_argument("--slow", default="100gbe,1gbe",
                      help="comma-separated slow (inter-host) link presets, one table each")
  parser.add_argument("--devices-per-nic", type=int, default=1,
                      help="devices of a host sharing one slow link (1: one NIC per device)")
  parser.add_argument("--topk-density", "--topk-fraction", type=float, default=0.01,
                      help="fraction of each shard that top-k sends")
  return parser.parse_args(argv)


def methods(topk_density: float) -> list[tuple[str, object, str]]:
  """(label, wire_bytes or None, strategy) for each compressed-or-not hierarchical method."""
  topk = jaxcomm.topk(topk_density)
  int8 = jaxcomm.quantize(8)
  sign = jaxcomm.sign()
  rows = [("fp32-hier", None, "gather")]
  for label, compressor in ((f"top-{100 * topk_density:g}%", topk), ("int8", int8), ("sign", sign)):
    rows += [(f"{label} gather", compressor.wire_bytes, "gather"),
             (f"{label} two-phase", compressor.wire_bytes, "two_phase")]
  return rows


def _flat_fp32(shapes, devices: int, slow: links.Link) -> tuple[float, float]:
  """Bytes and seconds of a plain fp32 pmean: one ring over every device, on the slow link."""
  sizes = [4 * math.prod(shape) for shape in shapes]
  return (sum(2 * (devices - 1) / devices * size for size in sizes),
          math.fsum(costmodel.all_reduce_time(size, devices, slow) for size in sizes))


def table(args: argparse.Namespace, slow_name: str) -> str:
  """The projection table for one slow link preset."""
  fast = links.link(args.fast)
  nic = links.link(slow_name)
  # The hierarchical scheme drives every device's slow link at once; a flat ring crosses
  # each host boundary once, so it has a NIC to itself even when devices share one.
  slow = nic.shared_by(args.devices_per_nic)
  shapes = list(costmodel.transformer_gradient_shapes(args.model).values())
  header = (f"{'method':<20}{'slow GB/dev':>12}{'fast GB/dev':>12}{'slow s':>9}"
            f"{'(latency)':>10}{'fast s':>9}{'total s':>9}{'vs fp32-hier':>13}")
  flat_bytes, flat_seconds = _flat_fp32(shapes, args.hosts * args.local, nic)
  projected = [(label, costmodel.project(shapes, args.hosts, args.local, fast, slow,
                                         wire_bytes, strategy=strategy))
               for label, wire_bytes, strategy in methods(args.topk_density)]
  reference = projected[0][1].total_seconds
  lines = [f"{args.model} on {args.hosts} hosts x {args.local} devices; fast {fast.name}, "
           f"slow {nic.name} shared by {args.devices_per_nic} device(s)", header,
           "-" * len(header),
           f"{'fp32 flat ring':<20}{flat_bytes / 1e9:>12.3f}{0.0:>12.3f}{flat_seconds:>9.3f}"
           f"{'':>10}{0.0:>9.3f}{flat_seconds:>9.3f}{reference / flat_seconds:>12.2f}x"]
  for label, got in projected:
    lines.append(
        f"{label:<20}{got.slow_bytes / 1e9:>12.3f}{got.fast_bytes / 1e9:>12.3f}"
        f"{got.slow_seconds:>9.3f}{got.slow_steps * slow.latency_s:>10.3f}"
        f"{got.fast_seconds:>9.3f}{got.total_seconds:>9.3f}"
        f"{reference / got.total_seconds:>12.2f}x")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  tables = [table(args, name.strip()) for name in args.slow.split(",") if name.strip()]
  print("\n\n".join(tables))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
