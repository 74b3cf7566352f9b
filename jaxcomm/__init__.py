"""jaxcomm: topology-aware compressed collective communication for JAX.

Gradients are reduced at full precision over the fast mesh axis (inside a host) and
compressed, with error feedback, over the slow axis (between hosts).
"""

from jaxcomm import accounting, collectives, compress, optim
from jaxcomm.collectives import hierarchical_allreduce
from jaxcomm.compress import (Compressor, ErrorFeedbackState, error_feedback, identity,
                              payload_nbytes, quantize, sign, topk)
from jaxcomm.optim import (CompressedAllReduceState, compressed_allreduce, local_grad,
                           local_value_and_grad, sharded_init, state_specs, data_parallel_step)
from jaxcomm.topology import make_mesh

__version__ = "0.1.0"

__all__ = [
    "CompressedAllReduceState", "Compressor", "ErrorFeedbackState", "accounting", "collectives",
    "compress", "compressed_allreduce", "data_parallel_step", "error_feedback", "hierarchical_allreduce", "identity",
    "local_grad", "local_value_and_grad", "make_mesh", "optim", "payload_nbytes", "quantize",
    "sharded_init", "sign", "state_specs", "topk",
]
