"""Trains one task with one method on one mesh and returns what it measured."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxcomm
from benchmarks.scan.methods import Method, Setting
from benchmarks.scan.tasks import Task


def run(task: Task, method: Method, mesh, setting: Setting, steps: int, timed_steps: int,
        on_step: Callable[[], None] = lambda: None) -> dict:
  """Trains ``steps`` steps; measures bytes (compiled HLO), step times, losses.

  Args:
    task: the model and data.
    method: how gradients are averaged.
    mesh: the ``('host', 'local')`` mesh.
    setting: what the method's builder reads.
    steps: training steps.
    timed_steps: the last steps, whose median wall-clock time is the step time.
    on_step: called after every step (progress bar).

  Returns:
    A dict: ``inter_host_bytes``, ``intra_host_bytes`` (each device, per step, each branch
    of the step's conditionals weighted by ``branch_weights``, how often it ran per step),
    ``collectives``, ``losses`` (per step, mean over devices), ``held_out_loss``,
    ``median_step_s``, and ``report`` (the :class:`~jaxcomm.accounting.CommReport`).
  """
  tx = method.build(setting)
  if method.device_local:
    params = jaxcomm.optim.to_device_local(task.params, mesh)
    opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh,
                                            PartitionSpec(tuple(mesh.axis_names)))
  else:
    params = jax.device_put(task.params, NamedSharding(mesh, PartitionSpec()))
    opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)
  sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
  batch_at = lambda index: jax.device_put(task.batch(index), sharding)  # noqa: E731
  # Compile once: the bytes are read from the very executable that is timed.
  step = method.make_step(task.loss_fn, tx, mesh, specs).lower(
      params, opt_state, batch_at(0)).compile()
  report = jaxcomm.accounting.report_from_hlo(step.as_text(), mesh)
  losses, times = [], []
  for index in range(steps):
    batch = batch_at(index)
    started = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))  # blocks until the step is done
    times.append(time.perf_counter() - started)
    on_step()
  branch_weights = _branch_weights(method, setting, report, opt_state)
  link = report.link_bytes(("host", "local"), branch_weights)
  if method.device_local:
    params = jaxcomm.optim.device_mean(params, mesh)
  held_out = float(jax.jit(task.loss_fn)(params, task.held_out))
  return {
      "comm_every": method.comm_every,
      "branch_weights": branch_weights,
      "inter_host_bytes": link["host"],
      "intra_host_bytes": link["local"],
      "collectives": report.count(),
      "losses": losses,
      "held_out_loss": held_out,
      "median_step_s": float(np.median(times[-timed_steps:])),
      "report": report,
  }


def _branch_weights(method: Method, setting: Setting, report, opt_state) -> dict | None:
  """How often each branch of the step's outermost conditionals ran, per step.

  A periodic method's conditional collectives run once per ``comm_every`` steps (the loss
  mean outside them every step); a method with ``branch_fractions`` has one outermost
  conditional whose branch shares come from its final state.
  """
  if method.branch_fractions is None:
    return {name: [1 / method.comm_every] * branches
            for name, branches in report.conditionals().items()}
  conditionals = report.conditionals()
  if len(conditionals) != 1:
    raise ValueError(f"method {method.name!r} weighs branches, but its compiled step has "
                     f"{len(conditionals)} outermost conditionals with collectives: "
                     f"{conditionals}.")
  return {next(iter(conditionals)): method.branch_fractions(setting, opt_state)}
