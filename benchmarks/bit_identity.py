"""bit_identity: are the parameters after N steps the same bits as another checkout's?

A speed change that must not change results is checked here: every method's step (mesh_scan's
task and registry, compiled as :mod:`benchmarks.step_overhead` compiles it) runs ``--steps``
steps from the same start in this checkout and in the one at ``--tree LABEL=PATH`` (e.g. a
``git archive`` of the commit before the change), on the same batches, and the parameters are
compared leaf by leaf. It prints, per method, whether they are bit-identical and the largest
difference relative to the leaf's largest magnitude, and exits 1 if any method differs. Run
``python -m benchmarks.bit_identity --methods sign-ef,topk-ef --tree before=/tmp/t_before``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks import step_overhead
from benchmarks.common import host_local_mesh


def parse_args(argv: Sequence[str] | None = None):
  """step_overhead's flags (``--methods``, ``--model``, ``--mesh``, ``--tree`` ...), with
  ``--steps`` in place of its rounds and exactly one ``--tree``."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.bit_identity",
                                   description=__doc__.split("\n\n")[0],
                                   epilog="Every other flag is python -m benchmarks.step_overhead's "
                                   "(--methods, --model, --mesh, --hidden, --tree LABEL=PATH).")
  parser.add_argument("--steps", type=int, default=20, help="steps before the comparison")
  own, rest = parser.parse_known_args(argv)
  if own.steps < 1:
    parser.error(f"--steps must be >= 1, got {own.steps}")
  args = step_overhead.parse_args(rest + ["--warmup", "1", "--rounds", str(own.steps)])
  if len(args.tree) != 1:
    parser.error(f"give exactly one --tree LABEL=PATH to compare with, got {len(args.tree)}")
  args.steps = own.steps
  return args


def compare(leaves, others) -> tuple[bool, float]:
  """Whether two lists of arrays are equal bit for bit (NaNs at the same places count as
  equal), and the largest difference relative to each array's largest magnitude."""
  import numpy as np
  same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(leaves, others, strict=True))
  def relative(a, b):  # over the entries where neither is NaN
    difference, magnitude = np.abs(a - b), np.abs(b)
    kept = ~np.isnan(difference)
    return float(np.max(difference[kept], initial=0.0)
                 / (np.max(magnitude[kept], initial=0.0) + 1e-30))
  worst = max((relative(a, b) for a, b in zip(leaves, others)), default=0.0)
  return same, worst


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  mesh, _ = host_local_mesh(args.hosts, args.local)
  import jax
  runs, batch_at = step_overhead.compile_steps(args, mesh)
  [(label, path)] = args.tree
  other = step_overhead.compile_from_tree(args, mesh, path)
  differing = 0
  for name in runs:
    final = []
    for step, params, opt_state in (runs[name], other[name]):
      for index in range(args.steps):
        params, opt_state, _ = step(params, opt_state, batch_at(index))
      final.append(jax.tree.leaves(jax.device_get(params)))
    same, worst = compare(*final)
    differing += not same
    print(f"{name}: bit-identical to {label} after {args.steps} steps: {same} "
          f"(largest relative difference {worst:.3g})")
  return 1 if differing else 0


if __name__ == "__main__":
  sys.exit(main())
