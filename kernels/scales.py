"""Scale codecs: E4M3 (fn) block scales and E8M0 power-of-two scales, as raw bytes.

Scales travel as uint8 bytes everywhere in this project so that bytes, not float conversions,
are what gets copied, swizzled and compared. E4M3 has no Inf and saturates at 448; casting a
value >= 480 would give NaN (0x7F), so :func:`encode_e4m3` clamps first. E8M0 is 2**(byte-127)
with 0xFF meaning NaN.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E8M0_NAN = 0xFF
E4M3_NAN_BYTES = (0x7F, 0xFF)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> E4M3 bytes (uint8), round to nearest even, clamped to +-448 (never NaN for finite x)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(b: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> float32."""
    if b.dtype == torch.float8_e4m3fn:
        return b.float()
    return b.view(torch.float8_e4m3fn).float()


def decode_e8m0(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 2**(b-127), exactly; 0xFF -> NaN.

    Built from bits so no library rounding is involved: byte b >= 1 is the float32 with biased
    exponent b; byte 0 (2**-127) is the float32 subnormal 0x00400000.
    """
    b = b.view(torch.uint8).to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == E8M0_NAN, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_exponent(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> int32 exponents k with value 2**k (NaN bytes must be rejected by the caller)."""
    return b.view(torch.uint8).to(torch.int32) - 127


def encode_e8m0(k: torch.Tensor) -> torch.Tensor:
    """int exponents k in [-127, 127] -> E8M0 bytes; the inverse of :func:`e8m0_exponent`."""
    if k.numel() and (int(k.min()) < -127 or int(k.max()) > 127):
        raise ValueError("E8M0 exponents must lie in [-127, 127]")
    return (k.to(torch.int32) + 127).to(torch.uint8)


def pow2_e4m3(k: torch.Tensor) -> torch.Tensor:
    """int exponents k in [-9, 8] -> E4M3 bytes of exactly 2**k (E4M3 holds every such power)."""
    if k.numel() and (int(k.min()) < -9 or int(k.max()) > 8):
        raise ValueError("E4M3 holds 2**k exactly only for k in [-9, 8]")
    return encode_e4m3(torch.ldexp(torch.ones(k.shape), k.to(torch.int32).cpu()).to(k.device))
