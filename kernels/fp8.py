"""FP8 E4M3 weights with 128x128 block scales (E8M0 bytes in the official releases, F32 in -Base).

Dequantisation: ``W[i, j] = fp8[i, j] * scale[i // 128, j // 128]``. :func:`fp8_block_quantize`
is its exact inverse for given scales (it recovers the FP8 bytes from the dequantised values).
"""

from __future__ import annotations

import torch

from .scales import decode_e8m0

FP8_BLOCK = 128


def block_scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor (float8_e8m0fnu / uint8 E8M0 bytes, or float32) -> float32 values."""
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return decode_e8m0(scale)
    raise TypeError(f"FP8 block scales must be E8M0 or F32, got {scale.dtype}")


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    rows, cols = shape
    s = scale.repeat_interleave(FP8_BLOCK, dim=0).repeat_interleave(FP8_BLOCK, dim=1)
    return s[:rows, :cols]


def _check(shape: torch.Size, scale: torch.Tensor) -> None:
    want = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 weight {tuple(shape)} needs block scales of shape {want}, got {tuple(scale.shape)}")


def fp8_block_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 weight [out, in] (float8_e4m3fn or its uint8 bytes) and block scales -> float32."""
    w = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    _check(w.shape, scale)
    rows, cols = w.shape
    values = block_scale_values(scale)
    if rows % FP8_BLOCK or cols % FP8_BLOCK:
        return w.float() * _expand(values, w.shape)
    # Whole blocks: broadcast each scale over its 128x128 tile instead of materialising them all.
    tiles = w.float().view(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    return tiles.mul_(values[:, None, :, None]).view(rows, cols)


def fp8_block_quantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_block_dequantize` for given scales: float32 [out, in] -> float8_e4m3fn."""
    _check(values.shape, scale)
    return (values / _expand(block_scale_values(scale), values.shape)).to(torch.float8_e4m3fn)
