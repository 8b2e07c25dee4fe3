"""Units of conversion: groups of source tensors converted together into format-1 outputs.

A unit knows, from source headers alone, every output tensor's name, dtype, shape and sources
(so the writer can lay out shard headers before converting), and how to produce the bytes
piece by piece: expert by expert for stacked tensors, a copied tensor in 4 MiB stretches. A piece
bounds the memory it needs; pieces run side by side on the converter's workers (``pipeline.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nvfp4_megamoe.kernels.fp8_nvfp4 import ValueHistogram
from nvfp4_megamoe.kernels.mxfp4 import dequantize_mxfp4
from nvfp4_megamoe.kernels.nvfp4 import BLOCK, dequantize_nvfp4
from nvfp4_megamoe.kernels.row_tiles import tile_rows
from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes
from nvfp4_megamoe.runtime.format import ROW_TILES_STEP, alpha_shape, fused_expert_names

from .safetensors_header import DTYPES
from .source import E2M1_MAX, E4M3_MAX
from .value_screen import ValueScreen
from .stats import ErrorStats, StatsLog
from .timing import stage
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
    def read_piece(self, name: str, at: int, count: int, *, element_max: float | None = None,
                   index_limit: int | None = None) -> tuple[torch.Tensor, ValueScreen]: ...


class Sink(Protocol):
    def write(self, name: str, offset: int, data: torch.Tensor) -> None: ...


# A byte range of an output tensor: (output name, offset into it, bytes).
Filled = tuple[str, int, int]


class Unit(Protocol):
    """Converts its sources into its outputs in pieces (experts, or stretches of a copied tensor) that run in any
    order, on any thread, each writing its own byte ranges; :meth:`finish` then takes the pieces' results in piece
    order, so what a unit records does not depend on the order or the threads its pieces ran on."""

    key: str
    sources: list[str]
    outputs: list[OutputSpec]

    def pieces(self) -> int: ...
    def filled(self, k: int) -> list[Filled]: ...
    def run_piece(self, src: Reader, sink: Sink, k: int, device: torch.device) -> object: ...
    def finish(self, results: list) -> None: ...


def run_unit(unit: Unit, src: Reader, sink: Sink, device: torch.device | str = "cpu") -> None:
    """All of a unit's pieces, in order, on this thread (what the converter's workers do, spread over threads)."""
    unit.finish([unit.run_piece(src, sink, k, torch.device(device)) for k in range(unit.pieces())])


def _scalar(t: torch.Tensor) -> float:
    return float(t.float().reshape(-1)[0])


# Bytes of a copied tensor read, checked and written as one piece (a multiple of every element size).
COPY_PIECE = 4 << 20


@dataclass
class Passthrough:
    """A tensor copied byte for byte in pieces of :data:`COPY_PIECE`, each checked as it is read
    (:meth:`Reader.read_piece`: no NaN/Inf; ``element_max`` for the block scales of an FP8 linear kept as it is,
    ``index_limit`` for a hash layer's ``tid2eid``); what the pieces found is refused once all are in."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    element_max: float | None = None
    index_limit: int | None = None

    def __post_init__(self) -> None:
        self.key = self.name
        self.sources = [self.name]
        self.outputs = [OutputSpec(self.name, self.dtype, self.shape, [self.name], ["copy"])]

    def pieces(self) -> int:
        return max(1, -(-self.outputs[0].nbytes // COPY_PIECE))

    def filled(self, k: int) -> list[Filled]:
        return [(self.name, k * COPY_PIECE, min(COPY_PIECE, self.outputs[0].nbytes - k * COPY_PIECE))]

    def run_piece(self, src: Reader, sink: Sink, k: int, device: torch.device) -> ValueScreen:
        _, at, count = self.filled(k)[0]
        data, screen = src.read_piece(self.name, at, count, element_max=self.element_max,
                                      index_limit=self.index_limit)
        sink.write(self.name, at, data)
        return screen

    def finish(self, results: list[ValueScreen]) -> None:
        screen = results[0]
        for later in results[1:]:
            screen.merge(later)
        screen.finish()


@dataclass
class ItemResult:
    """What converting one item (expert) of a :class:`FusedMatrices` measured."""

    inexact_blocks: int = 0
    stats: StatsLog | None = None  # the error measured against the float source, when the result may be inexact
    inexact_alphas: int = 0  # compressed-tensors: halves whose alpha is not exactly 1 / global scale
    unrecoverable_global_scales: int = 0


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

    def pieces(self) -> int:
        return len(self.members)

    def filled(self, e: int) -> list[Filled]:
        """Item ``e``'s share of each output: every output holds its items back to back."""
        n = len(self.members)
        return [(o.name, e * (o.nbytes // n), o.nbytes // n) for o in self.outputs]

    def convert_item(self, src: Reader, item: list[dict[str, str]], found: ItemResult, device: torch.device
                     ) -> tuple[KernelMatrix, list[torch.Tensor] | list[ValueHistogram] | None]:
        """Forward transform of one item on ``device`` (the FP8 and MXFP4 numerics; the rest moves bytes on the
        CPU); also returns, when the result may be inexact, what its error is measured against
        (:func:`~.transforms.measure_error`)."""
        if self.fmt == "mxfp4":
            w = [src.read(p["weight"]) for p in item]
            s = [src.read(p["scale"], E2M1_MAX) for p in item]
            with stage("convert"):
                m = mxfp4_forward(w, s, device)
            return m, ([dequantize_mxfp4(a, b) for a, b in zip(w, s)] if m.inexact_blocks else None)
        if self.fmt == "nvfp4":
            w = [src.read(p["weight"]) for p in item]
            s = [src.read(p["weight_scale"]) for p in item]
            a = [_scalar(src.read(p["weight_scale_2"])) for p in item]
            with stage("convert"):
                m = nvfp4_forward(w, s, a)
            ref = [dequantize_nvfp4(x.view(torch.uint8), y.view(torch.uint8), z) for x, y, z in zip(w, s, a)]
            return m, (ref if m.inexact_blocks else None)
        if self.fmt == "ct_nvfp4":
            w = [src.read(p["weight_packed"]) for p in item]
            s = [src.read(p["weight_scale"]) for p in item]
            gs = [_scalar(src.read(p["weight_global_scale"])) for p in item]
            with stage("convert"):
                m = ct_nvfp4_forward(w, s, gs)
            exact = all(ct_alpha_is_exact(g) for g in gs)
            found.inexact_alphas += sum(not ct_alpha_is_exact(g) for g in gs)
            found.unrecoverable_global_scales += sum(ct_alpha(a) != g for a, g in zip(m.alphas, gs))
            return m, (None if exact else [dequantize_ct_nvfp4(x, y, g) for x, y, g in zip(w, s, gs)])
        w = [src.read(p["weight"]) for p in item]
        s = [src.read(p["scale"], E4M3_MAX) for p in item]
        with stage("convert"):
            return fp8_forward(w, s, shared_alpha=not self.stacked, device=device)

    def run_piece(self, src: Reader, sink: Sink, e: int, device: torch.device) -> ItemResult:
        found = ItemResult()
        item = self.members[e]
        m, ref = self.convert_item(src, item, found, device)
        if not all(math.isfinite(a) and a > 0 for a in m.alphas):
            raise ValueError(f"the global scale (alpha) of {self._where(e)} comes out as {list(m.alphas)}; the "
                             "source values overflow or vanish in float32 (check its scale tensors)")
        found.inexact_blocks = m.inexact_blocks
        if ref is not None:
            found.stats = StatsLog()
            with stage("measure"):
                measure_error(found.stats, m, ref)
        (weight, w_at, _), (scale, s_at, _), (alpha, a_at, _), *inputs = self.filled(e)
        with stage("convert"):
            packed = tile_rows(m.packed) if self.row_tiles else m.packed
        sink.write(weight, w_at, packed)
        sink.write(scale, s_at, m.scales)
        sink.write(alpha, a_at, torch.tensor(m.alphas[: self.alphas_per_item], dtype=torch.float32))
        for name, at, _ in inputs:
            sink.write(name, at, torch.tensor([_scalar(src.read(p[self.input_role])) for p in item],
                                              dtype=torch.float32))
        return found

    def finish(self, results: list[ItemResult]) -> None:
        """Sum the items' measurements in item order and record them on the outputs."""
        stats = ErrorStats()
        for r in results:
            if r.stats is not None:
                stats.replay(r.stats)
        inexact = sum(r.inexact_blocks for r in results)
        measured = any(r.stats is not None for r in results)
        if measured and not all(math.isfinite(v) for v in stats.result().values()):
            raise ValueError(f"the measured conversion error of {self.prefix} is {stats.result()}, not finite: "
                             "the source values overflow float32 (check its scale tensors)")
        lossless = self.fmt != "fp8" and inexact == 0 and not measured
        for spec in (self.weight, self.scale, self.alpha):
            spec.lossless = lossless
            if not lossless:
                spec.error = stats.result()
            if self.fmt != "fp8":
                spec.notes["inexact_blocks"] = inexact
            if self.fmt == "ct_nvfp4":
                spec.notes["inexact_alphas"] = sum(r.inexact_alphas for r in results)
                spec.notes["unrecoverable_global_scales"] = sum(r.unrecoverable_global_scales for r in results)

    def _where(self, e: int) -> str:
        return f"expert {e} of {self.prefix}" if self.stacked else self.prefix
