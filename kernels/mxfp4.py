"""MXFP4 (E2M1 elements, one E8M0 scale per 32 along K) and its closed-form cast to NVFP4.

Dequantisation: ``x = e2m1 * 2**(e8m0 - 127)``.

The cast (ModelOpt ``--cast_mxfp4_to_nvfp4``) keeps every nibble and moves the power-of-two
scales onto one global scale shared by all the matrices given (w1 and w3 of an expert, so the
fused w13 has one ``alpha``): over the non-zero 32-blocks, ``k = e8m0 - 127``, ``k_max = max k``,
``m = k_max - 8``, ``alpha = 2**m`` and each 16-block gets ``sb = 2**(k - m)``. E4M3 holds
``2**j`` exactly for ``j`` in [-9, 8], so the cast is exact whenever ``k_max - k <= 17``.

Policies (documented in docs/format.md):

* **all-zero 32-block**: its value is zero whatever the scale; it gets ``2**clamp(k - m, -9, 8)``
  and is not counted as a fallback.
* **out-of-range block** (non-zero, ``k < k_max - 17``): the scale is the smallest, ``2**-9``,
  and the codes are re-rounded (RNE) to that coarser step. This is lossy; such blocks are
  counted and the counts reported.
* **all-zero matrix set**: ``alpha = 1`` (``m = 0``).

The cast runs on the device its inputs are on, with the same bytes everywhere: it is integer work (masks,
maxima, table gathers) apart from the re-rounding of out-of-range blocks, whose float work is exact (codes
times powers of two built from their bits, then comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .e2m1 import decode_e2m1, decode_e2m1_packed, encode_e2m1, pack_nibbles, unpack_nibbles
from .scales import E8M0_NAN, decode_e8m0, e8m0_exponent, pow2_e4m3

MX_BLOCK = 32
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8
REQUANT_SHIFT_MIN = -32


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed int8/uint8 [..., K/2], E8M0 bytes [..., K/32] -> float32 [..., K]."""
    values = decode_e2m1_packed(packed)
    values = values.reshape(*values.shape[:-1], -1, MX_BLOCK) * decode_e8m0(scales).unsqueeze(-1)
    return values.flatten(-2)


@dataclass(frozen=True)
class CastResult:
    """Outcome of :func:`mxfp4_to_nvfp4`: one (packed, nvfp4 scales) per input, the shared alpha, fallbacks."""

    packed: list[torch.Tensor]
    scales: list[torch.Tensor]
    alpha: float
    fallback_blocks: int


# Magnitude bits of the 16 codes in 8 packed bytes (sign bits 0x8 of each nibble cleared).
_MAGNITUDE_BITS = 0x7777777777777777


def _block_words(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed -> int64 [..., K/32, 2]: each 32-block's 16 bytes as two words."""
    return packed.view(torch.uint8).contiguous().view(torch.int64).reshape(*packed.shape[:-1], -1, 2)


def nonzero_blocks(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed -> bool [..., K/32]: does the 32-block hold a non-zero value?

    A code is zero when its magnitude bits are 0 (+0 or -0), so a block is zero exactly when its
    16 bytes, read as two 64-bit words, OR-ed and masked with 0x77..77, are zero.
    """
    words = _block_words(packed)
    return ((words[..., 0] | words[..., 1]) & _MAGNITUDE_BITS) != 0


def shared_exponent(scales: list[torch.Tensor], packed: list[torch.Tensor]) -> int:
    """``m = k_max - 8`` over the non-zero 32-blocks of all the matrices (0 if all are zero).

    The first block holding a matrix's largest scale byte is looked at first: if it is non-zero that
    byte is the matrix's maximum, and the pass over all its codes (half a cast's time) is skipped.
    """
    k_max = None
    for s, p in zip(scales, packed):
        b = s.view(torch.uint8).reshape(-1)
        if not b.numel():
            continue
        i = int(b.argmax())
        top = int(b[i])
        if top == E8M0_NAN:
            raise ValueError("E8M0 scale byte 0xFF (NaN) cannot be cast")
        w = _block_words(p).reshape(-1, 2)[i]
        if not int((w[0] | w[1]) & _MAGNITUDE_BITS):
            nz = nonzero_blocks(p).reshape(-1)
            if not bool(nz.any()):
                continue
            top = int((b * nz).max())  # E8M0 bytes order like their exponents; zero blocks count as byte 0
        k_max = top - 127 if k_max is None else max(k_max, top - 127)
    return 0 if k_max is None else k_max - E4M3_POW2_MAX


# E4M3 bytes of 2**j, j from E4M3_POW2_MIN to E4M3_POW2_MAX.
_POW2_E4M3 = pow2_e4m3(torch.arange(E4M3_POW2_MIN, E4M3_POW2_MAX + 1))


def _scale_pairs(m: int) -> torch.Tensor:
    """int16 [256]: E8M0 byte (k = byte - 127) -> the E4M3 byte of 2**clamp(k - m, -9, 8), twice (one per 16-block)."""
    rel = (torch.arange(256) - 127 - m).clamp(E4M3_POW2_MIN, E4M3_POW2_MAX) - E4M3_POW2_MIN
    b = _POW2_E4M3[rel].to(torch.int16)
    return b | (b << 8)


def mxfp4_to_nvfp4(packed: list[torch.Tensor], scales: list[torch.Tensor]) -> CastResult:
    """Cast MXFP4 matrices (e.g. [w1, w3]) onto one NVFP4 global scale; see the module docstring."""
    m = shared_exponent(scales, packed)
    pairs = _scale_pairs(m)
    out_packed, out_scales, fallbacks = [], [], 0
    for p, s in zip(packed, scales):
        p, b = p.view(torch.uint8), s.view(torch.uint8)
        # Each E8M0 byte becomes its two 16-block scale bytes by one int16 lookup.
        sb = pairs.to(b.device).index_select(0, b.reshape(-1).int()).view(torch.uint8)
        sb = sb.reshape(*b.shape[:-1], 2 * b.shape[-1])
        if b.numel() and int(b.min()) - 127 - m < E4M3_POW2_MIN:  # out-of-range blocks possible: find them
            rel = e8m0_exponent(b) - m
            out_of_range = (rel < E4M3_POW2_MIN) & nonzero_blocks(p)  # zero blocks stay exact
            if out_of_range.any():
                fallbacks += int(out_of_range.sum())
                p = requantize_blocks(p, rel, out_of_range)
        out_packed.append(p)
        out_scales.append(sb)
    alpha = float(torch.ldexp(torch.tensor(1.0), torch.tensor(m)))
    return CastResult(out_packed, out_scales, alpha, fallbacks)


def requantize_blocks(packed: torch.Tensor, rel: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Re-round the codes of masked 32-blocks from step 2**rel to step 2**-9 (relative to alpha)."""
    codes = unpack_nibbles(packed)
    blocks = codes.reshape(*codes.shape[:-1], -1, MX_BLOCK)
    # From a shift of -5 on every code rounds to (signed) zero (6 * 2**-5 < 0.25), so the clamp changes nothing; the
    # powers of two are built from their bits, so the products are exact on any device.
    shift = (rel - E4M3_POW2_MIN).clamp(REQUANT_SHIFT_MIN, 0)
    requant = encode_e2m1(decode_e2m1(blocks) * decode_e8m0((shift + 127).to(torch.uint8)).unsqueeze(-1))
    blocks = torch.where(mask.unsqueeze(-1), requant, blocks)
    return pack_nibbles(blocks.reshape(codes.shape))
