"""What the benchmarks that run in one process or under ``python -m jaxcomm.launch`` share."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


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
