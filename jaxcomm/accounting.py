"""Bytes on the wire, read from the collectives in a compiled executable.

:func:`measure` compiles a jitted function and reads every collective from the optimized HLO
(what the backend will really run, after XLA's own rewrites, e.g. the CPU backend widening a
bfloat16 all-reduce to float32). Each collective's replica groups are mapped back to the mesh
axes they span. Bytes each device sends per call, for a collective over ``n`` devices, use the
ring-algorithm factors:

==================  =========================  =======================================
collective          ``S`` (from the HLO)       bytes sent per device
==================  =========================  =======================================
all-reduce          result bytes               ``2 (n-1)/n * S``
all-gather          result (gathered) bytes    ``(n-1)/n * S``
reduce-scatter      result (one shard) bytes   ``(n-1) * S``
all-to-all          result bytes               ``(n-1)/n * S``
collective-permute  result bytes               ``S`` times the share of devices that send
==================  =========================  =======================================

A collective that spans several axes is attributed to all of them as a tuple key, e.g.
``('host', 'local')``. :meth:`CommReport.link_bytes` charges each axis the bytes that cross
its links, for the device that sends the most over the slowest axis (:meth:`Collective.split`):

* an all-to-all sends ``S/n`` to each peer, and a peer is reached over the slowest axis on
  which it differs from the sender: on axes of sizes ``n_1`` (slowest) ... ``n_m``, axis
  ``i`` reaches ``(n_i - 1) n_{i+1} ... n_m`` peers and carries that many ``S/n`` blocks,
  e.g. ``(H-1) L / n * S`` over ``host`` and ``(L-1)/n * S`` over ``local`` on ``H x L``
  (together ``(n-1)/n * S``); every device sends the same;
* a ring collective (all-reduce, all-gather, reduce-scatter) and a collective-permute send
  each device's whole share to one neighbour; in a ring over several hosts a device at a
  host boundary sends all of it over the slowest axis, and the ring waits for it: the whole
  ``bytes_per_device`` is charged to the slowest axis.

Counts are static: a collective inside a loop body is counted once per compiled occurrence,
not once per iteration.

Branches of a ``lax.cond``/``lax.switch`` are mutually exclusive, and their bytes are never
added up. Each collective records the branches it sits in (:attr:`Collective.branch`);
:meth:`CommReport.weights` gives each one its executions per call:

* a conditional with collectives in one branch only (a periodic synchronization) counts
  them once: the bytes of a call that takes it;
* a conditional with collectives in several branches counts its *steady state*: the one
  branch not marked as a warm-up with :func:`warmup` (PowerSGD's ``start_step``, DGC's
  warm-up stages, 1-bit Adam's full-precision steps);
* ``branch_weights`` (how often each branch runs) overrides both, and a conditional with
  several unmarked branches holding collectives (0/1 Adam's step kinds) needs it: without it,
  :meth:`CommReport.weights` raises. :meth:`CommReport.branch_bytes` lists every branch's
  bytes, labelled.
"""

from jaxcomm._src.accounting import (Cost, NO_COST, ring_cost, warmup, Collective, CommReport,
                                     report_from_hlo, measure)

__all__ = [
    "Cost", "NO_COST", "ring_cost", "warmup", "Collective", "CommReport", "report_from_hlo",
    "measure",
]
