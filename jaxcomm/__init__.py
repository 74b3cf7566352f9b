"""jaxcomm: topology-aware compressed collective communication for JAX.

Gradients are reduced at full precision over the fast mesh axis (inside a host) and
compressed, with error feedback, over the slow axis (between hosts).

The top level holds what a training script needs: the library-owned step
(:func:`data_parallel`), the mesh, the gradient exchange as an optax transformation
(:func:`compressed_allreduce` with :func:`level` and :func:`policy`), the common compressors,
the low-communication optimizers and the planner. Everything else lives in its namespace:
``jaxcomm.compress`` (the whole compressor catalog and payload helpers), ``jaxcomm.optim``
(every optax transformation, the raw ``shard_map`` path: ``sharded_init``,
``data_parallel_step``, ``local_value_and_grad``), ``jaxcomm.collectives`` (strategies and the
hierarchical allreduce), ``jaxcomm.parallel`` (sequence and expert parallelism),
``jaxcomm.costmodel``, ``jaxcomm.links``, ``jaxcomm.planner``, ``jaxcomm.accounting``,
``jaxcomm.checkpoint``, ``jaxcomm.distributed`` and ``jaxcomm.launch``.
"""

import importlib
import warnings

from jaxcomm import (accounting, checkpoint, collectives, compress, costmodel, distributed,
                     launch, links, optim, parallel, planner)
from jaxcomm.collectives import level
from jaxcomm.compress import (Compressor, cast, error_feedback, identity, policy, powersgd,
                              quantize, randomk, sign, topk)
from jaxcomm.costmodel import predict
from jaxcomm.links import link
from jaxcomm.optim import (compressed_allreduce, demo, dgc, diloco, local_sgd, onebit_adam,
                           powersgd_allreduce, skip_nonfinite, sparseloco, streaming_diloco,
                           zero_one_adam)
from jaxcomm.planner import plan
from jaxcomm._src.topology import make_mesh
from jaxcomm._src.train import Trainer, TrainState, data_parallel

__version__ = "0.1.0"

__all__ = [
    # the step and the mesh
    "data_parallel", "Trainer", "TrainState", "make_mesh",
    # the gradient exchange
    "compressed_allreduce", "level", "policy",
    # compressors
    "Compressor", "identity", "cast", "quantize", "sign", "topk", "randomk", "powersgd",
    "error_feedback",
    # low-communication optimizers
    "dgc", "onebit_adam", "zero_one_adam", "powersgd_allreduce", "local_sgd", "diloco",
    "streaming_diloco", "sparseloco", "demo", "skip_nonfinite",
    # planning
    "plan", "predict", "link",
    # namespaces
    "accounting", "checkpoint", "collectives", "compress", "costmodel", "distributed", "launch",
    "links", "optim", "parallel", "planner",
]

#: Names that left the top level in 0.2, and the namespace that holds them now.
_MOVED = {
    "ErrorFeedbackState": "compress", "adaptive_threshold": "compress", "compose": "compress",
    "count_sketch": "compress", "majority_vote": "compress", "natural": "compress",
    "payload_nbytes": "compress", "psum_payload": "compress", "qsgd": "compress",
    "selective": "compress", "shared_quantize": "compress", "sign_vote": "compress",
    "sum_payloads": "compress", "terngrad": "compress", "threshold": "compress",
    "CompressedAllReduceState": "optim", "accumulate_gradients": "optim",
    "consensus_distance": "optim", "data_parallel_step": "optim", "device_mean": "optim",
    "dynamic_loss_scale": "optim", "fedavg": "optim", "fedprox": "optim", "gossip": "optim",
    "local_grad": "optim", "local_training_step": "optim", "local_value_and_grad": "optim",
    "sharded_init": "optim", "slowmo": "optim", "staleness": "optim", "state_specs": "optim",
    "to_device_local": "optim",
    "Level": "collectives", "hierarchical_allreduce": "collectives",
    "dense_attention": "parallel", "from_layout": "parallel", "gather_sequence": "parallel",
    "hybrid_attention": "parallel", "reduce_scatter_sequence": "parallel",
    "ring_attention": "parallel", "shard_positions": "parallel", "split_sequence": "parallel",
    "tile_counts": "parallel", "to_layout": "parallel", "ulysses_attention": "parallel",
    "project": "costmodel", "step_time": "costmodel",
    "Link": "links",
    "Plan": "planner",
}


def __getattr__(name: str):
  """``jaxcomm.qsgd`` and the other moved names still resolve, with a DeprecationWarning."""
  if name in _MOVED:
    home = f"jaxcomm.{_MOVED[name]}"
    warnings.warn(f"jaxcomm.{name} moved to {home}.{name}; the top-level name will be removed",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
  raise AttributeError(f"module 'jaxcomm' has no attribute {name!r}")
