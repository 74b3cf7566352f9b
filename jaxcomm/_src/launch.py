"""The implementation of :mod:`jaxcomm.launch` (private: import that module)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from jaxcomm._src.distributed import (COORDINATOR_ENV, LOCAL_DEVICES_ENV, NUM_PROCESSES_ENV,
                                      PROCESS_ID_ENV)

_POLL_SECONDS = 0.05


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind((host, 0))
    return probe.getsockname()[1]


def process_env(process_id: int, num_processes: int, coordinator: str,
                local_devices: int | None, base: Mapping[str, str]) -> dict[str, str]:
  """The environment of process ``process_id``: ``base`` plus the ``JAXCOMM_*`` variables."""
  env = {**base, COORDINATOR_ENV: coordinator, NUM_PROCESSES_ENV: str(num_processes),
         PROCESS_ID_ENV: str(process_id), "PYTHONUNBUFFERED": "1"}
  if local_devices is not None:
    env[LOCAL_DEVICES_ENV] = str(local_devices)
  return env


def _stream(process: subprocess.Popen, prefix: str, output: TextIO, lock: threading.Lock):
  for line in process.stdout:
    with lock:
      output.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
      output.flush()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(process.pid, signum)
  except ProcessLookupError:
    pass


def _stop(processes: Sequence[subprocess.Popen], grace: float) -> None:
  """SIGTERM to every running process group, SIGKILL to those still alive after ``grace``."""
  running = [p for p in processes if p.poll() is None]
  for process in running:
    _signal_group(process, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for process in running:
    try:
      process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      _signal_group(process, signal.SIGKILL)
      process.wait()


def _failure(processes: Sequence[subprocess.Popen]) -> int:
  """Exit status of the lowest-numbered finished process that failed, else 0.

  Shell convention: a process killed by signal ``s`` reports ``128 + s``.
  """
  for process in processes:
    code = process.poll()
    if code:
      return 128 - code if code < 0 else code
  return 0


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    local_devices: int | None = None,
    coordinator_host: str = "127.0.0.1",
    port: int | None = None,
    grace: float = 3.0,
    wrap: Callable[[int], Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
    output: TextIO | None = None,
) -> int:
  """Starts ``num_processes`` copies of ``command``, streams their output, and waits.

  Args:
    command: the program and its arguments, e.g. ``['python', '-m', 'benchmarks.mesh_scan']``.
    num_processes: number of processes (hosts on the ``host`` mesh axis).
    local_devices: CPU devices each process simulates; ``None`` leaves the platform's devices.
    coordinator_host: address of process 0's coordination service as the processes reach it.
    port: the coordination service's port; ``None`` picks a free one.
    grace: seconds between SIGTERM and SIGKILL when stopping the other processes after one
      failed. A JAX process catches SIGTERM (as a preemption notice) and keeps running, so it
      is stopped by the SIGKILL; the SIGTERM serves wrappers and programs that clean up.
    wrap: ``wrap(process_id)`` returns a prefix for that process's command line, e.g.
      ``['ip', 'netns', 'exec', 'host0']`` to run it in a network namespace.
    env: base environment of the processes; defaults to ``os.environ``.
    output: where the prefixed lines go; defaults to ``sys.stdout``.

  Returns:
    0 if every process succeeded, else the exit status of the first failure seen (the
    lowest process id when several are seen at once; ``128 + signal`` for a process killed by
    a signal). The other processes are then stopped, so their status is not reported.

  Raises:
    TypeError, ValueError: for a malformed argument; the message names it.
  """
  if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
    raise TypeError(f"command must be a non-empty sequence of strings, got {command!r}.")
  for name, value, minimum in (("num_processes", num_processes, 1),
                               ("local_devices", local_devices, 1), ("port", port, 1)):
    if value is None and name != "num_processes":
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
  if port is not None and port > 65535:
    raise ValueError(f"port must be <= 65535, got {port}.")
  if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
    raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}.")
  port = free_port(coordinator_host) if port is None else port
  coordinator = f"{coordinator_host}:{port}"
  base = os.environ if env is None else env
  output = sys.stdout if output is None else output
  lock = threading.Lock()
  processes, streams = [], []
  try:
    for process_id in range(num_processes):
      prefix = list(wrap(process_id)) if wrap else []
      process = subprocess.Popen(
          [*prefix, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          errors="replace", start_new_session=True,
          env=process_env(process_id, num_processes, coordinator, local_devices, base))
      processes.append(process)
      stream = threading.Thread(target=_stream, daemon=True,
                                args=(process, f"[process {process_id}] ", output, lock))
      stream.start()
      streams.append(stream)
    status = 0
    while status == 0 and any(p.poll() is None for p in processes):
      time.sleep(_POLL_SECONDS)
      status = _failure(processes)
    status = status or _failure(processes)
  finally:
    _stop(processes, grace)
    for stream in streams:
      stream.join()
  return status


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jaxcomm.launch",
      description=__doc__.split("\n\n")[0],
      epilog="Each process sees JAXCOMM_COORDINATOR, JAXCOMM_NUM_PROCESSES, JAXCOMM_PROCESS_ID "
             "and (with --local-devices) JAXCOMM_LOCAL_DEVICES; the program calls "
             "jaxcomm.distributed.initialize_from_env() at start. Example: python -m "
             "jaxcomm.launch -n 2 --local-devices 4 -- python -m benchmarks.mesh_scan",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      help="number of processes to start (hosts on the 'host' mesh axis)")
  parser.add_argument("--local-devices", type=int, default=None,
                      help="CPU devices each process simulates (default: the platform's own)")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port (default: a free port picked by the OS)")
  parser.add_argument("--coordinator-host", default="127.0.0.1",
                      help="address at which the processes reach process 0's coordinator")
  parser.add_argument("--grace", type=float, default=3.0,
                      help="seconds between SIGTERM and SIGKILL when stopping the other "
                           "processes after one failed")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="the command to run, after '--' (e.g. -- python train.py)")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after '--'")
  for flag, value in (("--num-processes", args.num_processes),
                      ("--local-devices", args.local_devices), ("--port", args.port)):
    if value is not None and value < 1:
      parser.error(f"{flag} must be >= 1, got {value}")
  if args.port is not None and args.port > 65535:
    parser.error(f"--port must be <= 65535, got {args.port}")
  if args.grace < 0:
    parser.error(f"--grace must be >= 0, got {args.grace}")
  try:
    return launch(command, args.num_processes, local_devices=args.local_devices,
                  coordinator_host=args.coordinator_host, port=args.port, grace=args.grace)
  except KeyboardInterrupt:
    return 130

