"""The numeric comparison the tests share."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error ``||got - want|| / ||want||``, computed in float64 (so that float32 or BF16 inputs
    are compared without a rounding of their own)."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm())


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """BF16 values' distance in units in the last place, elementwise (int32; +0 and -0 are 0 apart): the bit patterns
    mapped to integers that order as the values do."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.to(torch.bfloat16).contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)
    return (ordered(got) - ordered(want)).abs()
