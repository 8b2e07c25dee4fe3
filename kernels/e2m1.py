"""E2M1 (FP4) codes: encode with round-to-nearest-even, decode, and nibble packing.

A code is 4 bits: bit 3 is the sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
Two codes share a byte with the **low nibble holding the even element** (DeepSeek, ModelOpt and
compressed-tensors agree). Negative zero (code 0x8) occurs in real checkpoints; packing and
unpacking preserve every code bit for bit.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Thresholds between consecutive magnitudes. Ties go to the even code, so the comparison is
# strict (>) where the upper code is odd and inclusive (>=) where it is even.
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_UPPER_IS_EVEN = (False, True, False, True, False, True, False)


def _threshold_tables() -> tuple[torch.Tensor, torch.Tensor]:
    # Every threshold is a multiple of 1/4, so with t = 4|x| (exact): t >= 4*th <=> floor(t) >= 4*th
    # and t > 4*th <=> ceil(t) > 4*th. The code is the number of thresholds passed: inclusive ones
    # counted from floor(t), strict ones from ceil(t), each by a 32-entry table (t clamped to 31).
    k = torch.arange(32)
    inclusive = sum((k >= 4 * th).to(torch.uint8) for th, even in zip(_THRESHOLDS, _UPPER_IS_EVEN) if even)
    strict = sum((k > 4 * th).to(torch.uint8) for th, even in zip(_THRESHOLDS, _UPPER_IS_EVEN) if not even)
    return inclusive.to(torch.uint8), strict.to(torch.uint8)


_BY_FLOOR, _BY_CEIL = _threshold_tables()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., 2n] (values 0..15) into bytes [..., n]; element 2i goes to the low nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: bytes [..., n] (uint8 or int8) -> codes [..., 2n] uint8."""
    packed = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles expects uint8/int8 bytes, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module's constant table on ``device``, copied there once: a copy from host memory per call
    would make every decode wait for the GPU."""
    if table.device == device:
        return table
    key = (id(table), device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = table.to(device)
    return _ON_DEVICE[key]


_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32 values (code 0x8 decodes to -0.0)."""
    return _on(_VALUES, codes.device)[codes.long()]


_BYTE_TABLE = torch.stack((_VALUES.repeat(16), _VALUES.repeat_interleave(16)), dim=1)  # byte -> (low, high)


def decode_e2m1_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., n] (uint8/int8) -> float32 values [..., 2n], same as decode(unpack(packed)).

    One lookup per byte in a 256-entry table of (low, high) pairs: half the indices and no
    unpacked code tensor.
    """
    flat = packed.reshape(-1).view(torch.uint8).int()
    table = _on(_BYTE_TABLE, packed.device)
    return table.index_select(0, flat).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> E2M1 codes, round to nearest with ties to the even code, saturating at +-6.

    The sign bit follows ``signbit(x)``, so negative values that round to zero give -0 (0x8),
    as the hardware conversion does. ``x`` must be finite.
    """
    t = x.float().abs().mul_(4).clamp_(max=31).reshape(-1)
    lo = t.to(torch.int32)  # floor, t >= 0
    hi = t.ceil_().to(torch.int32)
    by_floor, by_ceil = _on(_BY_FLOOR, x.device), _on(_BY_CEIL, x.device)
    code = by_floor.index_select(0, lo).add_(by_ceil.index_select(0, hi)).reshape(x.shape)
    return code.bitwise_or_(torch.signbit(x).to(torch.uint8).bitwise_left_shift_(3))
