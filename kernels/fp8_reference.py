"""PyTorch reference for FP8 block-scaled dense linears (the ``--dense keep`` layers).

Operands: ``weight`` F8_E4M3 [out, in] (float8_e4m3fn or its uint8 bytes), ``scale`` [ceil(out/128),
ceil(in/128)] as E8M0 bytes (release checkpoints) or float32 (-Base). ``y = x @ (fp8 * scale).T`` in
float32; activations are not quantised (the official reference's FP8 activation simulation is
not reproduced).
"""

from __future__ import annotations

import torch

from .fp8 import fp8_block_dequantize


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., in] -> float32 [..., out]."""
    return x.float() @ fp8_block_dequantize(weight, scale).T
