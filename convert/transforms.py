"""Per-matrix transforms of the converter, each beside its inverse (verify runs the inverses).

Composed from the primitives in ``nvfp4_megamoe.kernels``:

* ``to_kernel_layout`` / ``from_kernel_layout``: gate/up interleave by 8 (for fused w1+w3)
  then the 128x4 scale swizzle, and back. Exact both ways.
* ``mxfp4_forward`` / ``mxfp4_inverse``: official MXFP4 -> NVFP4 closed-form cast (codes kept,
  scales moved onto one power-of-two alpha) and back to (codes, per-16 effective scales).
* ``nvfp4_forward``: ModelOpt NVFP4: codes and scale bytes kept, each half keeps its own global
  scale (format 1 stores a (gate, up) alpha pair per expert), so the path is exact.
* ``ct_nvfp4_forward``: compressed-tensors NVFP4 (``weight_packed``, ``weight_scale``,
  ``weight_global_scale``): codes and scale bytes kept, each half's alpha = float32(1 / global
  scale), exact only when the global scale is a power of two (``ct_alpha_is_exact``);
  ``dequantize_ct_nvfp4`` is compressed-tensors' own float32 reading, ``e2m1 * (e4m3 / gs)``.
* ``fp8_forward`` / ``dequantize_fused``: FP8 (128x128 block scales) requantised to NVFP4 (lossy;
  ``kernels.fp8_nvfp4``: exact lookup tables where they apply, else the float recipe), and the
  dequantisation that verify compares with the FP8 source. ``measure_error`` adds a result's
  error against its float sources (or the tables' exact value histograms) to running statistics.

Every result carries one alpha per part (``alphas``); parts that share a global scale (the
MXFP4 cast over w1 and w3 together, a dense fused linear) repeat the same value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from nvfp4_megamoe.kernels.e2m1 import decode_e2m1, unpack_nibbles
from nvfp4_megamoe.kernels.fp8_nvfp4 import ValueHistogram, fp8_to_nvfp4
from nvfp4_megamoe.kernels.interleave import deinterleave_gate_up, interleave_gate_up
from nvfp4_megamoe.kernels.mxfp4 import mxfp4_to_nvfp4
from nvfp4_megamoe.kernels.scales import decode_e4m3
from nvfp4_megamoe.kernels.nvfp4 import BLOCK, dequantize_nvfp4
from nvfp4_megamoe.kernels.swizzle import swizzle_block_scales, unswizzle_block_scales

from .stats import ErrorStats


@dataclass(frozen=True)
class KernelMatrix:
    """One output matrix in format 1: packed codes [R, K/2], swizzled scale bytes, one alpha per part."""

    packed: torch.Tensor
    scales: torch.Tensor
    alphas: tuple[float, ...]
    inexact_blocks: int = 0


def to_kernel_layout(packed: list[torch.Tensor], scales: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major parts (1, or 2 = gate, up) -> (fused packed [R, K/2], swizzled scale bytes)."""
    if len(packed) == 2:
        p, s = interleave_gate_up(*packed), interleave_gate_up(*scales)
    else:
        (p,), (s,) = packed, scales
    return p.view(torch.uint8), swizzle_block_scales(s)


def from_kernel_layout(packed: torch.Tensor, swizzled: torch.Tensor, parts: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inverse of :func:`to_kernel_layout`: -> ([packed per part], [scale bytes [r, K/16] per part])."""
    rows, half_k = packed.shape
    scales = unswizzle_block_scales(swizzled, rows, 2 * half_k // BLOCK)
    if parts == 2:
        return list(deinterleave_gate_up(packed)), list(deinterleave_gate_up(scales))
    return [packed], [scales]


CPU = torch.device("cpu")


def _to(device: torch.device, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Source tensors on ``device``, moved as their bytes (every 8-bit float kind copies to a GPU as bytes)."""
    return [t if t.device == device else t.view(torch.uint8).to(device).view(t.dtype) for t in tensors]


def mxfp4_forward(weights: list[torch.Tensor], scales: list[torch.Tensor], device: torch.device = CPU) -> KernelMatrix:
    """MXFP4 parts (int8 [r, K/2], E8M0 [r, K/32]) -> one fused NVFP4 matrix, codes unchanged; computed on
    ``device`` (the same torch ops, the same bytes: ``kernels/mxfp4.py``), returned on the CPU."""
    cast = mxfp4_to_nvfp4(_to(device, weights), _to(device, scales))
    packed, swz = to_kernel_layout(cast.packed, cast.scales)
    return KernelMatrix(packed.cpu(), swz.cpu(), (cast.alpha,) * len(weights), cast.fallback_blocks)


def nvfp4_forward(weights: list[torch.Tensor], scales: list[torch.Tensor], alphas: list[float]) -> KernelMatrix:
    """ModelOpt NVFP4 parts (U8 [r, K/2], E4M3 [r, K/16], own alpha) -> one fused matrix, nothing changed."""
    for a in alphas:
        if not (0 < a < float("inf")):
            raise ValueError(f"weight_scale_2 must be finite and positive, got {a}")
    packed, swz = to_kernel_layout([w.view(torch.uint8) for w in weights], [s.view(torch.uint8) for s in scales])
    return KernelMatrix(packed, swz, tuple(float(a) for a in alphas))


def ct_alpha(global_scale: float) -> float:
    """compressed-tensors' divisor ``weight_global_scale`` -> format 1's multiplier: 1 / gs rounded once to float32."""
    return float(torch.reciprocal(torch.tensor(global_scale, dtype=torch.float32)))


def ct_alpha_is_exact(global_scale: float) -> bool:
    """Is float32(1 / gs) exactly 1 / gs? Only for powers of two (within float32's normal range)."""
    m, _ = math.frexp(global_scale)
    return global_scale > 0 and m == 0.5 and ct_alpha(global_scale) * global_scale == 1.0


def ct_nvfp4_forward(weights: list[torch.Tensor], scales: list[torch.Tensor], global_scales: list[float]) -> KernelMatrix:
    """compressed-tensors NVFP4 parts (U8 [r, K/2], E4M3 [r, K/16], own divisor gs) -> one fused matrix.

    Codes and scale bytes are unchanged; each part's alpha is float32(1 / gs).
    """
    for g in global_scales:
        if not (0 < g < float("inf")):
            raise ValueError(f"weight_global_scale must be finite and positive, got {g}")
    alphas = [ct_alpha(g) for g in global_scales]
    for g, a in zip(global_scales, alphas):
        if not (0 < a < float("inf")):
            raise ValueError(f"1 / weight_global_scale = 1 / {g} is not a finite positive float32")
    packed, swz = to_kernel_layout([w.view(torch.uint8) for w in weights], [s.view(torch.uint8) for s in scales])
    return KernelMatrix(packed, swz, tuple(alphas))


def dequantize_ct_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    """compressed-tensors' reading in float32: ``e2m1 * (e4m3 / gs)`` (the scale divided first, as it does)."""
    gs = torch.tensor(global_scale, dtype=torch.float32)
    eff = decode_e4m3(scales.view(torch.uint8)) / gs
    codes = decode_e2m1(unpack_nibbles(packed.view(torch.uint8)))
    return (codes.reshape(*eff.shape, BLOCK) * eff.unsqueeze(-1)).flatten(-2)


def fp8_forward(weights: list[torch.Tensor], scales: list[torch.Tensor], shared_alpha: bool,
                device: torch.device = CPU) -> tuple[KernelMatrix, list[torch.Tensor] | list[ValueHistogram]]:
    """FP8 parts (block-scaled) -> one fused NVFP4 matrix, plus what its error is measured against
    (:func:`measure_error`): the float32 sources, or per part the tables' exact value histogram.

    With ``shared_alpha`` all parts are quantised on one global scale (a dense fused linear has
    a single alpha); otherwise each part gets its own (routed experts carry a pair). The tables path is
    computed on ``device`` with the CPU's bytes (``kernels/fp8_nvfp4.py``); the result is returned on the CPU.
    """
    cast = fp8_to_nvfp4(_to(device, weights), _to(device, scales), shared_alpha)
    p, swz = to_kernel_layout(cast.packed, cast.scales)
    return KernelMatrix(p.cpu(), swz.cpu(), cast.alphas), cast.histograms or cast.sources


# Rows dequantised at a time when measuring error, so float32 copies of a large matrix never coexist.
DEQUANT_CHUNK = 1 << 22


def dequantize_fused(m: KernelMatrix, parts: int) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """A fused format-1 matrix -> float32 values, as (part, row slice, values) chunks of each part (gate, up)."""
    packed, scales = from_kernel_layout(m.packed, m.scales, parts)
    for j, (p, s, a) in enumerate(zip(packed, scales, m.alphas)):
        per = max(1, DEQUANT_CHUNK // (2 * p.shape[-1]))
        for r in range(0, p.shape[0], per):
            rows = slice(r, r + per)
            yield j, rows, dequantize_nvfp4(p[rows], s[rows], a)


def measure_error(stats: ErrorStats, m: KernelMatrix, refs: list[torch.Tensor] | list[ValueHistogram]) -> None:
    """Add the error of fused matrix ``m`` against its parts' float32 sources, or their value histograms."""
    if isinstance(refs[0], ValueHistogram):
        for h in refs:
            stats.update_histogram(h.reference, h.approx, h.counts)
        return
    for j, rows, approx in dequantize_fused(m, len(refs)):
        stats.update(refs[j][rows], approx)
