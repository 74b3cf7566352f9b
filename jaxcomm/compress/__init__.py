"""Pure gradient compressors: encode/decode, packed wire formats, error feedback."""

from jaxcomm.compress.base import Compressor, payload_nbytes
from jaxcomm.compress.error_feedback import ErrorFeedbackState, error_feedback
from jaxcomm.compress.identity import identity
from jaxcomm.compress.packing import pack_bits, packed_nbytes, unpack_bits
from jaxcomm.compress.quantize import QuantizedPayload, quantize
from jaxcomm.compress.sign import SignPayload, sign
from jaxcomm.compress.topk import TopKPayload, topk

__all__ = [
    "Compressor", "ErrorFeedbackState", "QuantizedPayload", "SignPayload", "TopKPayload",
    "error_feedback", "identity", "pack_bits", "packed_nbytes", "payload_nbytes", "quantize",
    "sign", "topk", "unpack_bits",
]
