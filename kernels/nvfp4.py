"""NVFP4: E2M1 elements, one E4M3 scale per 16 along K, one float32 global scale per tensor.

Dequantisation is ``x = e2m1 * e4m3(sb) * alpha`` (``alpha`` is what ModelOpt calls
``weight_scale_2`` and what format 1 stores as ``*.alpha``).

Quantisation (:func:`quantize_nvfp4`) follows the ModelOpt recipe:

* ``alpha = amax / (6 * 448)`` over the whole tensor (an all-zero tensor gets ``alpha = 1``);
* per 16-block ``sb = e4m3(clamp(block_amax / (6 * alpha), 2**-9, 448))`` rounded to nearest even;
* elements ``q = rne_e2m1(x / (float(sb) * alpha))`` using the *rounded* ``sb``.

Zero-block policy: an all-zero block gets the smallest scale, ``2**-9`` (byte 0x01), through the
clamp, and all-zero codes; no division by zero can occur.

:func:`encode_nvfp4` is the exact inverse of :func:`dequantize_nvfp4` for given scales: it maps
every representable value back to its codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .e2m1 import E2M1_MAX, decode_e2m1_packed, encode_e2m1, pack_nibbles
from .scales import E4M3_MAX, E4M3_MIN_SUBNORMAL, decode_e4m3, encode_e4m3

BLOCK = 16


@dataclass(frozen=True)
class Nvfp4:
    """An NVFP4 matrix: packed codes uint8 [N, K/2], E4M3 scale bytes uint8 [N, K/16] (row-major), alpha."""

    packed: torch.Tensor
    scales: torch.Tensor
    alpha: float


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs K divisible by {BLOCK}, got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def global_scale_for(amax: float) -> float:
    """The global scale ``alpha = amax / (6*448)`` (1.0 for an all-zero tensor), as float32."""
    return float(torch.tensor(amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0, dtype=torch.float32))


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each 16-block: [..., K] -> float32 [..., K/16] (its max is the tensor's amax)."""
    return _blocks(x.float()).abs().amax(dim=-1)


def block_scales_from_amax(amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """E4M3 scale bytes from block amaxes under global scale ``alpha`` (the recipe's clamp and rounding)."""
    return encode_e4m3((amax / (E2M1_MAX * alpha)).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))


def block_scales_for(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """E4M3 scale bytes [..., K/16] for ``x`` [..., K] under global scale ``alpha``."""
    return block_scales_from_amax(block_amax(x), alpha)


# Elements encoded per step: bounds the encoder's temporaries (a few bytes each) to tens of MB
# whatever the matrix size, which keeps the converter's peak memory flat.
ENCODE_CHUNK = 1 << 22


def encode_nvfp4(x: torch.Tensor, scales: torch.Tensor, alpha: float) -> torch.Tensor:
    """Codes for ``x`` [..., K] under given scale bytes [..., K/16] and ``alpha``, packed to [..., K/2]."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    steps = decode_e4m3(scales.reshape(-1, scales.shape[-1])).unsqueeze(-1) * torch.tensor(alpha, dtype=torch.float32)
    out = torch.empty(rows.shape[0], k // 2, dtype=torch.uint8, device=x.device)
    per = max(1, ENCODE_CHUNK // max(k, 1))
    for r in range(0, rows.shape[0], per):
        codes = encode_e2m1(_blocks(rows[r:r + per].float()) / steps[r:r + per])
        out[r:r + per] = pack_nibbles(codes.reshape(-1, k))
    return out.reshape(*x.shape[:-1], k // 2)


def quantize_nvfp4(x: torch.Tensor, alpha: float | None = None) -> Nvfp4:
    """Quantise a float matrix [..., K] to NVFP4 (recipe in the module docstring).

    ``alpha`` may be given to put several tensors on one global scale (fused w1/w3).
    """
    if alpha is None:
        alpha = global_scale_for(float(x.abs().max()) if x.numel() else 0.0)
    scales = block_scales_for(x, alpha)
    return Nvfp4(encode_nvfp4(x, scales, alpha), scales, alpha)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """packed [..., K/2], scale bytes [..., K/16], alpha -> float32 [..., K]."""
    values = _blocks(decode_e2m1_packed(packed))
    out = values * decode_e4m3(scales).unsqueeze(-1)
    alpha = torch.as_tensor(alpha, dtype=torch.float32, device=out.device)
    return (out.flatten(-2) * alpha.reshape(alpha.shape + (1,) * (out.dim() - 1 - alpha.dim())))


@dataclass(frozen=True)
class Reconciled:
    """Block scales of several NVFP4 matrices moved onto one global scale ``alpha``."""

    scales: list[torch.Tensor]
    alpha: float
    changed_blocks: int


def reconcile_global_scales(scales: list[torch.Tensor], alphas: list[float]) -> Reconciled:
    """Put NVFP4 matrices with separate global scales (ModelOpt w1, w3) on ``alpha = max(alphas)``.

    Each matrix's block scales are multiplied by ``alpha_own / alpha`` (<= 1) and re-rounded to
    E4M3, so the effective scale ``sb' * alpha`` approximates ``sb * alpha_own``; codes are kept.
    Exact when the ratio is a power of two and no scale drops below 2**-9. A non-zero scale never
    becomes zero: it is clamped to 2**-9. ``changed_blocks`` counts blocks whose effective scale
    is no longer exactly the source's.
    """
    for a in alphas:
        if not (a > 0 and a < float("inf")):
            raise ValueError(f"global scale must be finite and positive, got {a}")
    alpha = max(alphas)
    out, changed = [], 0
    for s, a in zip(scales, alphas):
        if a == alpha:
            out.append(s)
            continue
        ratio = torch.tensor(a, dtype=torch.float64) / torch.tensor(alpha, dtype=torch.float64)
        want = decode_e4m3(s).double() * ratio
        new = encode_e4m3(torch.where(want > 0, want.clamp(min=E4M3_MIN_SUBNORMAL), want).float())
        changed += int((decode_e4m3(new).double() != want).sum())
        out.append(new)
    return Reconciled(out, alpha, changed)
