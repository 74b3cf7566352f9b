"""DiLoCo and streaming DiLoCo: inner optimizer for ``H`` steps, outer Nesterov on the mean
pseudo-gradient."""

from __future__ import annotations

import optax

from jaxcomm.optim.periodic import periodic_averaging


def diloco(inner: optax.GradientTransformation, period: int, *,
           outer: optax.GradientTransformation | None = None,
           sync: optax.GradientTransformation | None = None, fragments: int = 1,
           delay: int = 0, mixing: float = 0.0) -> optax.GradientTransformation:
  """DiLoCo: ``period`` steps of any optax ``inner`` per device, then an outer step.

  The outer step: ``Delta = mean_i (theta_sync - theta_i)`` (the pseudo-gradient) through
  ``sync``; ``theta_sync <- theta_sync + outer(Delta)``; every device restarts from
  ``theta_sync``. ``sync`` may compress the pseudo-gradient with any jaxcomm compressor and
  error feedback, e.g. ``jaxcomm.compressed_allreduce(jaxcomm.sign())``: the residual of what
  one outer step did not send enters the next one.

  Streaming DiLoCo (``fragments > 1``): the parameters are split into contiguous fragments
  of about equal size; fragment ``f`` synchronizes after step ``t`` when ``t + 1`` is
  ``(f + 1) period / fragments`` modulo ``period``, so each step moves at most one fragment
  (peak bandwidth ``/ fragments``). Its new ``theta_sync`` is merged ``delay`` steps later
  (communication overlapped with compute) as ``theta_i = mixing theta_i + (1 - mixing)
  theta_sync``.

  With ``period = 1``, ``outer = optax.sgd(1.0)``: synchronous training with ``inner``'s
  updates averaged.

  State: :class:`~jaxcomm.optim.periodic.PeriodicState`: ``inner``'s state (device-local),
  ``theta_sync`` and one ``outer`` state per fragment (replicated), ``sync``'s state.

  Bytes per device: per synchronization, those of ``sync`` for the fragment (``D/fragments``
  parameter bytes); per step on average ``sync``'s bytes for ``D`` divided by ``period``.

  Args:
    inner: device-local optimizer, e.g. ``optax.adamw(1e-3)``.
    period: ``H >= 1`` inner steps between outer steps (per fragment).
    outer: outer optimizer; default ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` as in
      the paper.
    sync: averaging transformation (default dense :func:`jaxcomm.compressed_allreduce`).
    fragments: number of fragments synchronized in turn; must divide ``period``.
    delay: steps between a fragment's outer step and its merge, ``0 <= delay <
      period / fragments``.
    mixing: weight of the local parameters in the merge, ``[0, 1)``.

  Returns:
    An ``optax.GradientTransformation`` for device-local parameters.

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
    2023; Douillard et al., "Streaming DiLoCo with overlapping communication", 2025.
  """
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
  return periodic_averaging(inner, outer, period, sync=sync, fragments=fragments,
                            delay=delay, mixing=mixing)
