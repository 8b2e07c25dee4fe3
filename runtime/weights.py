"""Typed weights of a DeepSeek-V4 model, built straight from a format-1 checkpoint.

Nothing is converted at load: NVFP4 tensors stay packed (uint8 codes, swizzled E4M3 scale
bytes, float32 alpha), FP8 linears stay FP8 with their block scales, BF16/F32 tensors stay as
stored. Only the bytes a caller asks for are read: a subset of layers, and per layer a
contiguous range of routed experts (expert parallelism). The router weights, bias and
``tid2eid`` are always read whole, since routing needs every expert's score.

Which kind a linear ``X`` is follows from the names present (docs/format.md):

* ``X.weight`` U8 + ``X.weight_scale`` + ``X.alpha``  -> :class:`Nvfp4Linear`
* ``X.weight`` F8_E4M3 + ``X.scale`` (E8M0 or F32)    -> :class:`Fp8Linear`
* ``X.weight`` BF16/F32                               -> :class:`DenseLinear`

Every tensor is checked before it is used: its dtype and shape against the format and config.json
(the table of ``runtime/expected.py``, which the converter checks sources against too), every alpha
finite and positive, every ``tid2eid`` entry an expert index. A checkpoint that disagrees is refused
with a :class:`FormatError` naming the tensor, not run into a wrong answer or a deep torch error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from nvfp4_megamoe.errors import shown
from nvfp4_megamoe.kernels.nvfp4 import BLOCK
from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes

from .checkpoint import Checkpoint
from .config import ModelConfig
from .expected import FLOAT, FP8_SCALES, fp8_scale_shape, model_tensors
from .format import FormatError, alpha_shape, fp8_linear_names, fused_expert_names, has_row_tiles, nvfp4_linear_names
from .gpu_upload import GpuUploader


@dataclass
class DenseLinear:
    """A plain BF16/F32 weight [out, in] (compressor, indexer ``weights_proj``, router gate, head)."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclass
class Fp8Linear:
    """FP8 E4M3 weight [out, in] with 128x128 block scales (E8M0 bytes or F32)."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclass
class Nvfp4Linear:
    """NVFP4 weight in format 1: codes U8 [out, in/2], swizzled E4M3 scale bytes, alpha F32 []."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    alpha: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


Linear = DenseLinear | Fp8Linear | Nvfp4Linear


@dataclass
class CompressorWeights:
    wkv: DenseLinear
    wgate: DenseLinear
    ape: torch.Tensor   # [ratio, C]
    norm: torch.Tensor  # [d]


@dataclass
class IndexerWeights:
    wq_b: Linear
    weights_proj: DenseLinear
    compressor: CompressorWeights


@dataclass
class AttentionWeights:
    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    wo_a: Linear          # grouped: [o_groups * o_lora_rank, heads * head_dim / o_groups]
    wo_b: Linear
    sink: torch.Tensor    # [heads]
    compress_ratio: int
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None


@dataclass
class SharedExpertWeights:
    """The shared expert: either fused ``w13`` (NVFP4, gate/up interleaved by 8) or separate w1/w3."""

    w2: Linear
    w13: Nvfp4Linear | None = None
    w1: Linear | None = None
    w3: Linear | None = None


@dataclass
class MoEWeights:
    """Routed experts ``[start, stop)`` of one layer, stacked and packed as the grouped kernel takes them.

    ``w13`` U8 [n, 2I, H/2] (gate/up interleaved by 8), ``w13_scale`` U8 [n, swz(2I, H/16)],
    ``w13_alpha`` F32 [n, 2] (gate, up); ``w2`` U8 [n, H, I/2], ``w2_scale``, ``w2_alpha`` F32 [n].
    ``row_tiles``: ``w13`` and ``w2`` hold those bytes in Hopper row tiles (``kernels/row_tiles.py``, a
    ``--target sm90`` conversion; the reference path un-tiles each expert it uses as it decodes it).
    """

    gate: DenseLinear                 # router [E, H], all experts
    bias: torch.Tensor | None         # [E] selection bias (score-routed layers)
    tid2eid: torch.Tensor | None      # [V, k] (hash layers)
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_alpha: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_alpha: torch.Tensor
    expert_range: tuple[int, int]
    n_experts: int
    shared: SharedExpertWeights
    row_tiles: bool = False

    @property
    def is_hash(self) -> bool:
        return self.tid2eid is not None


@dataclass
class HcWeights:
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass
class LayerWeights:
    index: int
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HcWeights
    hc_ffn: HcWeights
    attn: AttentionWeights
    moe: MoEWeights


def same_input_linears(lw: LayerWeights) -> list[tuple[Linear, ...]]:
    """The linears of a layer that read one input, in the groups the forward hands the backend at once
    (``Backend.linears``), so that a backend may run a group as one weight: the attention's ``wq_a`` and ``wkv``
    (the sublayer's normed input), a compressed layer's compressor ``wkv`` and ``wgate`` with, on CSA layers, the
    indexer's compressor ``wkv`` and ``wgate`` and its ``weights_proj`` (the same input), and the shared expert's
    ``w1`` and ``w3``."""
    a, shared = lw.attn, lw.moe.shared
    groups = [(a.wq_a, a.wkv), compressor_linears(a)]
    if shared.w1 is not None:
        groups.append((shared.w1, shared.w3))
    return [g for g in groups if g]


def compressor_linears(a: AttentionWeights) -> tuple[Linear, ...]:
    """A compressed layer's linears of its normed input (empty on a sliding-window layer): the compressor's
    ``wkv``, ``wgate``, then on CSA layers the indexer's compressor ``wkv``, ``wgate`` and ``weights_proj``."""
    if a.compressor is None:
        return ()
    found = (a.compressor.wkv, a.compressor.wgate)
    if a.indexer is not None:
        ix = a.indexer
        found += (ix.compressor.wkv, ix.compressor.wgate, ix.weights_proj)
    return found


@dataclass
class ModelWeights:
    embed: torch.Tensor   # [V, H] as stored (BF16)
    head: DenseLinear
    norm: torch.Tensor
    hc_head: HcWeights
    layers: dict[int, LayerWeights] = field(default_factory=dict)


# smaller tensors (norms, alphas, the mHC and compressor weights) are copied as they are read: a chunk of their own
# would cost more than it saves
UPLOAD_MIN_BYTES = 1 << 20


class WeightLoader:
    """Builds the typed weights from a :class:`Checkpoint` onto ``device``, checking each tensor first."""

    def __init__(self, ckpt: Checkpoint, config: ModelConfig, device: torch.device | str = "cpu"):
        self.ckpt, self.config, self.device = ckpt, config, torch.device(device)
        self.expected = model_tensors(config)
        self._uploader: GpuUploader | None = None   # while ``model`` loads onto a GPU

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or its ``rows``) on the device: on a GPU, past ``UPLOAD_MIN_BYTES``, read from its shard
        into pinned memory and copied asynchronously (``gpu_upload``)."""
        if self._uploader is not None:
            where = self.ckpt.byte_range(name, rows)
            if where.nbytes >= UPLOAD_MIN_BYTES:
                self.ckpt.bytes_read += where.nbytes   # smaller ones are counted by ``read``, below
                return self._uploader.upload(where.path, where.offset, where.nbytes, where.shape, where.dtype)
        return self.ckpt.read(name, rows).to(self.device)

    # the value checks below run on the tensor as read, before it moves: on a GPU each would wait for the device

    def check(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> None:
        """Refuse ``name`` unless it is stored as one of ``dtypes`` with exactly ``shape``."""
        dtype, got = self.ckpt.dtype(name), tuple(self.ckpt.shape(name))
        if dtype not in dtypes or got != tuple(shape):
            raise FormatError(f"{self.ckpt.path}: {shown(name)} is {dtype} {list(got)}; the format and config.json "
                              f"imply {'/'.join(dtypes)} {list(shape)}. The checkpoint does not match its config.json: "
                              "convert the source again.", path=self.ckpt.path, tensor=name)

    def stored(self, name: str, float32: bool = False) -> torch.Tensor:
        """A tensor stored as it is in the source (norms, mHC, sinks, compressors, router, embedding, head); with
        ``float32``, converted to float32 on the host before it moves (a conversion on the GPU could read a tensor
        whose upload is still on its way: ``gpu_upload`` copies on a stream of its own until the load's end)."""
        spec = self.expected.tensors[name]
        self.check(name, spec.dtypes, spec.shape)
        if spec.index_limit is None and not float32:
            return self.tensor(name)
        t = self.ckpt.read(name)
        if float32:
            t = t.float()
        if spec.index_limit is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= spec.index_limit):
            raise FormatError(f"{self.ckpt.path}: {shown(name)} holds expert indices outside [0, {spec.index_limit}) "
                              f"(min {int(t.min())}, max {int(t.max())}); convert the source again.",
                              path=self.ckpt.path, tensor=name)
        return t.to(self.device)

    def alphas(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """An NVFP4 global scale tensor, float32, every value finite and positive."""
        a = self.ckpt.read(name, rows).float()
        bad = ~(torch.isfinite(a) & (a > 0))
        if bool(bad.any()):
            raise FormatError(f"{self.ckpt.path}: {shown(name)} holds {int(bad.sum())} alphas that are not finite and "
                              f"positive (first {a.reshape(-1)[bad.reshape(-1)][0].item()!r}); the checkpoint is "
                              "corrupt: convert the source again.", path=self.ckpt.path, tensor=name)
        return a.to(self.device)

    def linear(self, prefix: str, shape: tuple[int, int] | None = None) -> Linear:
        """Linear ``prefix`` of logical ``shape`` [out, in] (the table's when None), in whichever form it is stored."""
        ck = self.ckpt
        out, inp = shape if shape is not None else self.expected.linears[prefix]
        nv, fp8 = nvfp4_linear_names(prefix), fp8_linear_names(prefix)
        if nv["alpha"] in ck and nv["weight_scale"] in ck:
            self.check(nv["weight"], ("U8",), (out, inp // 2))
            self.check(nv["weight_scale"], ("U8",), (swizzled_nbytes(out, inp // BLOCK),))
            self.check(nv["alpha"], ("F32",), alpha_shape(prefix, ()))
            return Nvfp4Linear(self.tensor(nv["weight"]), self.tensor(nv["weight_scale"]), self.alphas(nv["alpha"]))
        if fp8["scale"] in ck:
            self.check(fp8["weight"], ("F8_E4M3",), (out, inp))
            self.check(fp8["scale"], FP8_SCALES, fp8_scale_shape(out, inp))
            return Fp8Linear(self.tensor(fp8["weight"]), self.tensor(fp8["scale"]))
        self.check(f"{prefix}.weight", FLOAT, (out, inp))
        return DenseLinear(self.tensor(f"{prefix}.weight"))

    def hc(self, fn: str, base: str, scale: str) -> HcWeights:
        return HcWeights(self.stored(fn, float32=True), self.stored(base, float32=True),
                         self.stored(scale, float32=True))

    def compressor(self, prefix: str) -> CompressorWeights:
        return CompressorWeights(DenseLinear(self.stored(f"{prefix}.wkv.weight")),
                                 DenseLinear(self.stored(f"{prefix}.wgate.weight")),
                                 self.stored(f"{prefix}.ape", float32=True), self.stored(f"{prefix}.norm.weight"))

    def attention(self, p: str, ratio: int) -> AttentionWeights:
        attn = AttentionWeights(
            wq_a=self.linear(f"{p}.wq_a"), q_norm=self.stored(f"{p}.q_norm.weight"), wq_b=self.linear(f"{p}.wq_b"),
            wkv=self.linear(f"{p}.wkv"), kv_norm=self.stored(f"{p}.kv_norm.weight"),
            wo_a=self.linear(f"{p}.wo_a"), wo_b=self.linear(f"{p}.wo_b"),
            sink=self.stored(f"{p}.attn_sink", float32=True), compress_ratio=ratio)
        if ratio:
            attn.compressor = self.compressor(f"{p}.compressor")
        if ratio == 4:
            attn.indexer = IndexerWeights(self.linear(f"{p}.indexer.wq_b"),
                                          DenseLinear(self.stored(f"{p}.indexer.weights_proj.weight")),
                                          self.compressor(f"{p}.indexer.compressor"))
        return attn

    def moe(self, p: str, experts: tuple[int, int] | None) -> MoEWeights:
        cfg, ck = self.config, self.ckpt
        n = cfg.n_routed_experts
        start, stop = experts if experts is not None else (0, n)
        if not (0 <= start < stop <= n):
            raise ValueError(f"experts=({start}, {stop}) is not a non-empty range inside [0, {n})")
        rows = None if (start, stop) == (0, n) else (start, stop)
        w13 = fused_expert_names(f"{p}.experts", "w13")
        w2 = fused_expert_names(f"{p}.experts", "w2")
        for name in (w13["weight"], w2["weight"]):
            if name not in ck:
                raise FormatError(f"{ck.path}: {name} is missing; routed experts must be stacked NVFP4 "
                                  f"(format 1). Was this folder written by `nvfp4-convert convert`?")
        tiled = [has_row_tiles(ck.manifest, name) for name in (w13["weight"], w2["weight"])]
        if tiled[0] != tiled[1]:
            raise FormatError(f"{ck.path}: the manifest has {w13['weight']} {'in' if tiled[0] else 'not in'} row tiles "
                              f"but {w2['weight']} {'in' if tiled[1] else 'not in'}; re-convert the checkpoint")
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        if h % BLOCK or i % BLOCK:
            raise FormatError(f"{ck.path}: config.json's hidden_size {h} and moe_intermediate_size {i} must be "
                              f"multiples of {BLOCK} for NVFP4 experts")
        shared_rows = self.expected.linears[f"{p}.shared_experts.w1"][0]
        if f"{p}.shared_experts.w13.weight" in ck:
            shared = SharedExpertWeights(w2=self.linear(f"{p}.shared_experts.w2"),
                                         w13=self.linear(f"{p}.shared_experts.w13", (2 * shared_rows, h)))
        else:
            shared = SharedExpertWeights(w2=self.linear(f"{p}.shared_experts.w2"),
                                         w1=self.linear(f"{p}.shared_experts.w1"),
                                         w3=self.linear(f"{p}.shared_experts.w3"))
        for names, (out_rows, in_cols) in ((w13, (2 * i, h)), (w2, (h, i))):
            self.check(names["weight"], ("U8",), (n, out_rows, in_cols // 2))
            self.check(names["weight_scale"], ("U8",), (n, swizzled_nbytes(out_rows, in_cols // BLOCK)))
            self.check(names["alpha"], ("F32",), alpha_shape(names["alpha"][: -len(".alpha")], (n,)))
        hashed = f"{p}.gate.tid2eid" in self.expected.tensors
        weights = MoEWeights(
            gate=DenseLinear(self.stored(f"{p}.gate.weight")),
            bias=None if hashed else self.stored(f"{p}.gate.bias", float32=True),
            tid2eid=self.stored(f"{p}.gate.tid2eid") if hashed else None,
            w13=self.tensor(w13["weight"], rows), w13_scale=self.tensor(w13["weight_scale"], rows),
            w13_alpha=self.alphas(w13["alpha"], rows),
            w2=self.tensor(w2["weight"], rows), w2_scale=self.tensor(w2["weight_scale"], rows),
            w2_alpha=self.alphas(w2["alpha"], rows),
            expert_range=(start, stop), n_experts=n, shared=shared, row_tiles=tiled[0])
        return weights

    def layer(self, i: int, experts: tuple[int, int] | None) -> LayerWeights:
        p = f"layers.{i}"
        return LayerWeights(
            index=i, attn_norm=self.stored(f"{p}.attn_norm.weight"), ffn_norm=self.stored(f"{p}.ffn_norm.weight"),
            hc_attn=self.hc(f"{p}.hc_attn_fn", f"{p}.hc_attn_base", f"{p}.hc_attn_scale"),
            hc_ffn=self.hc(f"{p}.hc_ffn_fn", f"{p}.hc_ffn_base", f"{p}.hc_ffn_scale"),
            attn=self.attention(f"{p}.attn", self.config.compress_ratios[i]),
            moe=self.moe(f"{p}.ffn", experts))

    def model(self, layers: list[int] | None, experts: tuple[int, int] | None,
              while_copying: Callable[[ModelWeights], None] | None = None) -> ModelWeights:
        """The weights of ``layers`` (all: None) and routed experts ``experts`` (all: None). On a GPU the large
        tensors' copies run in the background until every tensor is read; ``while_copying`` is then called with the
        weights (their shapes final, their values possibly still on the way: ``load_model`` starts the kernel
        compiles there), and the copies are waited for before this returns."""
        n = self.config.num_layers
        chosen = list(range(n)) if layers is None else sorted(set(layers))
        bad = [i for i in chosen if not 0 <= i < n]
        if bad:
            raise ValueError(f"layers {bad} outside [0, {n})")
        with self._uploads():
            weights = ModelWeights(embed=self.stored("embed.weight"), head=DenseLinear(self.stored("head.weight")),
                                   norm=self.stored("norm.weight"),
                                   hc_head=self.hc("hc_head_fn", "hc_head_base", "hc_head_scale"))
            for i in chosen:
                weights.layers[i] = self.layer(i, experts)
            if while_copying is not None:
                while_copying(weights)
        return weights

    @contextlib.contextmanager
    def _uploads(self) -> Iterator[None]:
        """On a GPU, the block's large tensors go through one :class:`GpuUploader`, every copy done at its end."""
        if self.device.type != "cuda":
            yield
            return
        self._uploader = GpuUploader(self.device)
        try:
            yield
        finally:
            uploader, self._uploader = self._uploader, None
            uploader.finish()
