"""Pure gradient compressors: encode/decode, packed wire formats, error feedback."""

from jaxcomm._src.compress.base import (AxisContext, Compressor, axis_context, combining,
                                        payload_nbytes, psum_payload, replicated_fields, sum_payloads)
from jaxcomm._src.compress.cast import ScaledCastPayload, cast
from jaxcomm._src.compress.compose import ComposedState, compose
from jaxcomm._src.compress.delta import delta_encode
from jaxcomm._src.compress.error_feedback import (ErrorFeedbackState, EstimateFeedbackState,
                                                  error_feedback, estimate_feedback)
from jaxcomm._src.compress.gradzip import GradZipPayload, GradZipState, gradzip
from jaxcomm._src.compress.identity import identity
from jaxcomm._src.compress.natural import NaturalPayload, natural
from jaxcomm._src.compress.packing import pack_bits, packed_nbytes, unpack_bits
from jaxcomm._src.compress.policy import CompressionPolicy, Rule, policy
from jaxcomm._src.compress.powersgd import (PowerSGDPayload, PowerSGDState, back_project,
                                            orthogonalize, powersgd, project)
from jaxcomm._src.compress.qsgd import QSGDPayload, qsgd
from jaxcomm._src.compress.quantize import (QuantizedPayload, SharedScalePayload, quantize,
                                            shared_quantize)
from jaxcomm._src.compress.randomk import (RandomKPayload, RandomKState, SharedRandomKPayload,
                                           randomk)
from jaxcomm._src.compress.selective import GradientStatistics, SelectiveCompression, selective
from jaxcomm._src.compress.sign import SignPayload, VotePayload, majority_vote, sign, sign_vote
from jaxcomm._src.compress.sketch import CountSketchPayload, CountSketchState, count_sketch
from jaxcomm._src.compress.terngrad import TernGradPayload, terngrad
from jaxcomm._src.compress.threshold import ThresholdPayload, adaptive_threshold, threshold
from jaxcomm._src.compress.topk import ChunkedTopKPayload, TopKPayload, topk

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
