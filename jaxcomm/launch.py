"""Runs one command as N JAX processes on this machine: ``python -m jaxcomm.launch -n N -- CMD``.

Each process gets the environment that :func:`jaxcomm.distributed.initialize_from_env` reads
(coordinator address, process count, its process id, simulated CPU devices), so a program
that calls it at start joins one multi-process job whose ``host`` mesh axis crosses
processes. Output lines are prefixed with ``[process i]``. When a process fails, the others are
stopped (SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher returns its exit code.
"""

import sys

from jaxcomm._src.launch import (free_port, process_env, launch, main)

__all__ = [
    "free_port", "process_env", "launch", "main",
]

if __name__ == "__main__":
  sys.exit(main())
