"""Starting JAX's multi-controller runtime: one process per host, CPU (gloo) or GPU (NCCL).

Every process of a multi-process job calls :func:`initialize` (or, when started by
``python -m jaxcomm.launch``, :func:`initialize_from_env`) before any other JAX call. Afterwards
``jax.devices()`` lists the devices of all processes, and :func:`jaxcomm.make_mesh` puts one
process on each row of the ``host`` axis, so collectives over ``host`` cross processes.

On CPU the cross-process collectives use gloo over TCP (XLA's CPU default has none); on GPU
the NCCL defaults are left alone. Simulated CPU devices per process (``local_devices``) give a
``(processes, local_devices)`` mesh on one machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

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
