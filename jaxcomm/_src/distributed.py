"""The implementation of :mod:`jaxcomm.distributed` (private: import that module)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Mapping

import jax
from jax._src import distributed as jax_distributed

__all__ = ["StepTimeoutError", "StepWatchdog", "initialize", "initialize_from_env",
           "watchdog_bound"]

COORDINATOR_ENV = "JAXCOMM_COORDINATOR"
NUM_PROCESSES_ENV = "JAXCOMM_NUM_PROCESSES"
PROCESS_ID_ENV = "JAXCOMM_PROCESS_ID"
LOCAL_DEVICES_ENV = "JAXCOMM_LOCAL_DEVICES"
HEARTBEAT_TIMEOUT_ENV = "JAXCOMM_HEARTBEAT_TIMEOUT"


def _check_int(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{name} must be an int, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def _check_coordinator(coordinator) -> None:
  if not isinstance(coordinator, str):
    raise TypeError(f"coordinator must be a 'host:port' string, got {coordinator!r}.")
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
        f"coordinator must be 'host:port' with a port in 1..65535, got {coordinator!r}.")


def initialize(
    coordinator: str,
    num_processes: int,
    process_id: int,
    local_devices: int | None = None,
    *,
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 100,
    shutdown_timeout: int = 300,
) -> None:
  """Joins this process to a multi-process JAX job. Call it before any other JAX call.

  Wraps ``jax.distributed.initialize``. It selects the gloo collectives for CPU devices (on
  GPU, NCCL is used as JAX configures it by default) and, when ``local_devices`` is given,
  makes this process simulate that many CPU devices.

  Args:
    coordinator: ``'host:port'`` of process 0's coordination service, reachable by every
      process (e.g. ``'10.0.0.1:1234'``; ``'127.0.0.1:PORT'`` on one machine).
    num_processes: number of processes in the job (hosts on the ``host`` mesh axis).
    process_id: this process's index, in ``[0, num_processes)``; process 0 runs the
      coordination service.
    local_devices: CPU devices this process simulates; ``None`` uses the platform's devices
      as they are (one CPU device, or the GPUs visible through ``CUDA_VISIBLE_DEVICES``).
    initialization_timeout: seconds to wait for all processes to join.
    heartbeat_timeout: seconds without a heartbeat after which a process counts as dead: the
      coordination service (in process 0) then terminates every other process with an error
      naming the dead one ("The following tasks are unhealthy (stopped sending heartbeats)").
      A process blocked in a collective with a dead peer waits for this. If process 0 itself
      dies, the others fail at once (their coordination calls fail). The default of 100 s
      tolerates long pauses; measured detection time is ``heartbeat_timeout`` + under 1 s
      (docs/reliability.md).
    shutdown_timeout: seconds process 0 waits for the others at exit.

  Raises:
    TypeError, ValueError: for a malformed argument; the message names it.
    RuntimeError: if JAX's backend is already running (devices already enumerated or a
      computation already done), or the runtime is already initialized.

  Example:
    >>> jaxcomm.distributed.initialize('127.0.0.1:12345', 2, process_id, local_devices=4)  # doctest: +SKIP
    >>> mesh = jaxcomm.make_mesh()  # doctest: +SKIP  # ('host', 'local') = (2, 4)
  """
  _check_coordinator(coordinator)
  _check_int("num_processes", num_processes, 1)
  _check_int("process_id", process_id, 0)
  if process_id >= num_processes:
    raise ValueError(
        f"process_id must be < num_processes ({num_processes}), got {process_id}.")
  if local_devices is not None:
    _check_int("local_devices", local_devices, 1)
  for name, seconds in (("initialization_timeout", initialization_timeout),
                        ("heartbeat_timeout", heartbeat_timeout),
                        ("shutdown_timeout", shutdown_timeout)):
    _check_int(name, seconds, 1)
  if jax.distributed.is_initialized():
    raise RuntimeError("jax.distributed is already initialized in this process.")
  # Refuses to run once the backend exists, before anything is configured; the backend, created
  # later, reads the two settings below.
  jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=initialization_timeout,
      heartbeat_timeout_seconds=heartbeat_timeout,
      shutdown_timeout_seconds=shutdown_timeout)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if local_devices is not None:
    jax.config.update("jax_num_cpu_devices", local_devices)


def _env_int(environ: Mapping[str, str], name: str) -> int:
  text = environ[name]
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"environment variable {name} must be an integer, got {text!r}.") from None


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
  """Calls :func:`initialize` with the variables ``python -m jaxcomm.launch`` sets, if set.

  The variables are ``JAXCOMM_COORDINATOR`` (``host:port``), ``JAXCOMM_NUM_PROCESSES``,
  ``JAXCOMM_PROCESS_ID`` and, optionally, ``JAXCOMM_LOCAL_DEVICES`` and
  ``JAXCOMM_HEARTBEAT_TIMEOUT`` (seconds, see :func:`initialize`). A program can call this
  unconditionally at start: run directly, it stays a single process.

  Args:
    environ: the environment to read; defaults to ``os.environ``.

  Returns:
    True if the process joined a multi-process job, False if none of the variables is set.

  Raises:
    ValueError: if only some of the required variables are set, or one is malformed; the
      message names the variable.
  """
  environ = os.environ if environ is None else environ
  required = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
  present = [name for name in (*required, LOCAL_DEVICES_ENV) if name in environ]
  if not present:
    return False
  missing = [name for name in required if name not in environ]
  if missing:
    raise ValueError(f"{', '.join(present)} set but {', '.join(missing)} missing: set all of "
                     f"{', '.join(required)} (python -m jaxcomm.launch does).")
  local_devices = (_env_int(environ, LOCAL_DEVICES_ENV) if LOCAL_DEVICES_ENV in environ
                   else None)
  timeouts = ({"heartbeat_timeout": _env_int(environ, HEARTBEAT_TIMEOUT_ENV)}
              if HEARTBEAT_TIMEOUT_ENV in environ else {})
  initialize(environ[COORDINATOR_ENV], _env_int(environ, NUM_PROCESSES_ENV),
             _env_int(environ, PROCESS_ID_ENV), local_devices, **timeouts)
  return True


WATCHDOG_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: a temporary failure, restart from a checkpoint


class StepTimeoutError(RuntimeError):
  """A training step did not start or finish on every process within the watchdog's bound."""


def watchdog_bound(step_seconds, *, min_timeout: float, factor: float,
                   first_timeout: float) -> float:
  """The default bound of :class:`StepWatchdog`: ``max(min_timeout, factor * median)``.

  Args:
    step_seconds: durations of recent steps (compilation excluded); empty before any.
    min_timeout: the floor, in seconds.
    factor: multiple of the median step time a step may take.
    first_timeout: the bound while no step has been timed (the first step compiles).

  Returns:
    The bound in seconds.
  """
  if len(step_seconds) == 0:
    return first_timeout
  return max(min_timeout, factor * statistics.median(step_seconds))


def _check_seconds(name: str, value, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
      or value == float("inf"):
    raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}.")


class StepWatchdog:
  """Turns a process that is alive but stuck into a clear error on every process.

  A process that never reaches a collective (a hung data loader, a stalled driver) leaves its
  peers blocked inside that collective forever: the coordination service's heartbeat only
  catches dead processes. The watchdog bounds every wait on a peer:

  1. Before a step dispatches anything, :meth:`step` publishes the step number in the
     coordination service's key-value store (``NAME/progress/<process>``) and waits, at most
     the bound, until every process has arrived at the same step (a counter
     ``NAME/step/<k>/arrived``; the last arrival sets ``NAME/step/<k>/done``, which the others
     wait for, and deletes the previous step's keys). A process whose peer does not come raises
     :class:`StepTimeoutError` naming the processes that have not reached the step and the last
     step each published, instead of entering a collective they will not reach.
  2. While the step runs, a background thread holds a deadline (start + bound). A step that
     passed the rendezvous but does not finish in time (a peer stalled after it, inside the
     step) is blocked in C++ (gloo or NCCL), which Python cannot interrupt: the thread prints
     the same report to stderr and ends the process with ``os._exit(exit_code)``.

  The first watched step (which compiles) gets ``first_timeout`` and is not timed; every later
  step gets ``timeout`` if given, else ``max(min_timeout, factor * median)`` of the last
  ``window`` step times (``first_timeout`` while none is timed yet). After a :class:`StepTimeoutError` the job cannot go on (the coordination
  service would wait for the stuck process at shutdown, up to ``shutdown_timeout``): at
  interpreter exit the process leaves with ``exit_code`` at once. Without
  ``jax.distributed`` (one process) there is no rendezvous; the deadline still holds.

  Cost per step: three small coordination-service calls (set, increment, blocking get; the
  last arrival a set and a delete instead of the get), each a round trip to process 0: a few
  ms on loopback (docs/reliability.md).

  Args:
    timeout: fixed bound in seconds after the first step, or ``None`` for the median-derived
      one.
    min_timeout: floor of the derived bound, seconds.
    factor: the derived bound is this multiple of the median step time.
    window: how many recent step times the median looks at.
    first_timeout: bound of the first watched step (compilation) and its rendezvous.
    name: key prefix in the key-value store; distinct watchdogs of one job need distinct names.
    exit_code: status the process exits with when the watchdog fires.

  Raises:
    TypeError, ValueError: for a malformed argument; the message names it.

  Example:
    >>> watchdog = jaxcomm.distributed.StepWatchdog()  # doctest: +SKIP
    >>> for k in range(start, steps):  # doctest: +SKIP
    ...   batch = next(batches)
    ...   with watchdog.step(k):
    ...     params, opt_state, loss = train_step(params, opt_state, batch)
    ...     loss = float(loss)  # wait inside: the deadline covers the collectives
  """

  def __init__(self, timeout: float | None = None, *, min_timeout: float = 60.0,
               factor: float = 10.0, window: int = 32, first_timeout: float = 600.0,
               name: str = "jaxcomm_watchdog", exit_code: int = WATCHDOG_EXIT_CODE):
    _check_seconds("timeout", timeout, allow_none=True)
    _check_seconds("min_timeout", min_timeout)
    _check_seconds("factor", factor)
    _check_seconds("first_timeout", first_timeout)
    _check_int("window", window, 1)
    _check_int("exit_code", exit_code, 1)
    if not isinstance(name, str) or not name or "/" in name:
      raise ValueError(f"name must be a non-empty string without '/', got {name!r}.")
    self._timeout, self._min_timeout, self._factor = timeout, min_timeout, factor
    self._first_timeout, self._name, self._exit_code = first_timeout, name, exit_code
    self._samples = collections.deque(maxlen=window)
    self._client = jax_distributed.global_state.client
    self._process = jax_distributed.global_state.process_id if self._client else 0
    self._processes = jax_distributed.global_state.num_processes if self._client else 1
    self._previous: int | None = None
    self._watched = 0
    self._armed: tuple[int, float, float] | None = None
    self._closed = self._failed = False
    self._condition = threading.Condition()
    self._thread = threading.Thread(target=self._watch, name=f"{name}-thread", daemon=True)
    self._thread.start()
    atexit.register(self._exit_if_failed)

  def bound(self) -> float:
    """The bound in seconds the next step gets."""
    if self._watched == 0:
      return float(self._first_timeout)
    if self._timeout is not None:
      return float(self._timeout)
    return watchdog_bound(self._samples, min_timeout=self._min_timeout, factor=self._factor,
                          first_timeout=self._first_timeout)

  @property
  def next_step(self) -> int:
    """The step number after the last one watched (0 before any)."""
    return 0 if self._previous is None else self._previous + 1

  @contextlib.contextmanager
  def step(self, step: int):
    """Watches step ``step``: rendezvous on entry, deadline until the block ends.

    Every process uses the same increasing step numbers. Wait for the step's results inside
    the block (``float(loss)``, ``jax.block_until_ready``): only then does the deadline
    cover the collectives, and the step time measured is the real one.

    Raises:
      StepTimeoutError: on entry, if some process did not reach ``step`` within the bound.
      ValueError: if ``step`` does not increase.
    """
    _check_int("step", step, 0)
    if self._previous is not None and step <= self._previous:
      raise ValueError(f"step must increase: got {step} after {self._previous}.")
    bound = self.bound()
    self._rendezvous(step, bound)
    started = time.monotonic()
    with self._condition:
      self._armed = (step, started + bound, bound)
      self._condition.notify()
    try:
      yield
    finally:
      with self._condition:
        self._armed = None
    if self._watched > 1:  # the first watched step compiles
      self._samples.append(time.monotonic() - started)

  def close(self) -> None:
    """Stops the background thread (also at ``with`` exit)."""
    with self._condition:
      self._closed = True
      self._condition.notify()
    self._thread.join()
    if not self._failed:
      atexit.unregister(self._exit_if_failed)

  def __enter__(self) -> StepWatchdog:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _rendezvous(self, step: int, bound: float) -> None:
    self._watched += 1
    if self._processes > 1:
      client, prefix = self._client, self._name
      client.key_value_set(f"{prefix}/progress/{self._process}", str(step), allow_overwrite=True)
      if client.key_value_increment(f"{prefix}/step/{step}/arrived", 1) == self._processes:
        client.key_value_set(f"{prefix}/step/{step}/done", "1")
        if self._previous is not None:  # every process has left that step's rendezvous
          client.key_value_delete(f"{prefix}/step/{self._previous}")
      else:
        try:
          client.blocking_key_value_get(f"{prefix}/step/{step}/done", int(bound * 1000))
        except jax.errors.JaxRuntimeError as error:
          if "DEADLINE_EXCEEDED" not in str(error):
            raise
          self._failed = True
          raise StepTimeoutError(self._report(step, bound, started=False)) from None
    self._previous = step

  def _progress(self) -> dict[int, int]:
    """The last step each process published (processes that published none are absent)."""
    entries = self._client.key_value_dir_get(f"{self._name}/progress/")
    return {int(key.rsplit("/", 1)[1]): int(value) for key, value in entries}

  def _report(self, step: int, bound: float, *, started: bool) -> str:
    try:
      progress = self._progress() if self._processes > 1 else {self._process: step}
    except Exception as error:  # the report must not fail; the coordinator may be gone
      return (f"jaxcomm watchdog: step {step} exceeded its bound of {bound:.1f} s on process "
              f"{self._process}; the processes' progress could not be read ({error}).")
    describe = lambda p: (f"process {p} (last step {progress[p]})" if p in progress
                          else f"process {p} (no step yet)")
    if not started:
      behind = [p for p in range(self._processes) if progress.get(p, -1) < step]
      return (f"jaxcomm watchdog: step {step} did not start on every process within "
              f"{bound:.1f} s (process {self._process} waited for it). Processes that have not "
              f"reached step {step}: {', '.join(map(describe, behind))}.")
    behind = [p for p in range(self._processes) if progress.get(p, -1) <= step]
    return (f"jaxcomm watchdog: step {step} did not finish within {bound:.1f} s on process "
            f"{self._process}, which is blocked (a collective cannot be interrupted: exiting "
            f"with status {self._exit_code}). Processes that have not started step {step + 1}: "
            f"{', '.join(map(describe, behind))}.")

  def _watch(self) -> None:
    with self._condition:
      while not self._closed:
        if self._armed is None:
          self._condition.wait()
          continue
        step, deadline, bound = self._armed
        remaining = deadline - time.monotonic()
        if remaining > 0:
          self._condition.wait(remaining)
          continue
        self._failed = True
        self._exit(self._report(step, bound, started=True))

  def _exit(self, message: str) -> None:
    sys.stderr.write(message + "\n")
    self._exit_if_failed()

  def _exit_if_failed(self) -> None:
    if self._failed:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(self._exit_code)
