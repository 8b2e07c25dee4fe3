"""PyTorch reference for FP8 block-scaled dense linears (the ``--dense keep`` layers).

Operands: ``weight`` F8_E4M3 [out, in] (float8_e4m3fn or its uint8 bytes), ``scale`` [ceil(out/128),
ceil(in/128)] as E8M0 bytes (release checkpoints) or float32 (-Base). ``y = x @ (fp8 * scale).T`` in
float32; activations are not quantised (the official reference's FP8 activation simulation is
not reproduced) by :func:`fp8_linear`.

The W8A8 GEMM (``sm90_fp8_gemm``) quantises them as the official inference does: :func:`fp8_act_quantize` (per token
and 128 K, scale ``amax / 448``) and :func:`fp8_w8a8_linear` (each 128-K block's dot products times both block
scales, summed in float32).
"""

from __future__ import annotations

import torch

from .fp8 import fp8_block_dequantize


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., in] -> float32 [..., out]."""
    return x.float() @ fp8_block_dequantize(weight, scale).T


ACT_BLOCK = 128      # activations: one scale per token and this many K
E4M3_MAX = 448.0


def fp8_act_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (C a multiple of 128) -> (float8_e4m3fn [T, C], float32 scales [T, C / 128]): per 1 x 128 block
    ``scale = amax / 448`` and values ``x / scale`` (a zero block: scale 0, values 0), in float32."""
    t, c = x.shape
    blocks = x.float().view(t, c // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(-1)
    # divided by a tensor: torch takes a division by a scalar as a product with its reciprocal (448 = 7 * 64 has no
    # exact one), the kernel divides
    scale = amax / torch.full_like(amax, E4M3_MAX)
    div = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (blocks / div[..., None]).to(torch.float8_e4m3fn).view(t, c), scale


def fp8_w8a8_linear(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    groups: int = 1) -> torch.Tensor:
    """float32 [T, G * N]: ``out[t, g n] = sum_kb (xq[t, g, kb] . w[g n, kb]) * sx[t, g kb] * sw[(g n) // 128, kb]``
    for quantised x (:func:`fp8_act_quantize`, [T, G * K]) and ``groups`` FP8 weights [G * N, K] with 128 x 128
    block scales. Each block's scaled products are exact in float64 before the sum, which is rounded once."""
    w = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    t = xq.shape[0]
    rows, k = w.shape
    n, kb = rows // groups, k // ACT_BLOCK
    xs = xq.view(torch.float8_e4m3fn).double().view(t, groups, kb, ACT_BLOCK) * sx.double().view(t, groups, kb, 1)
    ws = fp8_block_dequantize(w, scale).double().view(groups, n, k)
    return torch.einsum("tgk,gnk->tgn", xs.view(t, groups, k), ws).reshape(t, groups * n).float()
