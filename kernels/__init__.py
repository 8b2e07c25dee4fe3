"""Kernels and their contracts: numerics codecs, layout transforms (forward/inverse pairs),
PyTorch reference ops and CuTeDSL kernels. Imports nothing from ``runtime`` or ``convert``."""

from .e2m1 import decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from .fp8 import fp8_block_dequantize, fp8_block_quantize
from .fp8_nvfp4 import Fp8Cast, fp8_to_nvfp4
from .interleave import deinterleave_gate_up, interleave_gate_up
from .mxfp4 import CastResult, dequantize_mxfp4, mxfp4_to_nvfp4
from .nvfp4 import Nvfp4, dequantize_nvfp4, encode_nvfp4, quantize_nvfp4, reconcile_global_scales
from .scales import decode_e4m3, decode_e8m0, encode_e4m3, encode_e8m0
from .swizzle import swizzle_block_scales, swizzled_nbytes, unswizzle_block_scales

__all__ = [
    "CastResult", "Nvfp4",
    "decode_e2m1", "encode_e2m1", "pack_nibbles", "unpack_nibbles",
    "decode_e4m3", "encode_e4m3", "decode_e8m0", "encode_e8m0",
    "fp8_block_dequantize", "fp8_block_quantize", "Fp8Cast", "fp8_to_nvfp4",
    "dequantize_mxfp4", "mxfp4_to_nvfp4",
    "dequantize_nvfp4", "encode_nvfp4", "quantize_nvfp4", "reconcile_global_scales",
    "swizzle_block_scales", "swizzled_nbytes", "unswizzle_block_scales",
    "interleave_gate_up", "deinterleave_gate_up",
]
