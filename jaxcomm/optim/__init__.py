"""Optax gradient transformations that communicate: compressed allreduce and friends."""

from jaxcomm.optim.compressed_allreduce import CompressedAllReduceState, compressed_allreduce
from jaxcomm.optim.gradients import local_grad, local_value_and_grad
from jaxcomm.optim.sharding import sharded_init, state_specs

__all__ = ["CompressedAllReduceState", "compressed_allreduce", "local_grad",
           "local_value_and_grad", "sharded_init", "state_specs"]
