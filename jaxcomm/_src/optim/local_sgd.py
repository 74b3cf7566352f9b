"""Local SGD and post-local SGD: average device-local models every ``H`` steps."""

from __future__ import annotations

import optax

from jaxcomm._src.optim.periodic import periodic_averaging


def local_sgd(inner: optax.GradientTransformation, period: int, *, warmup_steps: int = 0,
              sync: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
  """Local SGD: ``period`` local steps of ``inner`` on each device, then average parameters.

  ``theta_i <- mean_j theta_j`` every ``period`` steps, computed as
  ``theta_sync - mean_j (theta_sync - theta_j)`` so that ``sync`` can compress the
  differences (e.g. ``jaxcomm.compressed_allreduce(jaxcomm.topk(0.01))`` with error
  feedback). ``period = 1`` is synchronous data-parallel training with ``inner``'s update
  averaged (for SGD: synchronous SGD). With ``warmup_steps`` every one of the first steps
  synchronizes: post-local SGD (Lin et al. 2020).

  State: :class:`~jaxcomm.optim.periodic.PeriodicState`: ``inner``'s state (device-local),
  ``theta_sync`` (replicated), ``sync``'s state.

  Bytes per device per step: those of ``sync`` for all parameters, divided by ``period``
  (dense two-level: ``2(G-1)/G D / H`` intra-host, ``2(H_hosts-1)/H_hosts D/G / H``
  inter-host for ``D`` parameter bytes).

  Args:
    inner: the device-local optimizer, e.g. ``optax.sgd(0.1)``.
    period: ``H >= 1``, local steps between averagings.
    warmup_steps: initial synchronous steps (post-local SGD), ``>= 0``.
    sync: averaging transformation (default dense :func:`jaxcomm.compressed_allreduce`).

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters
    (:func:`jaxcomm.optim.to_device_local`, :func:`jaxcomm.optim.local_training_step`).

  References:
    Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin, Stich, Patel &
    Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020 (post-local SGD).
  """
  return periodic_averaging(inner, optax.sgd(1.0), period, sync=sync,
                            warmup_steps=warmup_steps)
