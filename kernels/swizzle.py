"""The 128x4 block-scale swizzle that Blackwell block-scaled MMA reads (and the Hopper kernels here too).

Scales of an [M, K] NVFP4 matrix form an [M, Kb] byte matrix (Kb = K/16). Rows are padded to a
multiple of 128 and scale columns to a multiple of 4, with zero bytes. Row m, scale column kb
lands at

    offset = ((m // 128) * ceil(Kb/4) + kb // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + kb % 4

so a 128-row x 64-K weight tile finds all 512 of its scales in one contiguous atom (CUTLASS
``Sm1xxBlockScaledConfig``, torchao ``to_blocked``, torch ``SWIZZLE_32_4_4``).
"""

from __future__ import annotations

import torch

ROW_ATOM = 128
COL_ATOM = 4


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded (rows, scale columns) of the swizzled layout."""
    return _ceil_to(rows, ROW_ATOM), _ceil_to(scale_cols, COL_ATOM)


def swizzled_nbytes(rows: int, scale_cols: int) -> int:
    """Bytes the swizzled scales of an [rows, scale_cols] scale matrix occupy."""
    r, c = swizzled_shape(rows, scale_cols)
    return r * c


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """[M, Kb] uint8 scale bytes -> flat uint8 [swizzled_nbytes(M, Kb)] (zero padding)."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_block_scales expects [M, Kb], got shape {tuple(scales.shape)}")
    m, kb = scales.shape
    mp, kbp = swizzled_shape(m, kb)
    if (mp, kbp) == (m, kb) and scales.is_contiguous() and scales.storage_offset() % 4 == 0:
        padded = scales
    else:
        padded = torch.zeros((mp, kbp), dtype=scales.dtype, device=scales.device)
        padded[:m, :kb] = scales
    # (row block, row//32 % 4, row % 32, col block, col % 4) -> (row block, col block, row%32, row//32%4, col%4);
    # the 4 bytes of a row's column group move together, so they move as one int32.
    tiles = padded.view(torch.int32).view(mp // ROW_ATOM, 4, 32, kbp // COL_ATOM)
    return tiles.permute(0, 3, 2, 1).reshape(-1).view(scales.dtype)


def unswizzle_block_scales(flat: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_block_scales`: flat bytes -> [rows, scale_cols] (padding dropped)."""
    mp, kbp = swizzled_shape(rows, scale_cols)
    if flat.numel() != mp * kbp:
        raise ValueError(f"swizzled scales of [{rows}, {scale_cols}] hold {mp * kbp} bytes, got {flat.numel()}")
    tiles = flat.reshape(mp // ROW_ATOM, kbp // COL_ATOM, 32, 4, COL_ATOM)
    return tiles.permute(0, 3, 2, 1, 4).reshape(mp, kbp)[:rows, :scale_cols]


def swizzle_padding(flat: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """The padding bytes of a swizzled scale block (all must be zero in a well-formed file)."""
    mp, kbp = swizzled_shape(rows, scale_cols)
    full = flat.reshape(mp // ROW_ATOM, kbp // COL_ATOM, 32, 4, COL_ATOM).permute(0, 3, 2, 1, 4).reshape(mp, kbp)
    return torch.cat((full[rows:, :].reshape(-1), full[:rows, scale_cols:].reshape(-1)))


def swizzled_row_slice(flat: torch.Tensor, rows: int, scale_cols: int, start: int, stop: int) -> torch.Tensor:
    """The swizzled scales of rows [start, stop) of an [rows, scale_cols] matrix, as a view of ``flat``.

    Each 128-row block is one contiguous run of atoms, so a slice on 128-row boundaries (``stop`` may
    also be ``rows``) is itself a well-formed swizzled block: ``swizzle(S[start:stop])``."""
    if start % ROW_ATOM or not (stop % ROW_ATOM == 0 or stop == rows) or not 0 <= start < stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) of {rows} do not fall on {ROW_ATOM}-row swizzle blocks")
    block = ROW_ATOM * _ceil_to(scale_cols, COL_ATOM)
    return flat.reshape(-1)[start // ROW_ATOM * block: _ceil_to(stop, ROW_ATOM) // ROW_ATOM * block]
