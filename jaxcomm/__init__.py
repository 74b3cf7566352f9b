"""jaxcomm: topology-aware compressed collective communication for JAX.

Gradients are reduced at full precision over the fast mesh axis (inside a host) and
compressed, with error feedback, over the slow axis (between hosts).
"""

from jaxcomm import accounting, collectives, compress, costmodel, links, optim
from jaxcomm.collectives import hierarchical_allreduce, level
from jaxcomm.compress import (Compressor, ErrorFeedbackState, error_feedback, identity,
                              payload_nbytes, quantize, sign, topk)
from jaxcomm.optim import (CompressedAllReduceState, compressed_allreduce, local_grad,
                           local_value_and_grad, sharded_init, state_specs, data_parallel_step)
from jaxcomm.costmodel import predict, project, step_time
from jaxcomm.links import Link, link
from jaxcomm.topology import make_mesh

__version__ = "0.1.0"

__all__ = [
    "CompressedAllReduceState", "Compressor", "ErrorFeedbackState", "Link", "accounting",
    "collectives", "compress", "costmodel", "compressed_allreduce", "data_parallel_step", "error_feedback", "hierarchical_allreduce", "identity", "level",
    "link", "links", "local_grad", "local_value_and_grad", "make_mesh", "optim", "payload_nbytes",
    "predict", "project", "quantize", "sharded_init", "sign", "state_specs", "step_time", "topk",
]
