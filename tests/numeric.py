"""The numeric comparison the tests share."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error ``||got - want|| / ||want||``, computed in float64 (so that float32 or BF16 inputs
    are compared without a rounding of their own)."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm())
