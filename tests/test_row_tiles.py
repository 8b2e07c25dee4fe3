"""Hopper row tiles (``kernels/row_tiles.py``): the forward/inverse pair, and where each byte goes."""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.row_tiles import ROWS, TILE_BYTES, tile_rows, untile_rows
from nvfp4_megamoe.runtime.format import ROW_TILES_STEP


def test_round_trip_and_byte_positions():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (3, 48, 384), dtype=torch.uint8, generator=gen)  # [E, M, K/2]
    t = tile_rows(w)
    assert t.shape == w.shape and t.dtype == w.dtype and untile_rows(t).equal(w) and not t.equal(w)
    flat = t.reshape(3, -1)
    tiles_per_row = w.shape[-1] // TILE_BYTES
    for e, r, b in ((0, 0, 0), (1, 5, 63), (2, 17, 64), (2, 47, 383), (0, 31, 200)):
        # the kernels' address of row r, byte b: (group, k-tile) block of 1 KB, then row in group, byte in tile
        at = ((r // ROWS) * tiles_per_row + b // TILE_BYTES) * ROWS * TILE_BYTES + (r % ROWS) * TILE_BYTES + b % TILE_BYTES
        assert flat[e, at] == w[e, r, b]
    assert untile_rows(tile_rows(w[0])).equal(w[0])  # one matrix (a dense linear's shape) too
    assert ROW_TILES_STEP == f"row_tiles({ROWS} rows x {TILE_BYTES} bytes)"  # the manifest's name of the step


@pytest.mark.parametrize("shape", [(24, 128), (32, 96), (64,)])
def test_shapes_that_do_not_tile_are_refused(shape):
    with pytest.raises(ValueError, match="row tiles need"):
        tile_rows(torch.zeros(shape, dtype=torch.uint8))
