"""Pure gradient compressors: encode/decode, packed wire formats, error feedback."""

from jaxcomm.compress.base import (AxisContext, Compressor, axis_context, combining,
                                   payload_nbytes, psum_payload, replicated_fields, sum_payloads)
from jaxcomm.compress.cast import ScaledCastPayload, cast
from jaxcomm.compress.compose import ComposedState, compose
from jaxcomm.compress.delta import delta_encode
from jaxcomm.compress.error_feedback import (ErrorFeedbackState, EstimateFeedbackState,
                                             error_feedback, estimate_feedback)
from jaxcomm.compress.gradzip import GradZipPayload, GradZipState, gradzip
from jaxcomm.compress.identity import identity
from jaxcomm.compress.natural import NaturalPayload, natural
from jaxcomm.compress.packing import pack_bits, packed_nbytes, unpack_bits
from jaxcomm.compress.policy import CompressionPolicy, Rule, policy
from jaxcomm.compress.powersgd import (PowerSGDPayload, PowerSGDState, back_project,
                                       orthogonalize, powersgd, project)
from jaxcomm.compress.qsgd import QSGDPayload, qsgd
from jaxcomm.compress.quantize import (QuantizedPayload, SharedScalePayload, quantize,
                                       shared_quantize)
from jaxcomm.compress.randomk import (RandomKPayload, RandomKState, SharedRandomKPayload,
                                      randomk)
from jaxcomm.compress.selective import GradientStatistics, SelectiveCompression, selective
from jaxcomm.compress.sign import SignPayload, VotePayload, majority_vote, sign, sign_vote
from jaxcomm.compress.sketch import CountSketchPayload, CountSketchState, count_sketch
from jaxcomm.compress.terngrad import TernGradPayload, terngrad
from jaxcomm.compress.threshold import ThresholdPayload, adaptive_threshold, threshold
from jaxcomm.compress.topk import ChunkedTopKPayload, TopKPayload, topk

__all__ = [
    "AxisContext", "axis_context", "combining",
    "ChunkedTopKPayload", "ComposedState", "CompressionPolicy", "Compressor",
    "CountSketchPayload", "CountSketchState", "ErrorFeedbackState", "EstimateFeedbackState",
    "GradientStatistics",
    "NaturalPayload", "PowerSGDPayload", "PowerSGDState", "QSGDPayload", "QuantizedPayload",
    "RandomKPayload", "RandomKState", "Rule", "ScaledCastPayload", "SelectiveCompression",
    "SharedRandomKPayload", "SharedScalePayload", "SignPayload", "TernGradPayload",
    "ThresholdPayload", "TopKPayload", "VotePayload", "adaptive_threshold", "back_project",
    "cast", "compose", "count_sketch", "error_feedback", "estimate_feedback", "identity", "majority_vote", "natural",
    "orthogonalize", "pack_bits", "packed_nbytes", "payload_nbytes", "policy", "powersgd",
    "project", "psum_payload", "qsgd", "quantize", "randomk", "replicated_fields", "selective",
    "shared_quantize", "sign", "sign_vote", "sum_payloads", "terngrad", "threshold", "topk",
    "unpack_bits",
    "GradZipPayload", "GradZipState", "gradzip", "delta_encode",
]
