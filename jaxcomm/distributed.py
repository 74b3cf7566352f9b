"""Starting JAX's multi-controller runtime: one process per host, CPU (gloo) or GPU (NCCL).

Every process of a multi-process job calls :func:`initialize` (or, when started by
``python -m jaxcomm.launch``, :func:`initialize_from_env`) before any other JAX call. Afterwards
``jax.devices()`` lists the devices of all processes, and :func:`jaxcomm.make_mesh` puts one
process on each row of the ``host`` axis, so collectives over ``host`` cross processes.

On CPU the cross-process collectives use gloo over TCP (XLA's CPU default has none); on GPU
the NCCL defaults are left alone. Simulated CPU devices per process (``local_devices``) give a
``(processes, local_devices)`` mesh on one machine.

A dead process is caught by the coordination service's heartbeat (``heartbeat_timeout``); a
process alive but stuck is caught by :class:`StepWatchdog`, which bounds every wait on a peer
and names the processes that did not reach a step (docs/reliability.md).
"""

from jaxcomm._src.distributed import (StepTimeoutError, StepWatchdog, initialize,
                                      initialize_from_env, watchdog_bound,
                                      HEARTBEAT_TIMEOUT_ENV, WATCHDOG_EXIT_CODE)

__all__ = [
    "StepTimeoutError", "StepWatchdog", "initialize", "initialize_from_env", "watchdog_bound",
    "HEARTBEAT_TIMEOUT_ENV", "WATCHDOG_EXIT_CODE",
]
