"""Alpha-beta communication time: per collective, per compiled step, per projected model.

On a link with latency ``alpha`` (seconds per message step) and inverse bandwidth ``beta``
(seconds per byte, see :class:`jaxcomm.links.Link`), ring algorithms over ``n`` devices take:

==================  ====================================  ======================================
collective          ``D`` is                              time
==================  ====================================  ======================================
all-reduce          the array reduced (per device)        ``2(n-1) alpha + 2(n-1)/n D beta``
all-gather          the *gathered* result (``n`` shards)  ``(n-1) alpha + (n-1)/n D beta``
reduce-scatter      the *full input* (``n`` shards)       ``(n-1) alpha + (n-1)/n D beta``
all-to-all          each device's buffer (``n`` chunks)   ``(n-1) alpha + (n-1)/n D beta``
ppermute            what each device sends                ``alpha + D beta``
==================  ====================================  ======================================

The ``D beta`` factors are the bytes each device sends (the table in
:mod:`jaxcomm.accounting`). Every device sends at once, each on its own link, so a
collective takes as long as one device's share. :func:`predict` charges each collective of a
compiled step (a :class:`~jaxcomm.accounting.CommReport`) to one link, and :func:`project`
models the hierarchical allreduce of a whole model from its gradient shapes, without compiling.

Assumptions: collectives run one after another (in the hierarchical scheme each phase needs
the previous one's result), so times add; no congestion beyond the link's own bandwidth; the
``alpha`` term is paid once per ring step, by every collective, however small.

References:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
  MPICH", IJHPCA 2005; Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations", JPDC 2009.
"""

from jaxcomm._src.costmodel import (all_reduce_time, all_gather_time, reduce_scatter_time,
                                    all_to_all_time, ppermute_time, collective_time, CommTime,
                                    slowest_first, predict, step_time, TransformerConfig,
                                    TRANSFORMERS, transformer_gradient_shapes, Projection,
                                    Traffic, NO_TRAFFIC, traffic, project)

__all__ = [
    "all_reduce_time", "all_gather_time", "reduce_scatter_time", "all_to_all_time",
    "ppermute_time", "collective_time", "CommTime", "slowest_first", "predict", "step_time",
    "TransformerConfig", "TRANSFORMERS", "transformer_gradient_shapes", "Projection", "Traffic",
    "NO_TRAFFIC", "traffic", "project",
]
