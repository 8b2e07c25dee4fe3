"""E2M1 codes to BF16 bits in registers with integer operators: the SM90 kernels' decode, in both word layouts.

A code s|e1 e0 m placed as BF16 bits ``s<<15 | (e1 e0 m)<<6`` reads as ``value * 2**-126`` for every code, the
subnormal 0.5 included (exponent field e, top mantissa bit m). So the 8 codes of a 32-bit weight word become 4
BF16x2 words R_j, j = 0..3, each two codes with their bits under ``MASK``. The kernels multiply each R_j by its
block scale decoded as ``sb * 2**DECODE_BIAS`` (one BF16 multiply, exact: <= 6 significant bits) and the epilogue
by ``alpha * 2**(126 - DECODE_BIAS)``. DECODE_BIAS = 118 keeps every value a normal BF16 (smallest
0.5 * 2**-9 * 2**-8) and ``448 * 2**118`` below the BF16 maximum.

* :func:`decode_e2m1x8`: format 1's word (codes v0..v7, v0 lowest); R_j = (v_j, v_{j+4}).
* :func:`decode_e2m1x8_hopper`: a word in Hopper nibble order (``row_tiles``, converter ``--target sm90``): the
  same codes with their 32 bits permuted (:func:`hopper_bit_positions`) so that R_j costs 8 integer
  instructions per word instead of 13.

Plain integer operators only (and a rotation passed in), so the same functions trace into the kernels (``Int32``)
and run on Python ints and torch integer tensors (the converter, the CPU tests).
"""

from __future__ import annotations

from typing import Callable

DECODE_BIAS = 118
EPILOGUE_LOG2 = 126 - DECODE_BIAS
MASK = 0x81C081C0  # two BF16 halves: sign bit 15 / 31, e1 e0 m at bits 8..6 / 24..22
_MASK_I32 = MASK - (1 << 32)  # the same bits as a negative 32-bit constant (``Int32`` operands)

# Hopper nibble order: R_0 = w & MASK, R_1 = rotr(w, 3) & MASK, R_2 = rotr(w, 6) & MASK, and the 8 bits left,
# REST, reach MASK as three copies (times 2**2 + 2**7 + 2**12) of which exactly one lands each bit under MASK, with
# no carry into it (checked for all 256 patterns of REST, tests/test_row_tiles.py)
HOPPER_ROTATIONS = (3, 6)
HOPPER_REST = 0x001B001B
HOPPER_REST_COPIES = (1 << 2) + (1 << 7) + (1 << 12)


def decode_e2m1x8(w):
    """8 E2M1 nibbles (v0 lowest) -> ``(v_j, v_{j+4}) * 2**-126`` as BF16x2 words, j = 0..3."""
    # Nibbles j and j + 4 alone (mask), times 2**a + 2**(a + 6): two copies of each nibble, one with its
    # magnitude at bits 6..8 (22..24), one with its sign at bit 15 (31); the copies share no bit, so the
    # product is their OR; a last mask keeps those bits. Nibbles 2, 3 come from the word shifted by 8.
    # Three instructions per word out instead of four shift/mask ones, and the multiply runs on the FMA
    # pipe, off the integer pipe the masks use (H200: 5-11 % faster from T = 16 on, docs/design/moe_kernels.md).
    out = []
    for j in range(4):
        src = w if j < 2 else w >> 8
        n = src & (0x000F000F << (4 * (j % 2)))
        copies = (1 << (6 - 4 * (j % 2))) + (1 << (12 - 4 * (j % 2)))
        out.append((n * copies) & _MASK_I32)
    return tuple(out)


def rotr_u32(w, n: int):
    """``w`` (a Python int or int64 tensor holding 32 bits) rotated right by ``n``."""
    return ((w >> n) | (w << (32 - n))) & 0xFFFFFFFF


def decode_e2m1x8_hopper(w, rotr: Callable = rotr_u32):
    """A word in Hopper nibble order -> the 4 BF16x2 words :func:`decode_e2m1x8` gives for the format-1 word it
    came from. ``rotr(w, n)``: w rotated right by n bits (the kernels pass ``shf.r.wrap``)."""
    a, b = HOPPER_ROTATIONS
    # R_3 first: in this order ptxas gave the direct two-row-tile L2 (V4-Pro T = 1) 146 registers (3 CTAs per SM),
    # in the order R_0..R_3 180 (2 CTAs)
    r3 = ((w & HOPPER_REST) * HOPPER_REST_COPIES) & _MASK_I32
    return (w & _MASK_I32, rotr(w, a) & _MASK_I32, rotr(w, b) & _MASK_I32, r3)


def _outputs(words: tuple) -> tuple[int, ...]:
    return tuple(r & 0xFFFFFFFF for r in words)


def hopper_bit_positions() -> tuple[int, ...]:
    """For each bit s of a format-1 word, the bit of its Hopper-order word that holds it: the permutation under
    which :func:`decode_e2m1x8_hopper` of the moved word equals :func:`decode_e2m1x8` of the original (both are
    bit-for-bit maps, so single bits decide)."""
    hopper = {_outputs(decode_e2m1x8_hopper(1 << d)): d for d in range(32)}
    return tuple(hopper[_outputs(decode_e2m1x8(1 << s))] for s in range(32))
