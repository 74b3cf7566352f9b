"""Allreduce strategies over named mesh axes, composed into N-level topologies."""

from jaxcomm._src.collectives.buckets import Bucket, pack, plan_buckets, unpack
from jaxcomm._src.collectives.hierarchical import (Level, hierarchical_allreduce, hierarchical_cost,
                                                   init_states, level, prescattered)
from jaxcomm._src.collectives.strategies import (STRATEGIES, Dense, Gather, Linear, Strategy, TwoPhase,
                                                 TwoPhaseState, gather_sum, linear_sum, over_axis,
                                                 resolve, two_phase_sum)

__all__ = [
    "Bucket", "Dense", "Gather", "Level", "Linear", "STRATEGIES", "Strategy", "TwoPhase",
    "TwoPhaseState", "gather_sum", "hierarchical_allreduce", "hierarchical_cost",
    "init_states", "level", "linear_sum", "over_axis", "pack", "plan_buckets", "prescattered",
    "resolve", "two_phase_sum", "unpack",
]
