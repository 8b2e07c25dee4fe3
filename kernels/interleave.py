"""Gate/up row interleave at granularity 8 for the fused L1 (w13) GEMM.

Fused rows are ``[gate 0..7, up 0..7, gate 8..15, up 8..15, ...]`` (gate first). On Hopper a
WGMMA thread holds accumulator rows r and r+8, so with weights as the M operand each thread
owns a matching (gate, up) pair and SwiGLU stays in registers. Scale rows follow their weight
rows, so the same transform applies to the [I, K/16] scale matrices before swizzling.
"""

from __future__ import annotations

import torch

GRANULARITY = 8


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, granularity: int = GRANULARITY) -> torch.Tensor:
    """gate [I, ...], up [I, ...] -> fused [2I, ...] with rows interleaved in groups of ``granularity``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    rows = gate.shape[0]
    if rows % granularity:
        raise ValueError(f"interleave needs rows divisible by {granularity}, got {rows}")
    rest = gate.shape[1:]
    g = gate.reshape(rows // granularity, 1, granularity, *rest)
    u = up.reshape(rows // granularity, 1, granularity, *rest)
    return torch.cat((g, u), dim=1).reshape(2 * rows, *rest)


def deinterleave_gate_up(fused: torch.Tensor, granularity: int = GRANULARITY) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_gate_up`: fused [2I, ...] -> (gate [I, ...], up [I, ...])."""
    rows2 = fused.shape[0]
    if rows2 % (2 * granularity):
        raise ValueError(f"deinterleave needs rows divisible by {2 * granularity}, got {rows2}")
    rest = fused.shape[1:]
    pairs = fused.reshape(rows2 // (2 * granularity), 2, granularity, *rest)
    return pairs[:, 0].reshape(rows2 // 2, *rest), pairs[:, 1].reshape(rows2 // 2, *rest)
