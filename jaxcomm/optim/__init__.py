"""Optax gradient transformations that communicate: compressed allreduce and friends."""

from jaxcomm.optim.compressed_allreduce import CompressedAllReduceState, compressed_allreduce
from jaxcomm.optim.gradients import local_grad, local_value_and_grad
from jaxcomm.optim.loss_scale import DynamicLossScaleState, dynamic_loss_scale
from jaxcomm.optim.powersgd import PowerSGDAllReduceState, powersgd_allreduce
from jaxcomm.optim.sharding import sharded_init, state_specs
from jaxcomm.optim.train_step import data_parallel_step

__all__ = ["CompressedAllReduceState", "DynamicLossScaleState", "dynamic_loss_scale", "PowerSGDAllReduceState", "powersgd_allreduce", "compressed_allreduce", "data_parallel_step", "local_grad",
           "local_value_and_grad", "sharded_init", "state_specs"]
