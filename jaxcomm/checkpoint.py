"""Saving and restoring training state with orbax, device-local communication state included.

A long run must not lose what compression has not sent yet: the error-feedback residuals
(worker and server), PowerSGD warm starts, PRNG keys and counters of
:func:`jaxcomm.compressed_allreduce`, next to the parameters and the state of the optax
transformations chained after it. They are ordinary pytrees of ``jax.Array``, partly
device-local (sharded along their first dimension, see :func:`jaxcomm.optim.sharded_init`), so
orbax writes each shard from the process that holds it (tensorstore/OCDBT files, JSON
metadata; nothing is pickled) and reads it back onto the same layout.

A checkpoint is visible only when complete (:func:`save` writes ``<step>.partial`` and renames
it after recording every file's SHA-256 in a manifest); :func:`restore` checks the files,
names a corrupt checkpoint's step and file and falls back to the newest good one, names every
leaf where the target differs, and maps compressed_allreduce's device-local residuals when the
mesh shape changed (e.g. 2 hosts x 4 -> 4 x 2).

Restoring needs a *target*: the pytree structure, shapes, dtypes and shardings of the state.
:func:`abstract_state` builds it from the optimizer without computing anything; any pytree
of arrays laid out as wanted (e.g. a fresh ``sharded_init``) serves as well. Every process of
a multi-process job calls these functions together, with the same directory (a file system
all processes see).

Requires the optional dependency ``orbax-checkpoint`` (``pip install jaxcomm[checkpoint]``).

Example:
  >>> opt_state, specs = jaxcomm.optim.sharded_init(tx, params, mesh)  # doctest: +SKIP
  >>> jaxcomm.checkpoint.save(directory, step, {'params': params, 'opt': opt_state})  # doctest: +SKIP
  >>> target = {'params': params, 'opt': jaxcomm.checkpoint.abstract_state(tx, params, mesh)}  # doctest: +SKIP
  >>> state = jaxcomm.checkpoint.restore(directory, target)  # doctest: +SKIP
"""

from jaxcomm._src.checkpoint import (CorruptCheckpointError, abstract_state, all_steps,
                                     latest_step, restore, save, verify, MANIFEST)

__all__ = [
    "CorruptCheckpointError", "abstract_state", "all_steps", "latest_step", "restore", "save",
    "verify", "MANIFEST",
]
