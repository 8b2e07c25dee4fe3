"""RoPE frequencies: plain for sliding-window layers, YaRN (no mscale) for compressed layers.

YaRN blends interpolated (``/factor``) and original frequencies per pair ``i`` with a linear
ramp between the correction dims ``low = floor(d(beta_fast))`` and ``high = ceil(d(beta_slow))``,
``d(r) = dim * ln(orig / (2 pi r)) / (2 ln theta)``; the V4 reference applies no attention
(mscale) factor to cos/sin.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_freq(rope: RopeConfig) -> torch.Tensor:
    """float32 [rope.dim / 2] inverse frequencies."""
    dim = rope.dim
    base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.factor is None:
        return base

    def corr(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(corr(rope.beta_fast)), 0)
    high = min(math.ceil(corr(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return base / rope.factor * (1 - keep) + base * keep
