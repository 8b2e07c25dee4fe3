"""Hopper row tiles of packed NVFP4 weights (converter ``--target sm90``): a forward/inverse pair.

Format 1 stores packed weights row-major, [..., M, K/2] bytes. The SM90 GEMMs (``sm90_moe_gemm``,
``sm90_moe_wgmma``) give each warp 16 weight rows and read them one 128-K tile (64 bytes a row) at a
time, so one warp load touches 8 rows: 8 half-filled 128-byte lines. Tiled, the 16 rows of a group
lie k-tile by k-tile, ``[..., M/16, K/128, 16, 64]`` (same bytes, same tensor shape), and a warp's
k-tile is 1 KB in a row: each load fills 4 whole lines. On an H200 that made a decode MoE layer
6-9 % faster (``docs/benchmarks.md``). Block scales are not tiled (they keep the 128x4 swizzle).
"""

from __future__ import annotations

import torch

ROWS = 16        # weight rows per warp
TILE_BYTES = 64  # bytes of one row's 128-K tile (two E2M1 codes a byte)


def tileable(rows: int, row_bytes: int) -> bool:
    """Whether packed weights of ``rows`` rows of ``row_bytes`` bytes (K/2) divide into row tiles."""
    return rows % ROWS == 0 and row_bytes % TILE_BYTES == 0


def _check(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() < 2 or not tileable(w.shape[-2], w.shape[-1]):
        raise ValueError(f"row tiles need packed weights [..., M, K/2] with M % {ROWS} == 0 and "
                         f"K/2 % {TILE_BYTES} == 0, got shape {tuple(w.shape)}")
    return w.shape[-2] // ROWS, w.shape[-1] // TILE_BYTES


def tile_rows(w: torch.Tensor) -> torch.Tensor:
    """Row-major packed weights [..., M, K/2] -> the same bytes in row tiles (same shape and dtype)."""
    groups, tiles = _check(w)
    lead = w.shape[:-2]
    t = w.reshape(*lead, groups, ROWS, tiles, TILE_BYTES).transpose(-3, -2)
    return t.contiguous().reshape(w.shape)


def tile_expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A routed-expert weight dict (``w13``, ``w2``, their scales and alphas) with ``w13`` and ``w2`` in row tiles, as a
    ``--target sm90`` conversion stores them; the other entries are the same tensors."""
    return {**weights, "w13": tile_rows(weights["w13"]), "w2": tile_rows(weights["w2"])}


def untile_rows(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tile_rows`."""
    groups, tiles = _check(w)
    lead = w.shape[:-2]
    t = w.reshape(*lead, groups, tiles, ROWS, TILE_BYTES).transpose(-3, -2)
    return t.contiguous().reshape(w.shape)
