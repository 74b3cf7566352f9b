"""The accelerators' formulations, run on the CPU: ``backends.by_platform`` replaced by one that
always takes its ``accelerator`` branch."""

from jaxcomm._src.compress import backends


def use_accelerator_path(monkeypatch) -> None:
  """Makes every ``backends.by_platform`` call traced after this take the accelerator branch."""
  monkeypatch.setattr(backends, "by_platform", lambda cpu, accelerator, *args: accelerator(*args))
