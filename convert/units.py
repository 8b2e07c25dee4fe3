"""Units of conversion: groups of source tensors converted together into format-1 outputs.

A unit knows, from source headers alone, every output tensor's name, dtype, shape and sources
(so the writer can lay out shard headers before converting), and how to produce the bytes
piece by piece (expert by expert for stacked tensors), which bounds memory by one expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from nvfp4_megamoe.kernels.fp8_nvfp4 import ValueHistogram
from nvfp4_megamoe.kernels.mxfp4 import dequantize_mxfp4
from nvfp4_megamoe.kernels.nvfp4 import BLOCK, dequantize_nvfp4
from nvfp4_megamoe.kernels.row_tiles import tile_rows
from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes
from nvfp4_megamoe.runtime.format import ROW_TILES_STEP, alpha_shape, fused_expert_names

from .safetensors_header import DTYPES
from .source import E2M1_MAX, E4M3_MAX
from .stats import ErrorStats
from .transforms import (KernelMatrix, ct_alpha, ct_alpha_is_exact, ct_nvfp4_forward, dequantize_ct_nvfp4, fp8_forward,
                         measure_error, mxfp4_forward, nvfp4_forward)

# Transform chains as recorded in the manifest, per source format.
CHAINS = {
    "mxfp4": ["mxfp4_to_nvfp4(shared alpha, codes kept)"],
    "nvfp4": ["codes and scales kept, per-half alpha = weight_scale_2"],
    "ct_nvfp4": ["codes and scales kept, per-half alpha = float32(1 / weight_global_scale)"],
    "fp8": ["fp8_block_dequantize", "quantize_nvfp4(shared alpha)"],
}
LAYOUT = ["swizzle_128x4"]
INTERLEAVE = ["interleave_gate_up(8, gate first)"]
STACK = ["stack_experts"]
ROW_TILES = [ROW_TILES_STEP]
# Roles each source format needs per matrix.
ROLES = {"mxfp4": ("weight", "scale"), "fp8": ("weight", "scale"),
         "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
         "ct_nvfp4": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}
# Per source format: the role holding the packed codes, and the activation-scale role kept (stacked,
# values unchanged) under an output of the same name (docs/format.md).
WEIGHT_ROLE = {"ct_nvfp4": "weight_packed"}
INPUT_ROLE = {"nvfp4": "input_scale", "ct_nvfp4": "input_global_scale"}


@dataclass
class OutputSpec:
    """One output tensor: everything the writer and the manifest need before conversion runs."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sources: list[str]
    transform: list[str]
    lossless: bool = True
    error: dict | None = None
    notes: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


class Reader(Protocol):
    def read(self, name: str, element_max: float | None = None) -> torch.Tensor: ...
    def scan(self, name: str, *, element_max: float | None = None, index_limit: int | None = None) -> None: ...
    def fd_and_range(self, name: str) -> tuple[int, int, int]: ...


class Sink(Protocol):
    def write(self, name: str, offset: int, data: torch.Tensor) -> None: ...
    def copy(self, name: str, fd: int, start: int, count: int) -> None: ...


class Unit(Protocol):
    key: str
    sources: list[str]
    outputs: list[OutputSpec]

    def items(self) -> int: ...
    def run(self, src: Reader, sink: Sink, tick: Callable[[int], None]) -> None: ...


def _scalar(t: torch.Tensor) -> float:
    return float(t.float().reshape(-1)[0])


@dataclass
class Passthrough:
    """A tensor copied byte for byte, its values checked first (``Reader.scan``: no NaN/Inf; ``element_max``
    for the block scales of an FP8 linear kept as it is, ``index_limit`` for a hash layer's ``tid2eid``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    element_max: float | None = None
    index_limit: int | None = None

    def __post_init__(self) -> None:
        self.key = self.name
        self.sources = [self.name]
        self.outputs = [OutputSpec(self.name, self.dtype, self.shape, [self.name], ["copy"])]

    def items(self) -> int:
        return 1

    def run(self, src: Reader, sink: Sink, tick: Callable[[int], None]) -> None:
        src.scan(self.name, element_max=self.element_max, index_limit=self.index_limit)
        fd, start, count = src.fd_and_range(self.name)
        sink.copy(self.name, fd, start, count)
        tick(count)


@dataclass
class FusedMatrices:
    """NVFP4 output of one or more same-shape source matrices per item (expert), gate/up fused.

    ``members[item][part][role]`` names the source tensors; ``rows``/``cols`` are one part's
    logical [out, in]. With ``stacked`` the outputs get a leading expert dimension; with ``row_tiles``
    (``--target sm90``) the packed weights are written in Hopper row tiles (``kernels/row_tiles.py``).
    """

    prefix: str
    fmt: str
    members: list[list[dict[str, str]]]
    rows: int
    cols: int
    stacked: bool
    row_tiles: bool = False

    def __post_init__(self) -> None:
        self.key = self.prefix
        parts = len(self.members[0])
        names = fused_expert_names(*self.prefix.rsplit(".", 1))
        chain = (CHAINS[self.fmt] + (INTERLEAVE if parts == 2 else []) + LAYOUT + (ROW_TILES if self.row_tiles else [])
                 + (STACK if self.stacked else []))
        lead = (len(self.members),) if self.stacked else ()
        fused_rows = parts * self.rows
        self.sources = [n for item in self.members for part in item for n in part.values()]
        wrole, irole = WEIGHT_ROLE.get(self.fmt, "weight"), INPUT_ROLE.get(self.fmt)
        weights = [p[wrole] for item in self.members for p in item]
        scales = [n for item in self.members for p in item for r, n in p.items() if r not in (wrole, irole)]
        lossy = self.fmt == "fp8"
        self.weight = OutputSpec(names["weight"], "U8", lead + (fused_rows, self.cols // 2), weights, chain, not lossy)
        self.scale = OutputSpec(names["weight_scale"], "U8", lead + (swizzled_nbytes(fused_rows, self.cols // BLOCK),),
                                scales, chain, not lossy)
        shape = alpha_shape(self.prefix, lead)
        self.alphas_per_item = shape[-1] if len(shape) > len(lead) else 1
        self.alpha = OutputSpec(names["alpha"], "F32", shape, scales, chain, not lossy)
        self.outputs = [self.weight, self.scale, self.alpha]
        self.input_scale = None
        if irole is not None:
            inputs = [p[irole] for item in self.members for p in item]
            self.input_scale = OutputSpec(f"{self.prefix}.{irole}", "F32", lead + ((parts,) if parts > 1 else ()),
                                          inputs, ["stack_input_scales"])
            self.input_role = irole
            self.outputs.append(self.input_scale)
        self.stats = ErrorStats()
        self.inexact = 0
        self.measured = False  # an item's result was compared with its float source (not bit-exact)
        self.inexact_alphas = self.unrecoverable_global_scales = 0  # compressed-tensors: per (expert, half)

    def items(self) -> int:
        return len(self.members)

    def convert_item(self, src: Reader, item: list[dict[str, str]]
                     ) -> tuple[KernelMatrix, list[torch.Tensor] | list[ValueHistogram] | None]:
        """Forward transform of one item; also returns, when the result may be inexact, what its error is
        measured against (:func:`~.transforms.measure_error`)."""
        if self.fmt == "mxfp4":
            w = [src.read(p["weight"]) for p in item]
            s = [src.read(p["scale"], E2M1_MAX) for p in item]
            m = mxfp4_forward(w, s)
            return m, ([dequantize_mxfp4(a, b) for a, b in zip(w, s)] if m.inexact_blocks else None)
        if self.fmt == "nvfp4":
            w = [src.read(p["weight"]) for p in item]
            s = [src.read(p["weight_scale"]) for p in item]
            a = [_scalar(src.read(p["weight_scale_2"])) for p in item]
            m = nvfp4_forward(w, s, a)
            ref = [dequantize_nvfp4(x.view(torch.uint8), y.view(torch.uint8), z) for x, y, z in zip(w, s, a)]
            return m, (ref if m.inexact_blocks else None)
        if self.fmt == "ct_nvfp4":
            w = [src.read(p["weight_packed"]) for p in item]
            s = [src.read(p["weight_scale"]) for p in item]
            gs = [_scalar(src.read(p["weight_global_scale"])) for p in item]
            m = ct_nvfp4_forward(w, s, gs)
            exact = all(ct_alpha_is_exact(g) for g in gs)
            self.inexact_alphas += sum(not ct_alpha_is_exact(g) for g in gs)
            self.unrecoverable_global_scales += sum(ct_alpha(a) != g for a, g in zip(m.alphas, gs))
            return m, (None if exact else [dequantize_ct_nvfp4(x, y, g) for x, y, g in zip(w, s, gs)])
        return fp8_forward([src.read(p["weight"]) for p in item], [src.read(p["scale"], E4M3_MAX) for p in item],
                           shared_alpha=not self.stacked)

    def run(self, src: Reader, sink: Sink, tick: Callable[[int], None]) -> None:
        parts = len(self.members[0])
        n = len(self.members)
        w_bytes = self.weight.nbytes // n if self.stacked else 0
        s_bytes = self.scale.nbytes // n if self.stacked else 0
        for e, item in enumerate(self.members):
            m, ref = self.convert_item(src, item)
            if not all(math.isfinite(a) and a > 0 for a in m.alphas):
                raise ValueError(f"the global scale (alpha) of {self._where(e)} comes out as {list(m.alphas)}; the "
                                 "source values overflow or vanish in float32 (check its scale tensors)")
            self.inexact += m.inexact_blocks
            if ref is not None:
                self.measured = True
                measure_error(self.stats, m, ref)
            sink.write(self.weight.name, e * w_bytes, tile_rows(m.packed) if self.row_tiles else m.packed)
            sink.write(self.scale.name, e * s_bytes, m.scales)
            alphas = torch.tensor(m.alphas[: self.alphas_per_item], dtype=torch.float32)
            sink.write(self.alpha.name, e * 4 * self.alphas_per_item, alphas)
            if self.input_scale is not None:
                scales = torch.tensor([_scalar(src.read(p[self.input_role])) for p in item], dtype=torch.float32)
                sink.write(self.input_scale.name, e * 4 * parts, scales)
            tick(sum(o.nbytes for o in self.outputs) // n)  # this item's share of every output (the bar's total)
        self._record()

    def _where(self, e: int) -> str:
        return f"expert {e} of {self.prefix}" if self.stacked else self.prefix

    def _record(self) -> None:
        if self.measured and not all(math.isfinite(v) for v in self.stats.result().values()):
            raise ValueError(f"the measured conversion error of {self.prefix} is {self.stats.result()}, not finite: "
                             "the source values overflow float32 (check its scale tensors)")
        lossless = self.fmt != "fp8" and self.inexact == 0 and not self.measured
        for spec in (self.weight, self.scale, self.alpha):
            spec.lossless = lossless
            if not lossless:
                spec.error = self.stats.result()
            if self.fmt != "fp8":
                spec.notes["inexact_blocks"] = self.inexact
            if self.fmt == "ct_nvfp4":
                spec.notes["inexact_alphas"] = self.inexact_alphas
                spec.notes["unrecoverable_global_scales"] = self.unrecoverable_global_scales
