"""Sequence parallelism: ring attention, Ulysses, layouts and sequence-parallel helpers.

Expert parallelism: ``moe_layer`` (top-k routing, all-to-all expert dispatch).
"""

from jaxcomm._src.parallel.blocks import (block_backward, block_forward, cudnn_supports,
                                          dense_attention, merge_partials, select_implementation)
from jaxcomm._src.parallel.layouts import (LAYOUTS, BlockKind, block_schedule, from_layout,
                                           layout_permutation, shard_positions, tile_counts,
                                           to_layout)
from jaxcomm._src.parallel.moe import (MoELayer, MoEParams, MoEStats, Routing, capacity,
                                       expert_mlp, moe_layer, moe_reference, route)
from jaxcomm._src.parallel.ring_attention import ring_attention
from jaxcomm._src.parallel.sequence_parallel import (gather_sequence, reduce_scatter_sequence,
                                                     split_sequence)
from jaxcomm._src.parallel.ulysses import hybrid_attention, ulysses_attention

__all__ = [
    "LAYOUTS",
    "BlockKind",
    "MoELayer",
    "MoEParams",
    "MoEStats",
    "Routing",
    "block_backward",
    "block_forward",
    "block_schedule",
    "capacity",
    "cudnn_supports",
    "dense_attention",
    "expert_mlp",
    "from_layout",
    "gather_sequence",
    "hybrid_attention",
    "layout_permutation",
    "merge_partials",
    "moe_layer",
    "moe_reference",
    "reduce_scatter_sequence",
    "ring_attention",
    "route",
    "select_implementation",
    "shard_positions",
    "split_sequence",
    "tile_counts",
    "to_layout",
    "ulysses_attention",
]
