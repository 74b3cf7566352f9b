"""Choose a compressor per gradient leaf: least modeled slow-link time within an error budget.

For every leaf of a sample gradient and every candidate compressor, :func:`plan` measures the
relative compression error ``||C(x) - x|| / ||x||`` on the leaf and models the time its slow-axis
exchange takes with the alpha-beta cost model (:mod:`jaxcomm.costmodel`) for the strategy
``compressed_allreduce`` would pick. It keeps, per leaf, the fastest candidate whose error is
within ``max_error``; full precision (error 0) is always a candidate, so a plan always exists.
The result is an inspectable :class:`Plan` whose ``policy`` ``compressed_allreduce`` takes.
"""

from jaxcomm._src.planner import (default_candidates, LeafPlan, Plan, plan)

__all__ = [
    "default_candidates", "LeafPlan", "Plan", "plan",
]
