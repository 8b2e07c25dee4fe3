"""Round-trip checks of one converted NVFP4 item (an expert, or a dense linear) against its source.

Each check runs the inverse of the converter's layout transforms on the converted bytes
(:func:`~nvfp4_megamoe.convert.transforms.from_kernel_layout`: un-swizzle, de-interleave; the
caller un-stacks by reading one expert's slice) and compares with the source tensors:

* **MXFP4** (official experts, ModelOpt MTP experts): ``alpha = 2**(max k - 8)`` exactly; every
  code identical; on every non-zero 32-block the effective per-16 scales ``e4m3 * alpha`` equal
  ``2**(e8m0 - 127)`` exactly (zero blocks have no defined scale). Out-of-range blocks
  (``max k - k > 17``) must hold scale ``2**-9`` and the codes re-rounded to that step; their
  error is bounded by half the smallest E2M1 step, ``2**-11 * alpha``.
* **ModelOpt NVFP4**: codes, scale bytes and each half's alpha (its ``weight_scale_2``) identical.
* **compressed-tensors NVFP4**: codes and scale bytes identical; each half's alpha is
  float32(1 / ``weight_global_scale``) bit for bit. Where a global scale is not a power of two
  that alpha is not exactly 1/gs: the item is measured against compressed-tensors' own float32
  reading ``e2m1 * (e4m3 / gs)`` and held to :data:`BOUNDS` (a few float32 ulps).
* **FP8 -> NVFP4** (lossy): alpha, block scales and codes are exactly what the documented recipe
  gives for the source values (so one flipped byte is found even where the error statistics
  would hardly move), and the error statistics stay within :data:`BOUNDS`.

Functions here read nothing themselves: the caller passes the converted item and a reader of
source tensors, so memory stays at one item.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from nvfp4_megamoe.kernels.e2m1 import unpack_nibbles
from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize
from nvfp4_megamoe.kernels.mxfp4 import (E4M3_POW2_MAX, E4M3_POW2_MIN, dequantize_mxfp4, nonzero_blocks, requantize_blocks,
                                         shared_exponent)
from nvfp4_megamoe.kernels.nvfp4 import BLOCK, block_scales_for, dequantize_nvfp4, encode_nvfp4, global_scale_for
from nvfp4_megamoe.kernels.scales import e8m0_exponent, encode_e4m3

from .stats import ErrorStats
from .transforms import ct_alpha, ct_alpha_is_exact, dequantize_ct_nvfp4, from_kernel_layout


@dataclass(frozen=True)
class Bound:
    """Documented limits for one lossy path (docs/format.md, "Verification bounds")."""

    rel_fro: float
    cosine: float
    max_abs_over_alpha: float | None = None  # per item: max |error| <= this * alpha

    def as_dict(self) -> dict:
        d = {"rel_fro": self.rel_fro, "cosine": self.cosine}
        if self.max_abs_over_alpha is not None:
            d["max_abs_over_alpha"] = self.max_abs_over_alpha
        return d


#: Source format -> bound on the converted tensor's error against the dequantised source.
#: Measured on the synthetic checkpoints (tiny and small presets, every variant, 3 seeds):
#: fp8 rel_fro 0.092-0.097, cosine >= 0.9953; nvfp4 reconciliation rel_fro 0.0146-0.0161,
#: cosine >= 0.99987; mxfp4 fallback rel_fro <= 1.1e-7.
BOUNDS: dict[str, Bound] = {
    "fp8": Bound(rel_fro=0.15, cosine=0.98),
    # Fallback blocks only: half the smallest E2M1 step (0.5) at the smallest scale 2**-9.
    "mxfp4": Bound(rel_fro=1e-3, cosine=0.999999, max_abs_over_alpha=2.0**-11),
    # compressed-tensors with a non-power-of-two global scale: e2m1*e4m3 is exact in float32, so the
    # two readings differ only by the rounding of 1/gs (vs of e4m3/gs) and of one product: <= 2**-22
    # relative per element, i.e. max |error| <= 6*448 * 2**-22 * alpha. Measured on the synthetic
    # ct checkpoints: rel_fro ~1e-8.
    "ct_nvfp4": Bound(rel_fro=1e-6, cosine=0.99999, max_abs_over_alpha=6.0 * 448.0 * 2.0**-22),
}
MANIFEST_RTOL = 1e-3  # measured vs recorded rel_fro and max_abs
MANIFEST_COS_ATOL = 1e-5

SourceReader = Callable[[str], torch.Tensor]


@dataclass
class UnitCheck:
    """What the round trip found for one unit (all its items), keyed by output tensor."""

    problems: list[tuple[str, str]] = field(default_factory=list)  # (output tensor, message)
    stats: ErrorStats = field(default_factory=ErrorStats)
    inexact: int = 0
    lossy_items: int = 0
    max_abs_over_alpha: float = 0.0

    def problem(self, tensor: str, message: str) -> None:
        self.problems.append((tensor, message))


@dataclass(frozen=True)
class Item:
    """One converted item: packed [R, K/2] uint8, swizzled scale bytes, one alpha per part; its output names."""

    index: int | None  # expert index for stacked outputs
    packed: torch.Tensor
    scales: torch.Tensor
    alphas: tuple[float, ...]
    names: dict[str, str]  # "weight", "weight_scale", "alpha" -> output tensor name

    def where(self, part: str | None = None) -> str:
        bits = ([f"expert {self.index}"] if self.index is not None else []) + ([part] if part else [])
        return f" [{', '.join(bits)}]" if bits else ""


def _first_diff(mask: torch.Tensor) -> str:
    idx = mask.nonzero()[0].tolist()
    return f"first at {idx}" if idx else ""


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


def _parts(item: Item, parts: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return from_kernel_layout(item.packed, item.scales, parts)


PART_NAMES = {1: (None,), 2: ("w1 (gate)", "w3 (up)")}


# E4M3 byte of 2**j for j = -9..8 (index j + 9): the only scale bytes an exact MXFP4 cast can hold.
_POW2_E4M3 = encode_e4m3(torch.exp2(torch.arange(E4M3_POW2_MIN, E4M3_POW2_MAX + 1, dtype=torch.float32)))


def check_mxfp4(item: Item, sources: list[dict[str, str]], read: SourceReader, acc: UnitCheck) -> None:
    """Official MXFP4 -> NVFP4: codes and effective scales bit-exact, fallback blocks bounded.

    With ``alpha = 2**m`` checked first, ``e4m3 * alpha == 2**k`` is the same as the scale byte
    being the E4M3 byte of ``2**(k - m)``, so scales are compared as bytes.
    """
    parts = len(sources)
    packed, scales = _parts(item, parts)
    src_w = [read(p["weight"]).view(torch.uint8) for p in sources]
    src_s = [read(p["scale"]).view(torch.uint8) for p in sources]
    nonzero = [nonzero_blocks(w) for w in src_w]
    k = [e8m0_exponent(s) for s in src_s]
    m = shared_exponent(src_s, src_w)
    want_alpha = math.ldexp(1.0, m)
    if any(a != want_alpha for a in item.alphas):
        acc.problem(item.names["alpha"], f"alpha{item.where()} is {list(item.alphas)!r}, the MXFP4 cast gives "
                    f"2**{m} = {want_alpha!r}")
    inexact_here = 0
    item_stats = ErrorStats()
    worst = 0.0
    for j, name in enumerate(PART_NAMES[parts]):
        rel = k[j] - m
        out_of_range = nonzero[j] & (rel < E4M3_POW2_MIN)
        expected = src_w[j]
        if out_of_range.any():  # the documented fallback: codes re-rounded to the 2**-9 step
            expected = requantize_blocks(src_w[j], rel, out_of_range)
        bad = packed[j] != expected
        if bad.any():
            acc.problem(item.names["weight"], f"{_count(bad)} packed E2M1 bytes{item.where(name)} differ from "
                        f"{sources[j]['weight']} ({_first_diff(bad)})")
        want = _POW2_E4M3[(rel.clamp(E4M3_POW2_MIN, E4M3_POW2_MAX) - E4M3_POW2_MIN).long()].repeat_interleave(2, -1)
        exact = (nonzero[j] & ~out_of_range).repeat_interleave(2, dim=-1)
        bad = exact & (scales[j] != want)
        if bad.any():
            acc.problem(item.names["weight_scale"], f"{_count(bad)} effective scales{item.where(name)} differ from "
                        f"2**(e8m0-127) of {sources[j]['scale']} ({_first_diff(bad)})")
        if out_of_range.any():
            inexact_here += _count(out_of_range)
            bad = out_of_range.repeat_interleave(2, dim=-1) & (scales[j] != _POW2_E4M3[0])
            if bad.any():
                acc.problem(item.names["weight_scale"], f"{_count(bad)} out-of-range blocks{item.where(name)} do not "
                            f"hold the fallback scale 2**-9 ({_first_diff(bad)})")
    if inexact_here:
        for j in range(parts):
            ref = dequantize_mxfp4(src_w[j], src_s[j])
            out = dequantize_nvfp4(packed[j], scales[j], want_alpha)
            item_stats.update(ref, out)
            worst = max(worst, float((out - ref).abs().max()) / want_alpha)
        _add_item(acc, item_stats, inexact_here, worst)


def check_nvfp4(item: Item, sources: list[dict[str, str]], read: SourceReader, acc: UnitCheck) -> None:
    """ModelOpt NVFP4: codes, scale bytes and each half's global scale are the source's, bit for bit."""
    parts = len(sources)
    packed, scales = _parts(item, parts)
    for j, name in enumerate(PART_NAMES[parts]):
        p = sources[j]
        src_a = float(read(p["weight_scale_2"]).float().reshape(-1)[0])
        if item.alphas[j] != src_a:
            acc.problem(item.names["alpha"], f"alpha{item.where(name)} is {item.alphas[j]!r}, expected "
                        f"{p['weight_scale_2']} = {src_a!r}")
        for out, src_name, what in ((packed[j], p["weight"], "packed bytes"), (scales[j], p["weight_scale"], "scale bytes")):
            bad = out != read(src_name).view(torch.uint8)
            if bad.any():
                acc.problem(item.names["weight" if what == "packed bytes" else "weight_scale"],
                            f"{_count(bad)} {what}{item.where(name)} differ from {src_name} ({_first_diff(bad)})")


def check_ct_nvfp4(item: Item, sources: list[dict[str, str]], read: SourceReader, acc: UnitCheck) -> None:
    """compressed-tensors NVFP4: codes and scale bytes the source's; alpha = float32(1 / weight_global_scale).

    When a global scale is not a power of two the item counts as lossy: its values are compared with
    compressed-tensors' float32 reading (``e2m1 * (e4m3 / gs)``) and must stay within the bound.
    """
    parts = len(sources)
    packed, scales = _parts(item, parts)
    stats, worst, measured = ErrorStats(), 0.0, False
    for j, name in enumerate(PART_NAMES[parts]):
        p = sources[j]
        gs = float(read(p["weight_global_scale"]).float().reshape(-1)[0])
        want = ct_alpha(gs) if 0 < gs < math.inf else math.nan
        if item.alphas[j] != want:
            acc.problem(item.names["alpha"], f"alpha{item.where(name)} is {item.alphas[j]!r}, expected float32(1 / "
                        f"{p['weight_global_scale']}) = 1 / {gs!r} = {want!r}")
        src_w = read(p["weight_packed"]).view(torch.uint8)
        src_s = read(p["weight_scale"]).view(torch.uint8)
        for out, src, src_name, what in ((packed[j], src_w, p["weight_packed"], "packed bytes"),
                                         (scales[j], src_s, p["weight_scale"], "scale bytes")):
            bad = out != src
            if bad.any():
                acc.problem(item.names["weight" if what == "packed bytes" else "weight_scale"],
                            f"{_count(bad)} {what}{item.where(name)} differ from {src_name} ({_first_diff(bad)})")
        if not ct_alpha_is_exact(gs) and math.isfinite(want):
            measured = True
            ref = dequantize_ct_nvfp4(src_w, src_s, gs)
            out = dequantize_nvfp4(packed[j], scales[j], item.alphas[j])
            stats.update(ref, out)
            worst = max(worst, float((out - ref).abs().max()) / want)
    if measured:
        _add_item(acc, stats, 0, worst)


def check_fp8(item: Item, sources: list[dict[str, str]], read: SourceReader, acc: UnitCheck) -> None:
    """FP8 -> NVFP4 requantisation: alpha, scales and codes follow the recipe; error measured."""
    parts = len(sources)
    packed, scales = _parts(item, parts)
    values = [fp8_block_dequantize(read(p["weight"]), read(p["scale"])) for p in sources]
    amax = [float(v.abs().max()) for v in values]
    shared = len(set(item.alphas)) == 1 and item.index is None  # dense fused linears share one alpha
    want_alphas = [global_scale_for(max(amax))] * parts if shared else [global_scale_for(a) for a in amax]
    if list(item.alphas) != want_alphas:
        acc.problem(item.names["alpha"], f"alpha{item.where()} is {list(item.alphas)!r}, the recipe gives amax/(6*448) = "
                    f"{want_alphas!r}")
    stats = ErrorStats()
    for j, name in enumerate(PART_NAMES[parts]):
        want_alpha = want_alphas[j]
        bad = scales[j] != block_scales_for(values[j], want_alpha)  # a wrong alpha is reported once, above
        if bad.any():
            acc.problem(item.names["weight_scale"], f"{_count(bad)} block scales{item.where(name)} are not "
                        f"e4m3(block_amax/(6*alpha)) of {sources[j]['weight']} ({_first_diff(bad)})")
        bad = unpack_nibbles(packed[j]) != unpack_nibbles(encode_nvfp4(values[j], scales[j], want_alpha))
        if bad.any():
            acc.problem(item.names["weight"], f"{_count(bad)} E2M1 codes{item.where(name)} are not the nearest codes "
                        f"of {sources[j]['weight']} under the stored scales ({_first_diff(bad)})")
        stats.update(values[j], dequantize_nvfp4(packed[j], scales[j], want_alpha))
    _add_item(acc, stats, 0, 0.0)


def _add_item(acc: UnitCheck, stats: ErrorStats, inexact: int, worst_over_alpha: float) -> None:
    acc.stats.merge(stats)
    acc.inexact += inexact
    acc.lossy_items += 1
    acc.max_abs_over_alpha = max(acc.max_abs_over_alpha, worst_over_alpha)


CHECKS: dict[str, Callable[[Item, list[dict[str, str]], SourceReader, UnitCheck], None]] = {
    "mxfp4": check_mxfp4, "nvfp4": check_nvfp4, "fp8": check_fp8, "ct_nvfp4": check_ct_nvfp4,
}


def bound_violations(fmt: str, acc: UnitCheck) -> list[str]:
    """Messages for every documented bound the unit's measured error exceeds (empty if none)."""
    if not acc.lossy_items:
        return []
    b = BOUNDS[fmt]
    err = acc.stats.result()
    out = []
    if not err["rel_fro"] <= b.rel_fro:
        out.append(f"relative Frobenius error {err['rel_fro']:.4g} exceeds the bound {b.rel_fro:.4g}")
    if not err["cosine"] >= b.cosine:
        out.append(f"cosine {err['cosine']:.6f} is below the bound {b.cosine}")
    if b.max_abs_over_alpha is not None and not acc.max_abs_over_alpha <= b.max_abs_over_alpha:
        out.append(f"max abs error {acc.max_abs_over_alpha:.4g} x alpha exceeds the bound {b.max_abs_over_alpha:.4g} x alpha")
    return out


def manifest_disagreement(measured: dict, recorded: dict | None) -> str | None:
    """None when the manifest's recorded error matches the measured one, else why not.

    rel_fro and max_abs agree within relative 1e-3, the cosine within 1e-5 absolute: the same
    statistics computed twice may differ in the last float32 bits, never more.
    """
    if recorded is None:
        return "the manifest records no error for this lossy tensor"
    for key in ("rel_fro", "max_abs"):
        a, b = measured[key], recorded.get(key)
        if b is None or not abs(a - b) <= MANIFEST_RTOL * max(abs(a), abs(b)) + 1e-12:
            return f"the manifest records {key} = {b!r}, verify measures {a!r}"
    # The cosine (near 1, from float32 dot products) is compared with an absolute tolerance.
    if not abs(measured["cosine"] - recorded.get("cosine", math.nan)) <= MANIFEST_COS_ATOL:
        return f"the manifest records cosine = {recorded.get('cosine')!r}, verify measures {measured['cosine']!r}"
    return None


def scale_cols(packed_cols: int) -> int:
    """Scale columns (K/16) of a packed [R, K/2] matrix."""
    return 2 * packed_cols // BLOCK
