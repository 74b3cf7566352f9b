"""What the benchmarks that run in one process or under ``python -m jaxcomm.launch`` share."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence


def host_local_mesh(hosts: int, local: int):
  """``(mesh, launched)``: the ``('host', 'local')`` mesh of a launched job (one host per
  process), or ``hosts x local`` simulated CPU devices in one process. Call before JAX starts."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from jaxcomm import distributed
  launched = distributed.initialize_from_env()
  import jax
  if not launched:
    jax.config.update("jax_num_cpu_devices", hosts * local)
  import jaxcomm
  mesh = jaxcomm.make_mesh() if launched else jaxcomm.make_mesh(hosts=hosts, local=local)
  return mesh, launched


def median_seconds(call: Callable[[], object], repeats: int) -> float:
  """Median wall-clock seconds of ``call()`` over ``repeats`` runs, after one warm-up run."""
  import jax
  import numpy as np
  jax.block_until_ready(call())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def parse_trees(parser: argparse.ArgumentParser, trees: Sequence[str]) -> list[list[str]]:
  """``--tree LABEL=PATH`` values as ``[label, path]`` pairs; a value that is not of that form
  or whose ``PATH`` holds no ``jaxcomm/`` is a parser error."""
  pairs = [tree.split("=", 1) for tree in trees]
  if any(len(pair) != 2 or not os.path.isdir(os.path.join(pair[1], "jaxcomm"))
         for pair in pairs):
    parser.error(f"--tree must be LABEL=PATH of a checkout holding jaxcomm/, got {pairs}")
  return pairs


@contextlib.contextmanager
def imported_from(path: str, packages: Sequence[str] = ("jaxcomm",)) -> Iterator[None]:
  """Inside the block, ``packages`` are imported from the checkout at ``path``; afterwards
  this checkout's modules are back in ``sys.modules``. What was built inside keeps the other
  checkout's code, so a benchmark can time two versions in one process."""
  ours = {name: module for name, module in sys.modules.items()
          if name.split(".")[0] in packages}
  for name in ours:
    del sys.modules[name]
  sys.path.insert(0, os.path.abspath(path))
  try:
    yield
  finally:
    sys.path.pop(0)
    for name in [name for name in sys.modules if name.split(".")[0] in packages]:
      del sys.modules[name]
    sys.modules.update(ours)
