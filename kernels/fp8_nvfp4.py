"""FP8 (E4M3, 128x128 block scales) requantised to NVFP4: the float recipe, and exact lookup tables.

The recipe (:func:`fp8_to_nvfp4_reference`, the oracle) dequantises with the block scales
(:func:`~.fp8.fp8_block_dequantize`) and quantises with :mod:`.nvfp4`: ``alpha = amax / (6*448)``
over a part, or over all parts when they share one global scale; per 16-block
``sb = e4m3(clamp(block_amax / (6*alpha), 2**-9, 448))``; codes ``rne_e2m1(x / (sb*alpha))``.

The tables (:func:`fp8_to_nvfp4_tables`) give the same bytes from integer work on the FP8 bytes.
With E8M0 block scales (the official releases) an element's value is ``fp8(b) * 2**k`` for its
byte ``b`` and its tile's exponent ``k``; ``b & 0x7F`` orders E4M3 magnitudes and rounding is
monotone, so a 16-block's amax is ``fp8(m) * 2**k`` with ``m`` the block's largest magnitude byte.
Given alpha, a block's scale then depends only on ``(k, m)`` and each code on ``(k, m, b)``. The
recipe itself is run once on every ``(k, m)`` present (a "combo") and every byte, which gives a
table of packed output bytes indexed by (combo, two adjacent FP8 bytes read as one int16); the
matrix is then a gather. The error statistics come from the same tables: elements with equal
``(k, m, b)`` have equal source and NVFP4 values, so a histogram of ``(combo, b)`` is an exact
summary (:class:`ValueHistogram`).

:func:`fp8_to_nvfp4` takes the tables where they are exact and the reference elsewhere: float32
block scales (the -Base checkpoints), E8M0 bytes >= 247 (values past float32), NaN bytes, a
global scale below 2**-100 (``sb * alpha`` could underflow), more than :data:`MAX_COMBOS` combos,
K not a multiple of 16, no elements.

The tables path runs on the device its inputs are on (a GPU with ``nvfp4-convert convert --device cuda``) with
the same bytes as on the CPU: the float recipe runs on the CPU over the few (combo, byte) entries, and what runs
on the device is integer work only (masks, byte maxima, sums of small integers, gathers, counts), which has one
exact result whatever the hardware or the order of its additions. The reference runs on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .e2m1 import unpack_nibbles
from .fp8 import FP8_BLOCK, block_scale_values, fp8_block_dequantize
from .nvfp4 import (BLOCK, block_amax, block_scales_from_amax, dequantize_nvfp4, encode_nvfp4, global_scale_for)
from .scales import decode_e4m3, decode_e8m0

# E8M0 bytes up to this keep 448 * 2**(byte - 127) finite in float32.
E8M0_TABLE_MAX = 246
# Smallest global scale the tables take: sb * alpha >= 2**-109 stays a normal float32.
ALPHA_TABLE_MIN = 2.0**-100
# Elements per step of the table path: bounds its temporaries (~5 bytes per element) to tens of MB.
TABLE_CHUNK = 1 << 22
PAIRS = 1 << 16  # table entries per combo: two FP8 bytes read as one int16, offset by 2**15
# Most (tile exponent, block max) combos a part may hold for the tables (32 MB of pair table); real
# weights have a few dozen to a few hundred.
MAX_COMBOS = 512


@dataclass(frozen=True)
class ValueHistogram:
    """``counts[i]`` elements had source value ``reference[i]`` and NVFP4 value ``approx[i]`` (float32)."""

    reference: torch.Tensor
    approx: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class Fp8Cast:
    """Row-major NVFP4 parts (packed uint8 [r, K/2], E4M3 bytes [r, K/16]) with one alpha each.

    The reference path also returns the dequantised float32 sources (``sources``) to measure
    the error against; the table path returns one exact :class:`ValueHistogram` per part instead.
    """

    packed: list[torch.Tensor]
    scales: list[torch.Tensor]
    alphas: tuple[float, ...]
    sources: list[torch.Tensor] | None = None
    histograms: list[ValueHistogram] | None = None


def _alphas(amax: list[float], shared: bool) -> list[float]:
    return [global_scale_for(max(amax))] * len(amax) if shared else [global_scale_for(a) for a in amax]


def fp8_to_nvfp4_reference(weights: list[torch.Tensor], scales: list[torch.Tensor], shared_alpha: bool) -> Fp8Cast:
    """The recipe in float32 torch ops (module docstring); every part on one alpha with ``shared_alpha``."""
    values = [fp8_block_dequantize(w, s) for w, s in zip(weights, scales)]
    block_max = [block_amax(v) for v in values]  # one pass gives both the block and the global amax
    amax = [float(b.max()) for b in block_max]
    if any(math.isnan(a) for a in amax):
        raise ValueError("the FP8 weight holds NaN bytes (0x7F / 0xFF), which have no NVFP4 value")
    if not all(math.isfinite(a) for a in amax):
        raise ValueError("FP8 values times their block scales exceed the float32 range (block scales up to "
                         f"{max(float(block_scale_values(s).max()) for s in scales):.3g}), which an NVFP4 copy with a "
                         "float32 global scale cannot hold; keep the dense layers in FP8 with --dense keep")
    alphas = _alphas(amax, shared_alpha)
    blocks = [block_scales_from_amax(b, a) for b, a in zip(block_max, alphas)]
    packed = [encode_nvfp4(v, b, a) for v, b, a in zip(values, blocks, alphas)]
    return Fp8Cast(packed, blocks, tuple(alphas), sources=values)


@dataclass
class _Scan:
    """One part's integer summary: FP8 bytes, each 16-block's combo key (E8M0 byte * 128 + largest magnitude byte)."""

    weight: torch.Tensor  # uint8 [R, K]
    keys: torch.Tensor  # int32 [R, K/16]
    combos: torch.Tensor  # int64 [n], sorted keys present

    @property
    def amax(self) -> float:
        """The part's amax, as the recipe's float32 block amaxes give it."""
        return float(_block_amax_values(self.combos.cpu()).max())


def _block_amax_values(combos: torch.Tensor) -> torch.Tensor:
    # fp8(m) * 2**k with the same float32 product fp8_block_dequantize forms.
    return decode_e4m3((combos % 128).to(torch.uint8)) * decode_e8m0((combos // 128).to(torch.uint8))


def _scan(weight: torch.Tensor, scale: torch.Tensor) -> _Scan | None:
    """Block keys of one part, or None where the tables would not be exact (see the module docstring)."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu) or weight.dim() != 2:
        return None
    w = weight.view(torch.uint8)
    rows, cols = w.shape
    if not rows or not cols or cols % BLOCK or tuple(scale.shape) != (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)):
        return None
    e8m0 = scale.view(torch.uint8)
    if int(e8m0.max()) > E8M0_TABLE_MAX:
        return None
    w = w.contiguous()
    nb = cols // BLOCK
    tile = e8m0.to(torch.int32).mul_(128)
    tile = tile.repeat_interleave(FP8_BLOCK, dim=0)[:rows].repeat_interleave(FP8_BLOCK // BLOCK, dim=1)[:, :nb]
    keys = torch.empty(rows, nb, dtype=torch.int32, device=w.device)
    per = max(1, TABLE_CHUNK // cols)
    mag = torch.empty(min(per, rows) * cols, dtype=torch.uint8, device=w.device)
    block_max = torch.empty(min(per, rows) * nb, dtype=torch.uint8, device=w.device)
    for r in range(0, rows, per):  # one set of chunk buffers, reused: fresh ones would cost page faults
        n = min(per, rows - r)
        m = torch.bitwise_and(w[r:r + n], 0x7F, out=mag[:n * cols].view(n, cols))
        b = torch.amax(m.view(n, nb, BLOCK), dim=-1, out=block_max[:n * nb].view(n, nb))
        torch.add(tile[r:r + n], b, out=keys[r:r + n])
    if int((keys % 128).max()) == 0x7F:  # an E4M3 NaN byte
        return None
    present = torch.bincount(keys.reshape(-1), minlength=256 * 128).nonzero().reshape(-1)
    return _Scan(w, keys, present) if present.numel() <= MAX_COMBOS else None


def _tables(combos: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recipe run on every (combo, byte): -> (scale byte [n], packed pair table [n * 2**16],
    source values [n, 256], NVFP4 values [n, 256])."""
    n = combos.numel()
    byte_values = decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    byte_values[0x7F] = byte_values[0xFF] = 0.0  # NaN bytes: never looked up (scan refuses them)
    tile_scale = decode_e8m0((combos // 128).to(torch.uint8))
    x = byte_values.unsqueeze(0) * tile_scale.unsqueeze(1)  # same product as fp8_block_dequantize
    sb = block_scales_from_amax(_block_amax_values(combos), alpha)
    sb16 = sb.unsqueeze(1).expand(n, 256 // BLOCK)
    packed = encode_nvfp4(x, sb16, alpha)
    approx = dequantize_nvfp4(packed, sb16, alpha)
    codes = unpack_nibbles(packed)
    # Entry (combo, j): the int16 j - 2**15 read from two FP8 bytes (lo, hi) is the uint16 j ^ 0x8000.
    hi = torch.arange(256) ^ 0x80
    pairs = codes.unsqueeze(1) | (codes[:, hi] << 4).unsqueeze(2)  # [n, hi ^ 0x80, lo]
    return sb, pairs.reshape(-1), x, approx


def _encode(scan: _Scan, alpha: float) -> tuple[torch.Tensor, torch.Tensor, ValueHistogram]:
    """The part's packed codes and scale bytes by gathers from the tables (on the weight's device), and its exact
    value histogram (on the CPU)."""
    rows, cols = scan.weight.shape
    nb = cols // BLOCK
    device = scan.weight.device
    sb, pairs, x, approx = _tables(scan.combos.cpu(), alpha)
    sb, pairs = sb.to(device), pairs.to(device)
    combo_of_key = torch.zeros(256 * 128, dtype=torch.int32, device=device)
    combo_of_key[scan.combos] = torch.arange(scan.combos.numel(), dtype=torch.int32, device=device)
    combo = combo_of_key.index_select(0, scan.keys.reshape(-1)).reshape(rows, nb)
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    counts = torch.zeros(scan.combos.numel() * 256, dtype=torch.int64, device=device)
    elem_dtype = torch.int16 if counts.numel() <= 1 << 15 else torch.int32
    per = max(1, TABLE_CHUNK // cols)
    pair_idx = torch.empty(min(per, rows) * cols // 2, dtype=torch.int32, device=device)
    elem_idx = torch.empty(min(per, rows) * cols, dtype=elem_dtype, device=device)
    for r in range(0, rows, per):
        n = min(per, rows - r)
        c, w = combo[r:r + n], scan.weight[r:r + n]
        idx = torch.add((c * PAIRS + PAIRS // 2).unsqueeze(-1), w.view(torch.int16).view(n, nb, BLOCK // 2),
                        out=pair_idx[:n * cols // 2].view(n, nb, BLOCK // 2))
        torch.index_select(pairs, 0, idx.view(-1), out=packed[r:r + n].view(-1))
        elem = torch.add((c * 256).to(elem_dtype).unsqueeze(-1), w.view(n, nb, BLOCK),
                         out=elem_idx[:n * cols].view(n, nb, BLOCK))
        counts += torch.bincount(elem.view(-1), minlength=counts.numel())
    scales = sb.index_select(0, combo.reshape(-1)).reshape(rows, nb)
    return packed, scales, ValueHistogram(x.reshape(-1), approx.reshape(-1), counts.cpu())


def fp8_to_nvfp4_tables(weights: list[torch.Tensor], scales: list[torch.Tensor], shared_alpha: bool) -> Fp8Cast | None:
    """The recipe's bytes by table lookup (module docstring), or None where that would not be exact."""
    scans = [_scan(w, s) for w, s in zip(weights, scales)]
    if any(s is None for s in scans):
        return None
    alphas = _alphas([s.amax for s in scans], shared_alpha)
    if min(alphas) < ALPHA_TABLE_MIN:
        return None
    done = [_encode(s, a) for s, a in zip(scans, alphas)]
    return Fp8Cast([d[0] for d in done], [d[1] for d in done], tuple(alphas), histograms=[d[2] for d in done])


def fp8_to_nvfp4(weights: list[torch.Tensor], scales: list[torch.Tensor], shared_alpha: bool) -> Fp8Cast:
    """FP8 parts -> NVFP4 parts, bytes exactly the recipe's: by tables where exact (on the inputs' device), else
    the reference (on the CPU, whatever the inputs' device: its float work stays on one kind of hardware)."""
    return (fp8_to_nvfp4_tables(weights, scales, shared_alpha)
            or fp8_to_nvfp4_reference([w.cpu() for w in weights], [s.cpu() for s in scales], shared_alpha))
