"""Hopper row tiles of packed NVFP4 weights (converter ``--target sm90``): a forward/inverse pair.

Format 1 stores packed weights row-major, [..., M, K/2] bytes. The SM90 GEMMs (``sm90_moe_gemm``,
``sm90_moe_wgmma``) give each warp 16 weight rows and read them one 128-K tile (64 bytes a row) at a
time, so one warp load touches 8 rows: 8 half-filled 128-byte lines. Tiled, the 16 rows of a group
lie k-tile by k-tile, ``[..., M/16, K/128, 16, 64]`` (same bytes, same tensor shape), and a warp's
k-tile is 1 KB in a row: each load fills 4 whole lines. On an H200 that made a decode MoE layer
6-9 % faster (``docs/design/moe_kernels.md``). Block scales are not tiled (they keep the 128x4 swizzle).

Each 4-byte word of the tiles also holds its 8 codes in Hopper nibble order (:func:`to_hopper_words`): the same 32
bits, moved so that the kernels decode a word with 8 integer instructions instead of 13
(``e2m1_registers.decode_e2m1x8_hopper``).
"""

from __future__ import annotations

import torch

from .e2m1_registers import hopper_bit_positions

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


_TO_HOPPER = hopper_bit_positions()
_FROM_HOPPER = tuple(sorted(range(32), key=_TO_HOPPER.__getitem__))
_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _half_tables(direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 65536-entry int32 tables: the low / high 16 bits of a word -> their bits at their new places."""
    if direction not in _TABLES:
        positions = _TO_HOPPER if direction == "to" else _FROM_HOPPER
        half = torch.arange(1 << 16, dtype=torch.int64)
        tables = []
        for base in (0, 16):
            t = torch.zeros(1 << 16, dtype=torch.int64)
            for s in range(16):
                t |= ((half >> s) & 1) << positions[base + s]
            tables.append(t.to(torch.int32))  # two's complement: bit 31 as the sign
        _TABLES[direction] = (tables[0], tables[1])
    return _TABLES[direction]


def _move_bits(w: torch.Tensor, direction: str) -> torch.Tensor:
    # two table lookups per word (int32 indices: no int64 copy of the tensor), against ~10 shift-and-mask passes:
    # 22 MB in 17 ms on a 2-vCPU machine, twice as fast as indexing with int64
    if w.dtype != torch.uint8 or w.shape[-1] % 4:
        raise ValueError(f"packed E2M1 words need uint8 [..., 4n], got {w.dtype} {tuple(w.shape)}")
    x = w.contiguous().view(torch.int32).reshape(-1)  # little-endian: byte 0 = bits 0..7
    lo, hi = (t.to(w.device) for t in _half_tables(direction))
    words = torch.index_select(lo, 0, x & 0xFFFF)
    words |= torch.index_select(hi, 0, (x >> 16) & 0xFFFF)
    return words.view(torch.uint8).reshape(w.shape)


def to_hopper_words(w: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., 4n] -> the same codes in Hopper nibble order, word by word (4 bytes, little-endian)."""
    return _move_bits(w, "to")


def from_hopper_words(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_hopper_words`."""
    return _move_bits(w, "from")


def tile_rows(w: torch.Tensor) -> torch.Tensor:
    """Row-major packed weights [..., M, K/2] -> the same codes in row tiles of Hopper-order words (same shape and
    dtype)."""
    groups, tiles = _check(w)
    lead = w.shape[:-2]
    t = to_hopper_words(w).reshape(*lead, groups, ROWS, tiles, TILE_BYTES).transpose(-3, -2)
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
    return from_hopper_words(t.contiguous().reshape(w.shape))
