"""Optax gradient transformations that communicate: compressed allreduce and friends."""

from jaxcomm._src.optim.accumulation import AccumulationState, accumulate_gradients
from jaxcomm._src.optim.adaptive import (AdaptiveState, Controller, adaptive_allreduce,
                                         bandwidth_controller, loss_controller, ratio_schedule)
from jaxcomm._src.optim.bmuf import BlockMomentumState, block_momentum, bmuf
from jaxcomm._src.optim.compress_updates import CompressUpdatesState, compress_updates
from jaxcomm._src.optim.compressed_allreduce import CompressedAllReduceState, compressed_allreduce
from jaxcomm._src.optim.dgc import DGCState, dgc
from jaxcomm._src.optim.demo import DeMoState, demo
from jaxcomm._src.optim.diloco import diloco, streaming_diloco
from jaxcomm._src.optim.fedavg import fedavg, fedprox
from jaxcomm._src.optim.gossip import GRAPHS, GossipState, check_mixing_matrix, gossip
from jaxcomm._src.optim.gradients import local_grad, local_value_and_grad
from jaxcomm._src.optim.host_adam import ScaleByHostAdamState, host_adamw, scale_by_host_adam
from jaxcomm._src.optim.local_sgd import local_sgd
from jaxcomm._src.optim.local_training import (consensus_distance, device_mean, local_training_step,
                                               to_device_local)
from jaxcomm._src.optim.loss_scale import DynamicLossScaleState, dynamic_loss_scale
from jaxcomm._src.optim.nonfinite import SkipNonFiniteState, skip_nonfinite
from jaxcomm._src.optim.onebit_adam import OneBitAdamState, onebit_adam
from jaxcomm._src.optim.periodic import PeriodicState, periodic_averaging
from jaxcomm._src.optim.powersgd import PowerSGDAllReduceState, powersgd_allreduce
from jaxcomm._src.optim.sharding import sharded_init, state_specs
from jaxcomm._src.optim.sparseloco import SparseLoCoSyncState, sparseloco
from jaxcomm._src.optim.slowmo import SlowMomentumState, slow_momentum, slowmo
from jaxcomm._src.optim.staleness import StalenessState, staleness
from jaxcomm._src.optim.train_step import data_parallel_step
from jaxcomm._src.optim.zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__ = [
    "SkipNonFiniteState", "skip_nonfinite",
    "OneBitAdamState", "onebit_adam",
    "BlockMomentumState", "block_momentum", "bmuf",
    "AdaptiveState", "Controller", "adaptive_allreduce", "bandwidth_controller",
    "loss_controller", "ratio_schedule",
    "AccumulationState", "CompressedAllReduceState", "DGCState", "DynamicLossScaleState", "GRAPHS",
    "GossipState", "PeriodicState", "PowerSGDAllReduceState", "SlowMomentumState",
    "StalenessState", "accumulate_gradients", "check_mixing_matrix", "compressed_allreduce",
    "consensus_distance", "data_parallel_step", "device_mean", "dgc", "diloco",
    "dynamic_loss_scale", "fedavg", "fedprox", "gossip", "local_grad", "local_sgd",
    "local_training_step", "local_value_and_grad", "periodic_averaging", "powersgd_allreduce",
    "sharded_init", "slow_momentum", "slowmo", "staleness", "state_specs", "to_device_local",
    "ZeroOneAdamState", "zero_one_adam",
    "DeMoState", "demo", "SparseLoCoSyncState", "sparseloco", "streaming_diloco",
    "CompressUpdatesState", "compress_updates",
    "ScaleByHostAdamState", "host_adamw", "scale_by_host_adam",
]
