"""The accelerators' formulations, run on the CPU: ``backends.by_platform`` replaced by one that
always takes its ``accelerator`` branch."""

import jax

from jaxcomm._src.compress import backends


def patch_accelerator_path(monkeypatch) -> None:
  """Makes every ``backends.by_platform`` call traced after this take the accelerator branch.

  Only calls traced anew: ``jax.jit`` of a function it has traced before with the same
  shapes reuses that trace, whatever ``by_platform`` is now. For a whole test, use
  :func:`use_accelerator_path`."""
  monkeypatch.setattr(backends, "by_platform", lambda cpu, accelerator, *args: accelerator(*args))


def use_accelerator_path(monkeypatch, request) -> None:
  """:func:`patch_accelerator_path` for the rest of a test, with JAX's caches cleared now and
  when the test ends: no trace made with one formulation (in this test, an earlier one or a
  later one) is reused with the other, which would test the CPU's twice."""
  jax.clear_caches()
  request.addfinalizer(jax.clear_caches)
  patch_accelerator_path(monkeypatch)
