"""One computation, two formulations: one for XLA's CPU backend, one for accelerators.

XLA's CPU backend is fastest on loops over cache-sized steps and on serial scans; on a GPU
each step of such a loop is a kernel launch (2,048 of them for a count sketch of 256M
elements), so accelerators get one pass over the whole array instead. :func:`by_platform`
is the one place that chooses, so the tests can run the accelerators' formulation on the
CPU by replacing it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def by_platform(cpu: Callable, accelerator: Callable, *args):
  """``cpu(*args)`` when compiled for the CPU backend, ``accelerator(*args)`` for any other
  (GPU, TPU). Both must return the same result (up to summation order where a docstring
  says so). ``jax.lax.platform_dependent`` traces both and compiles only the backend's."""
  return jax.lax.platform_dependent(*args, cpu=cpu, default=accelerator)
