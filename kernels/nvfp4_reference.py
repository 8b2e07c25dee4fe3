"""PyTorch reference for NVFP4 weights in format 1 (swizzled scales): decode and matmul.

These work directly on the packed tensors the converter writes: ``weight`` uint8 [..., N, K/2],
``weight_scale`` uint8 [..., swz(N, K/16)] in the 128x4 swizzle, ``alpha`` float32 [...].
Only the rows asked for are decoded, so a caller never materialises a whole dequantised model.
"""

from __future__ import annotations

import torch

from .interleave import deinterleave_gate_up
from .nvfp4 import BLOCK, dequantize_nvfp4
from .swizzle import unswizzle_block_scales


def decode_weight(weight: torch.Tensor, weight_scale: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """One NVFP4 matrix in format 1 -> float32 [N, K] (``weight`` [N, K/2], ``weight_scale`` flat)."""
    rows, half_k = weight.shape
    scales = unswizzle_block_scales(weight_scale.reshape(-1), rows, 2 * half_k // BLOCK)
    return dequantize_nvfp4(weight, scales, alpha)


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 alpha: torch.Tensor | float) -> torch.Tensor:
    """``x @ W.T`` in float32 for an NVFP4 weight in format 1; ``x`` [..., K] -> [..., N]."""
    return x.float() @ decode_weight(weight, weight_scale, alpha).T


def decode_gate_up(weight: torch.Tensor, weight_scale: torch.Tensor,
                   alpha: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused w13 matrix (rows interleaved gate/up by 8) -> float32 (gate [I, K], up [I, K]).

    ``alpha`` is the (gate, up) pair of format 1's routed ``w13.alpha`` or one shared scalar.
    """
    pair = torch.as_tensor(alpha, dtype=torch.float32, device=weight.device).reshape(-1).expand(2)
    gate, up = deinterleave_gate_up(decode_weight(weight, weight_scale, 1.0))
    return gate * pair[0], up * pair[1]
