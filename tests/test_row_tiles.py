"""Hopper row tiles (``kernels/row_tiles.py``): the forward/inverse pair, and where each byte goes."""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.e2m1_registers import (HOPPER_REST, HOPPER_REST_COPIES, MASK, decode_e2m1x8,
                                                  decode_e2m1x8_hopper, hopper_bit_positions)
from nvfp4_megamoe.kernels.row_tiles import (ROWS, TILE_BYTES, from_hopper_words, tile_rows, to_hopper_words,
                                             untile_rows)
from nvfp4_megamoe.runtime.format import ROW_TILES_STEP, ROW_TILES_STEP_V0, FormatError, has_row_tiles


def test_round_trip_and_byte_positions():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (3, 48, 384), dtype=torch.uint8, generator=gen)  # [E, M, K/2]
    t = tile_rows(w)
    assert t.shape == w.shape and t.dtype == w.dtype and untile_rows(t).equal(w) and not t.equal(w)
    flat = from_hopper_words(t.reshape(3, -1))  # words back in format-1 order, still in tiled places
    tiles_per_row = w.shape[-1] // TILE_BYTES
    for e, r, b in ((0, 0, 0), (1, 5, 63), (2, 17, 64), (2, 47, 383), (0, 31, 200)):
        # the kernels' address of row r, byte b: (group, k-tile) block of 1 KB, then row in group, byte in tile
        at = ((r // ROWS) * tiles_per_row + b // TILE_BYTES) * ROWS * TILE_BYTES + (r % ROWS) * TILE_BYTES + b % TILE_BYTES
        assert flat[e, at] == w[e, r, b]
    assert untile_rows(tile_rows(w[0])).equal(w[0])  # one matrix (a dense linear's shape) too
    # the manifest's name of the step
    assert ROW_TILES_STEP == f"row_tiles({ROWS} rows x {TILE_BYTES} bytes, hopper nibble order)"


def test_hopper_words_decode_as_the_words_they_came_from():
    """The kernels' decode of a Hopper-order word (run on int64 tensors, the operators the kernels trace) gives the
    BF16x2 words the format-1 decode gives for the original, on random words and every code in every nibble."""
    gen = torch.Generator().manual_seed(1)
    words = torch.cat([torch.randint(0, 1 << 32, (1 << 16,), generator=gen, dtype=torch.int64),
                       torch.tensor([0x11111111 * c for c in range(16)])])
    packed = words.to(torch.int32).view(torch.uint8)  # little-endian bytes of each word
    moved = to_hopper_words(packed).view(torch.int32).long() & 0xFFFFFFFF
    assert not torch.equal(moved, words) and from_hopper_words(to_hopper_words(packed)).equal(packed)
    for got, want in zip(decode_e2m1x8_hopper(moved), decode_e2m1x8(words)):
        assert torch.equal(got & 0xFFFFFFFF, want & 0xFFFFFFFF)
    # the permutation docs/format.md specifies (a change of the decode is a change of the format)
    assert hopper_bit_positions() == (6, 7, 8, 15, 9, 10, 11, 18, 12, 13, 14, 21, 4, 0, 1, 3, 22, 23, 24, 31, 25, 26,
                                      27, 2, 28, 29, 30, 5, 20, 16, 17, 19)
    # the last word: each bit of REST reaches MASK through exactly one of the three copies, with no carry into MASK
    rest = [b for b in range(32) if HOPPER_REST >> b & 1]
    for pattern in range(1 << len(rest)):
        x = sum(1 << b for i, b in enumerate(rest) if pattern >> i & 1)
        landed = [(1 << b) * HOPPER_REST_COPIES & MASK for i, b in enumerate(rest) if pattern >> i & 1]
        assert all(bin(v).count("1") == 1 for v in landed)
        assert (x * HOPPER_REST_COPIES) & MASK == sum(landed)


def test_the_first_row_tile_layout_is_refused():
    manifest = {"tensors": {"w": {"transform": ["nvfp4", ROW_TILES_STEP_V0]}, "v": {"transform": [ROW_TILES_STEP]}}}
    assert has_row_tiles(manifest, "v") and not has_row_tiles(manifest, "x")
    with pytest.raises(FormatError, match="re-convert"):
        has_row_tiles(manifest, "w")


@pytest.mark.parametrize("shape", [(24, 128), (32, 96), (64,)])
def test_shapes_that_do_not_tile_are_refused(shape):
    with pytest.raises(ValueError, match="row tiles need"):
        tile_rows(torch.zeros(shape, dtype=torch.uint8))
