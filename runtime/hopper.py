"""The Hopper (sm_90a) backend: CuTeDSL kernels from ``kernels/`` where a layer's shape allows,
the PyTorch references everywhere else.

* routed experts: :class:`~nvfp4_megamoe.kernels.sm90_moe.Sm90Nvfp4Moe` (W4A16: activations
  rounded to BF16, weights decoded in registers, fp32 accumulation);
* decode attention: :func:`~nvfp4_megamoe.kernels.sm90_decode_attention.sm90_decode_attention`
  (head_dim 512, heads a multiple of 64), BF16 operands;
* a decode step's query and key before it (``step_qkv``: the query's per-head RMSNorm, the key's RMSNorm, RoPE of
  both, the key into its ring row, the query in BF16 for the attention kernel):
  :func:`~nvfp4_megamoe.kernels.sm90_qkv_step.sm90_qkv_step`, one launch a layer for every slot instead of about 7;
* decode indexer top-k of CSA layers (``kernels/sm90_indexer.py``): the fused score kernel where the index
  heads/dims tile (else the torch composition of ``kernels/indexer_keys.py``), then the sort kernel, with segment
  passes beyond 4,096 entries, or ``torch.topk`` where the sort does not pay (``sm90_heuristics``); every size
  compiled at the first call; BF16 query and keys;
* the decode state (ring, compressed entries, indexer keys) is kept in BF16 (``state_dtype``), the
  dtype these kernels read, so no step converts it;
* the router after its linear (``route``): :func:`~nvfp4_megamoe.kernels.sm90_router.sm90_route`, one launch (a warp a
  token) for the scores, the biased top-k or the hash layer's experts and the renormalised weights (about ten torch
  launches a layer); every scoring function, E up to 512, k up to 32;
* mHC before each sublayer (``hc_pre``): :func:`~nvfp4_megamoe.kernels.sm90_mhc.sm90_hc_pre`, the product by
  ``fn`` and one launch for the RMS norm, the sigmoids, softmax and Sinkhorn rounds, the collapse and the
  sublayer's own RMSNorm (about 160 torch calls per reference ``hc_pre``, and the norm's launch);
* dense NVFP4 linears (attention projections, shared experts, ``wo_a`` with all its groups in one launch):
  :func:`~nvfp4_megamoe.kernels.sm90_nvfp4_linear.sm90_nvfp4_linear` (W4A16, float32 out) where it tiles the
  weight (``can_implement``; ``wo_a``: 128-row groups, so each group's scales are whole swizzle atoms);
* dense FP8 linears (``--dense keep``: E4M3 with 128 x 128 block scales, as released):
  :func:`~nvfp4_megamoe.kernels.sm90_fp8_linear.sm90_fp8_linear` (W8A16, float32 out, ``wo_a`` in one launch) where
  it tiles the weight; BF16 linears stay on the reference.
* RMSNorm: the reference's float32 formula as one ``F.rms_norm`` launch, each weight's float32 copy made once.
* BF16 dense linears: small ones (compressor, router, indexer ``weights_proj``) against a float32 copy made once, the
  head in BF16 with float32 accumulation and out; the compressors' softmax over the window's slots as a last-axis
  softmax (prefill chunks);
* a decode step's compressor update (``compress_step``: the token into the pending window, the pooling, RMSNorm,
  RoPE, the BF16 entry and the overlap half): :func:`~nvfp4_megamoe.kernels.sm90_compressor.sm90_compress_step`, one
  launch per compressor for every slot instead of about 20 torch calls, a slot's channels over a cluster of CTAs
  (``sm90_heuristics.compress_step_config``).

Each op asks its kernel's ``can_implement`` and runs the reference where the answer is no: this module is the
one place that chooses between a kernel and the reference.

``load_model(..., device="cuda")`` picks this backend on an sm_90 GPU. Kernels are compiled at
load (:meth:`HopperBackend.warmup`) so the first forward does not pay for compilation.
"""

from __future__ import annotations

import importlib.util
import time

import torch
import torch.nn.functional as F

from .backend import ReferenceBackend
from .state import CompressorState
from .weights import DenseLinear, Fp8Linear, Linear, ModelWeights, MoEWeights, Nvfp4Linear, same_input_linears

# Largest token count one MoE kernel call takes; longer inputs are processed in chunks of it.
MAX_MOE_TOKENS = 4096
# Token counts of the warm-up forwards (a decode step, a mid tile, the WGMMA prefill path): what a first call of each
# sets up (kernels loaded from the disk cache, torch's own kernels and handles) is done at load.
WARMUP_TOKENS = (1, 16, 256)
# BF16 dense weights (compressor, router gate, indexer weights_proj) up to this size have a float32 copy made once, as
# the reference computes; larger ones (the head) run BF16 x BF16 with float32 out rather than write a float32 copy of
# themselves at every call (2x their bytes, the largest share of a small decode step before).
F32_COPY_MAX_BYTES = 32 << 20


def hopper_available(device: str | torch.device) -> bool:
    """True on an sm_90 CUDA device with CuTeDSL importable."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return False
    # found, not imported: the import (about 0.5 s) is left to the kernels, after load_model has started its workers
    return importlib.util.find_spec("cutlass") is not None


class HopperBackend(ReferenceBackend):
    """Reference backend with the sm_90a kernels plugged in (see the module docstring)."""

    name = "sm90"
    # the dtype the decode kernels read: a step converts nothing (a float32 cache was converted whole,
    # every step and layer, where CSA attention reads only its top-k entries)
    state_dtype = torch.bfloat16

    def __init__(self, max_tokens: int = MAX_MOE_TOKENS):
        self.max_tokens = max_tokens
        self._moe_layers: dict[tuple, object] = {}
        self._linear_fits: dict[tuple, bool] = {}
        self._indexer_ready: set[tuple] = set()
        self._f32_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id -> (weight, its float32 copy)
        self._fp8_scales_fit: dict[int, tuple[torch.Tensor, bool]] = {}        # id -> (FP8 block scales, taken?)
        # ids of a group of one input's linears -> (the group's linears, one weight of them all, their widths)
        self._fused: dict[tuple[int, ...], tuple[tuple[Linear, ...], Linear, list[int]]] = {}
        self.kernel_calls = {"moe": 0, "decode_attention": 0, "linear": 0, "indexer": 0, "hc_pre": 0,
                             "hc_post": 0, "compress_step": 0, "route": 0, "step_qkv": 0, "prefill_attention": 0}
        self.warmup_seconds: float | None = None
        self.compiled_at_warmup: int | None = None  # kernels the last warm-up compiled (not found in a cache)
        self.compile_report: list = []  # the last warm-up's worker compiles (``compile_workers.Compiled``)
        self.warmup_phases: dict[str, float] = {}   # the last warm-up's seconds: waiting for kernels, forwards
        self._pending = None   # compiles started by ``start_warmup``
        self._pool = None      # workers started by ``start_workers``, not yet given their jobs

    # -- dense NVFP4 linears ------------------------------------------------------------------------------------
    def _linear_ready(self, n: int, k: int, device: torch.device, groups: int = 1) -> bool:
        """Whether the dense kernel tiles ``groups`` W [n, k]; the first time it does, compiles all its configurations."""
        from nvfp4_megamoe.kernels import sm90_nvfp4_linear

        key = (n, k, groups, str(device))
        if key not in self._linear_fits:
            self._linear_fits[key] = sm90_nvfp4_linear.can_implement(n, k, groups)
            if self._linear_fits[key]:
                sm90_nvfp4_linear.warmup(n, k, device, groups=groups)
        return self._linear_fits[key]

    def _fp8_ready(self, w: Fp8Linear, groups: int, device: torch.device, *, shapes_only: bool = False) -> bool:
        """Whether the FP8 kernel tiles ``groups`` W of ``w`` (the first time it does, compiles its configurations) and
        takes its block scales (read once per weight, unless ``shapes_only``: the warm-up, before the bytes are in)."""
        from nvfp4_megamoe.kernels import sm90_fp8_linear

        n, k = w.weight.shape[0] // groups, w.weight.shape[1]
        scale_dtype = torch.float32 if w.scale.dtype == torch.float32 else torch.uint8
        key = ("fp8", n, k, groups, scale_dtype, str(device))
        if key not in self._linear_fits:
            self._linear_fits[key] = sm90_fp8_linear.can_implement(n, k, groups)
            if self._linear_fits[key]:
                sm90_fp8_linear.warmup(n, k, device, scale_dtype=scale_dtype, groups=groups)
        if shapes_only or not self._linear_fits[key]:
            return self._linear_fits[key]
        return self._per_tensor(self._fp8_scales_fit, w.scale, sm90_fp8_linear.scales_fit)

    def _fp8_linear(self, x: torch.Tensor, w: Fp8Linear, groups: int) -> torch.Tensor:
        """x [..., G * K] (G = ``groups``) -> float32 [..., G * N] by the FP8 kernel (``_fp8_ready`` said yes)."""
        from nvfp4_megamoe.kernels.sm90_fp8_linear import sm90_fp8_linear

        # float32 x as it is: decode calls' kernel rounds it to BF16 as it reads it (a cast launch saved per call);
        # sm90_fp8_linear casts it for longer ones
        xb = x.reshape(-1, w.weight.shape[1] * groups).float().contiguous()
        out = sm90_fp8_linear(xb, w.weight, w.scale, out_dtype=torch.float32, groups=groups)
        self.kernel_calls["linear"] += 1
        return out

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        from nvfp4_megamoe.kernels.sm90_nvfp4_linear import sm90_nvfp4_linear

        if isinstance(w, DenseLinear) and x.is_cuda and w.weight.dtype == torch.bfloat16:
            return self._bf16_linear(x, w.weight)
        if isinstance(w, Fp8Linear) and x.is_cuda and x.numel() and self._fp8_ready(w, 1, x.device):
            return self._fp8_linear(x, w, 1).view(*x.shape[:-1], w.weight.shape[0])
        if not (isinstance(w, Nvfp4Linear) and x.is_cuda and x.numel()):
            return super().linear(x, w)
        n, k = w.weight.shape[0], 2 * w.weight.shape[1]
        if not self._linear_ready(n, k, x.device):
            return super().linear(x, w)
        xb = x.reshape(-1, k).to(torch.bfloat16).contiguous()
        out = sm90_nvfp4_linear(xb, w.weight, w.weight_scale, w.alpha, out_dtype=torch.float32)
        self.kernel_calls["linear"] += 1
        return out.view(*x.shape[:-1], n)

    # -- linears of one input -----------------------------------------------------------------------------------
    def linears(self, x: torch.Tensor, ws: tuple[Linear, ...]) -> list[torch.Tensor]:
        """A group :meth:`fuse_same_input` made one weight of: one call, its output's columns handed back as views
        (a decode step launches fewer, larger linears); any other group as the reference does it."""
        hit = self._fused.get(tuple(id(w) for w in ws))
        if hit is None or any(m is not w for m, w in zip(hit[0], ws)) or not x.is_cuda:
            return super().linears(x, ws)
        _, weight, widths = hit
        return list(self.linear(x, weight).split(widths, dim=-1))

    def fuse_same_input(self, weights: ModelWeights) -> int:
        """Make one weight of each group of ``weights.same_input_linears`` that :func:`fused_kind` allows; returns
        how many. FP8 groups are concatenated (rows, and their block-scale rows) and their linears become views of
        the result, so the model holds their bytes once; BF16 groups of small weights (which run against a float32
        copy, ``F32_COPY_MAX_BYTES``) get one float32 copy of them all instead of one each."""
        made = 0
        for lw in weights.layers.values():
            for group in same_input_linears(lw):
                kind = fused_kind(group)
                if kind is None or not group[0].weight.is_cuda:
                    continue
                if kind == "fp8":
                    fused = _concat_fp8(group)
                else:
                    fused = DenseLinear(torch.cat([w.weight.float() for w in group]))
                self._fused[tuple(id(w) for w in group)] = (group, fused, [w.out_features for w in group])
                made += 1
        return made

    def _bf16_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A BF16 dense weight: the reference's float32 product with the weight's float32 copy made once, or past
        ``F32_COPY_MAX_BYTES`` x rounded to BF16 and float32 accumulation and out (cuBLAS)."""
        if weight.numel() * 4 <= F32_COPY_MAX_BYTES:
            return x.float() @ self._f32(weight).T
        out = torch.mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), weight.T, out_dtype=torch.float32)
        return out.view(*x.shape[:-1], weight.shape[0])

    def grouped_linear(self, x: torch.Tensor, w: Linear, groups: int) -> torch.Tensor:
        from nvfp4_megamoe.kernels.sm90_nvfp4_linear import sm90_nvfp4_linear

        if isinstance(w, Fp8Linear) and x.is_cuda and x.numel() and self._fp8_ready(w, groups, x.device):
            return self._fp8_linear(x, w, groups).view(*x.shape[:-1], w.weight.shape[0] // groups)
        if not (isinstance(w, Nvfp4Linear) and x.is_cuda and x.numel()):
            return super().grouped_linear(x, w, groups)
        n, k = w.weight.shape[0], 2 * w.weight.shape[1]
        rows = n // groups
        if not self._linear_ready(rows, k, x.device, groups):
            return super().grouped_linear(x, w, groups)
        # one launch for every group: each token's row of x holds the groups' inputs side by side, as out their outputs
        xb = x.reshape(-1, groups * k).to(torch.bfloat16).contiguous()
        out = sm90_nvfp4_linear(xb, w.weight, w.weight_scale, w.alpha, out_dtype=torch.float32, groups=groups)
        self.kernel_calls["linear"] += 1
        return out.view(*x.shape[:-1], rows)

    # -- MoE ------------------------------------------------------------------------------------------------------
    def _moe_layer(self, experts: MoEWeights, top_k: int, swiglu_limit: float, device: torch.device):
        from nvfp4_megamoe.kernels import sm90_moe
        from nvfp4_megamoe.kernels.sm90_config import MoeShape

        n, two_i, half_h = experts.w13.shape
        # a rank holding part of the experts maps the pairs it does not hold to local expert 0 (weight 0), so one
        # token's pairs are no longer distinct experts (``MoeShape.distinct_experts``)
        shape = MoeShape(hidden=2 * half_h, intermediate=two_i // 2, experts=n, top_k=top_k, swiglu_limit=swiglu_limit,
                         weight_tiles=experts.row_tiles, distinct_experts=n == experts.n_experts)
        key = (shape, str(device))
        if key not in self._moe_layers:
            layer = None
            if sm90_moe.Sm90Nvfp4Moe.can_implement(shape, self.max_tokens):
                layer = sm90_moe.Sm90Nvfp4Moe(shape, self.max_tokens, device)
                layer.warmup()  # every plan up to max_tokens: no forward compiles
            self._moe_layers[key] = layer
        return self._moe_layers[key]

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights,
            swiglu_limit: float) -> torch.Tensor:
        layer = self._moe_layer(experts, ids.shape[1], swiglu_limit, x.device) if x.is_cuda else None
        if layer is None:
            return super().moe(x, ids, weights, experts, swiglu_limit)
        start, stop = experts.expert_range
        if (start, stop) == (0, experts.n_experts):   # every expert held: the ids are local as they are
            local_ids, local_w = ids.to(torch.int32).contiguous(), weights.float().contiguous()
        else:
            # Pairs routed to experts this rank does not hold get weight 0 (and a valid local id), so the
            # kernels' shapes and workspaces stay fixed: no host sync, graph-capturable.
            local = ids - start
            held = (local >= 0) & (local < stop - start)
            local_ids = torch.where(held, local, torch.zeros_like(local)).to(torch.int32).contiguous()
            local_w = torch.where(held, weights.float(), torch.zeros_like(weights, dtype=torch.float32)).contiguous()
        xb = x.to(torch.bfloat16).contiguous()
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        args = dict(w13=experts.w13, w13_scale=experts.w13_scale, w13_alpha=experts.w13_alpha,
                    w2=experts.w2, w2_scale=experts.w2_scale, w2_alpha=experts.w2_alpha)
        for s in range(0, x.shape[0], self.max_tokens):
            e = min(s + self.max_tokens, x.shape[0])
            layer(xb[s:e], local_ids[s:e], local_w[s:e], **args, out=out[s:e])
        self.kernel_calls["moe"] += 1
        return out

    # -- router ---------------------------------------------------------------------------------------------------
    def route(self, logits: torch.Tensor, func: str, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              token_ids: torch.Tensor, k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's ``route`` in one launch (``kernels/sm90_router.py``) where the kernels take the shape: ids
        int64 [T, k] in descending order of the (biased) scores, ties to the lower expert, and float32 weights."""
        from nvfp4_megamoe.kernels import sm90_router

        if not (logits.is_cuda and logits.dim() == 2 and sm90_router.can_implement(logits.shape[-1], k, func)
                and (tid2eid is None or (tid2eid.is_cuda and tid2eid.dim() == 2 and tid2eid.shape[1] == k
                                         and tid2eid.dtype in sm90_router.INDEX_DTYPES))):
            return super().route(logits, func, bias, tid2eid, token_ids, k, scaling)
        self.kernel_calls["route"] += 1
        return sm90_router.sm90_route(logits, func, bias, tid2eid, token_ids.reshape(-1), k, scaling)

    # -- compressor ------------------------------------------------------------------------------------------------
    def compress_windows(self, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, *, overlap: bool,
                         prev: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The reference's pooling, with its softmax over the slot axis taken as the last axis of the transposed
        gates on CUDA: torch's softmax over a middle axis took 25 us for one decode window of flash-layer."""
        from nvfp4_megamoe.kernels.compressor_reference import compress_windows

        return compress_windows(kv, gate, ape, overlap=overlap, prev=prev, slot_softmax_last=kv.is_cuda)

    def compress_step(self, kv: torch.Tensor, gate: torch.Tensor, cs: CompressorState, ape: torch.Tensor,
                      norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> None:
        """The reference's update in one launch (``sm90_compressor``) where the kernel takes it: CUDA operands, the
        BF16 store this backend keeps, int64 positions and float32 projections, ``ape`` and frequencies."""
        from nvfp4_megamoe.kernels.sm90_compressor import Sm90CompressStep, sm90_compress_step

        config = _compress_config(cs.ratio, cs.store.shape[-1], cs.overlap, inv_freq.numel(), eps)
        ape = self._f32(ape)   # a BF16 ape (the format allows it): its float32 copy, made once
        fits = (kv.is_cuda and cs.store.dtype == torch.bfloat16 and positions.dtype == torch.int64
                and all(t.dtype == torch.float32 for t in (kv, gate, ape, inv_freq))
                and kv.stride(-1) == 1 and gate.stride(-1) == 1 and Sm90CompressStep.can_implement(config))
        if not fits:
            return super().compress_step(kv, gate, cs, ape, norm, positions, inv_freq, eps)
        sm90_compress_step(kv, gate, cs.pending_kv, cs.pending_gate, cs.prev_kv, cs.prev_gate, cs.store, ape,
                           self._f32(norm), positions, inv_freq, cs.ratio, eps)
        self.kernel_calls["compress_step"] += 1

    # -- RMSNorm --------------------------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The reference's formula in float32 through ``F.rms_norm`` (one fused launch on CUDA instead of five),
        with the weight's float32 copy made once: a decode step normalises 26 times on flash-layer."""
        if not x.is_cuda:
            return super().rms_norm(x, weight, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else self._f32(weight), eps)

    def _f32(self, w: torch.Tensor) -> torch.Tensor:
        if w.dtype == torch.float32:
            return w
        return self._per_tensor(self._f32_weights, w, torch.Tensor.float)

    @staticmethod
    def _per_tensor(cache: dict, t: torch.Tensor, make):
        """``make(t)``, computed once per tensor: ``cache`` maps ``id(t)`` to ``(t, value)`` (holding ``t``, so its
        id is not reused while the entry lives). Not kept when made inside a CUDA graph capture: its memory is the
        graph's, freed with the graph."""
        hit = cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        value = make(t)
        if not torch.cuda.is_current_stream_capturing():
            cache[id(t)] = (t, value)
        return value

    # -- mHC ---------------------------------------------------------------------------------------
    def hc_pre(self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
               iters: int, hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from nvfp4_megamoe.kernels.sm90_heuristics import hc_pre_fused_config, hc_pre_fused_pays
        from nvfp4_megamoe.kernels.sm90_mhc import Sm90HcPre, Sm90HcPreFused, sm90_hc_pre, sm90_hc_pre_fused

        norm = norm_weight is not None
        hc, h = x.shape[-2], x.shape[-1]
        if not (x.is_cuda and Sm90HcPre.can_implement(hc, h, norm)):
            return super().hc_pre(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                                  norm_weight=norm_weight)
        self.kernel_calls["hc_pre"] += 1
        weight = self._f32(norm_weight) if norm else None
        tokens = x.numel() // (hc * h)
        if hc_pre_fused_pays(tokens) and Sm90HcPreFused.can_implement(
                hc_pre_fused_config(hc, h, tokens, iters=max(iters, 1), hc_eps=hc_eps, norm_eps=norm_eps, norm=norm)):
            # a decode step's few tokens: the product by fn in the same launch (one launch, fn read by many SMs)
            return sm90_hc_pre_fused(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                                     norm_weight=weight)
        return sm90_hc_pre(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, norm_weight=weight)

    def hc_post(self, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        from nvfp4_megamoe.kernels.sm90_mhc import Sm90HcPost, sm90_hc_post

        if not (x.is_cuda and Sm90HcPost.can_implement(x.shape[-2], x.shape[-1])
                and out.dtype in (torch.bfloat16, torch.float32)):
            return super().hc_post(out, x, post, comb)
        self.kernel_calls["hc_post"] += 1
        return sm90_hc_post(out, x, post, comb)

    # -- decode indexer top-k ----------------------------------------------------------------------------------
    def indexer_topk(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, k: int,
                     n_valid: torch.Tensor) -> torch.Tensor:
        if not q.is_cuda:
            return super().indexer_topk(q, keys, weights, k, n_valid)
        return self._indexer_picks(q, keys, weights, k, n_valid)

    def chunk_topk(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, n_visible: torch.Tensor, k: int,
                   block: int) -> torch.Tensor:
        """A chunk's picks (``indexer_reference.topk_in_blocks``' contract, ``block`` unused: the score kernel holds
        one int64 key per query and entry) by the score kernel with every query of a slot reading the slot's keys
        in place, and the sort kernel; int64 [n, T, k], -1 padding."""
        from nvfp4_megamoe.kernels import sm90_indexer

        n, t, heads, dim = q.shape
        if not (q.is_cuda and keys.shape[1] and sm90_indexer.Sm90IndexerScores.can_implement(heads, dim)
                and n * t <= sm90_indexer.MAX_ROWS):
            return super().chunk_topk(q, keys, weights, n_visible, k, block)
        n_valid = _per_query(n_visible, n, t, q.device)
        picked = self._indexer_picks(q.reshape(n * t, heads, dim), keys, weights.reshape(n * t, heads), k, n_valid)
        return picked.view(n, t, k).long()

    def _indexer_picks(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, k: int,
                       n_valid: torch.Tensor) -> torch.Tensor:
        """q [B, h, d], keys [S, N, d] (S = B: a decode step; S dividing B: the B / S queries of each sequence share
        its keys), weights [B, h], n_valid int [B] -> int32 [B, k], -1 padding: the scores as ordered keys (the score
        kernel where it tiles, else torch), then their top k (the sort kernel where it pays, else ``torch.topk``)."""
        from nvfp4_megamoe.kernels import indexer_keys, sm90_heuristics, sm90_indexer

        b, heads, dim = q.shape
        shape = (heads, dim, k, str(q.device))
        if shape not in self._indexer_ready:  # every sort size at the first call, not when the entries first cross one
            sm90_indexer.warmup(heads, dim, k, q.device, prefill=True)
            self._indexer_ready.add(shape)
        q, keys, weights = q.to(torch.bfloat16).contiguous(), keys.to(torch.bfloat16).contiguous(), weights.float()
        if sm90_indexer.Sm90IndexerScores.can_implement(heads, dim):
            key = sm90_indexer.sm90_indexer_keys(q, keys, weights, n_valid)
            self.kernel_calls["indexer"] += 1
        else:
            if keys.shape[0] != b:   # the torch composition takes a request's own keys
                keys = keys.repeat_interleave(b // keys.shape[0], dim=0)
            key = indexer_keys.indexer_keys_torch(q, keys, weights, n_valid)
        n = key.shape[1]
        if b and n and sm90_indexer.topk_can_implement(n, k) and sm90_heuristics.sort_topk_pays(b, n, k):
            return sm90_indexer.sm90_topk_of_keys(key, k)
        return indexer_keys.topk_of_keys_torch(key, k)

    def chunk_attention(self, q: torch.Tensor, rows: torch.Tensor, past: int, window: int,
                        entries: torch.Tensor | None, n_visible: torch.Tensor | None, index: tuple | None,
                        sink: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
        """Every query token of the chunk a request of the decode attention kernel (``sm90_prefill_attention``),
        reading its slot's window rows and entries in place: the window a span of ``rows``, CSA's entries by the
        picks of ``chunk_topk``, HCA's by a count per query."""
        from nvfp4_megamoe.kernels.prefill_attention_reference import chunk_windows
        from nvfp4_megamoe.kernels.sm90_decode_attention import (MAX_REQUESTS, Sm90DecodeAttention,
                                                                 sm90_prefill_attention)

        n, t, heads, dim = q.shape
        if not (q.is_cuda and Sm90DecodeAttention.can_implement(heads, dim) and n * t <= MAX_REQUESTS):
            return super().chunk_attention(q, rows, past, window, entries, n_visible, index, sink, scale, topk)
        bf = lambda x: x.to(torch.bfloat16).contiguous()  # noqa: E731
        start, length = chunk_windows(past, t, window, n, q.device)
        kvc = indices = count = None
        if entries is not None and entries.shape[1]:
            kvc = bf(entries)
            if index is None:     # HCA
                count = _per_query(n_visible, n, t, q.device)
            else:
                iq, index_keys, index_weights = index
                indices = self.chunk_topk(iq, index_keys, index_weights, n_visible, topk, 0)
                indices = indices.reshape(n * t, -1).to(torch.int32).contiguous()
        out = sm90_prefill_attention(bf(q.reshape(n * t, heads, dim)), bf(rows), start, length, kvc, indices,
                                     sink.float().contiguous(), scale, count=count, max_window=window)
        self.kernel_calls["prefill_attention"] += 1
        return out.view(n, t, heads, dim).float()

    # -- a decode step's query and key ----------------------------------------------------------------------------
    def step_qkv(self, q_raw: torch.Tensor, kv_raw: torch.Tensor, kv_norm: torch.Tensor, ring: torch.Tensor,
                 positions: torch.Tensor, inv_freq: torch.Tensor, turn: torch.Tensor, eps: float) -> torch.Tensor:
        """The reference's query and key in one launch (``sm90_qkv_step``) where the kernel takes them: CUDA float32
        projections with a unit column stride, the BF16 ring this backend keeps, int64 positions, float32
        frequencies, and a query the decode attention kernel reads (which rounds it to BF16 anyway). The query comes
        back BF16 [B, 1, H, D], contiguous: :meth:`decode_attention` converts nothing."""
        from nvfp4_megamoe.kernels import sm90_qkv_step
        from nvfp4_megamoe.kernels.sm90_decode_attention import Sm90DecodeAttention

        _, t, heads, d = q_raw.shape
        fits = (q_raw.is_cuda and t == 1 and ring.dtype == torch.bfloat16 and positions.dtype == torch.int64
                and all(x.dtype == torch.float32 and x.stride(-1) == 1 for x in (q_raw, kv_raw, inv_freq))
                and ring.stride(-1) == 1 and sm90_qkv_step.can_implement(d, 2 * inv_freq.numel(), eps)
                and Sm90DecodeAttention.can_implement(heads, d))
        if not fits:
            return super().step_qkv(q_raw, kv_raw, kv_norm, ring, positions, inv_freq, turn, eps)
        q = sm90_qkv_step.sm90_qkv_step(q_raw[:, 0], kv_raw[:, 0], self._f32(kv_norm), ring, positions, inv_freq, eps)
        self.kernel_calls["step_qkv"] += 1
        return q[:, None]

    # -- decode attention -----------------------------------------------------------------------------------------
    def decode_attention(self, q: torch.Tensor, kv_window: torch.Tensor, window_len: torch.Tensor,
                         kv_compressed: torch.Tensor | None, indices: torch.Tensor | None,
                         sink: torch.Tensor, scale: float) -> torch.Tensor:
        from nvfp4_megamoe.kernels.sm90_decode_attention import Sm90DecodeAttention, sm90_decode_attention

        if not (q.is_cuda and Sm90DecodeAttention.can_implement(q.shape[1], q.shape[-1])):
            return super().decode_attention(q, kv_window, window_len, kv_compressed, indices, sink, scale)
        bf = lambda t: None if t is None else t.to(torch.bfloat16).contiguous()  # noqa: E731
        idx = None if indices is None else indices.to(torch.int32).contiguous()
        out = sm90_decode_attention(bf(q), bf(kv_window), window_len.to(torch.int32).contiguous(), bf(kv_compressed),
                                    idx, sink.float().contiguous(), scale)
        self.kernel_calls["decode_attention"] += 1
        return out.float()

    # -- compile at load ----------------------------------------------------------------------------------------
    def start_workers(self, processes: int | None = None) -> None:
        """Start the compiling worker processes now (``processes``, default one per CPU core), so that their
        imports run while the weights are read; :meth:`start_warmup` gives them the kernels not in the disk cache,
        or ends them when there are none. Nothing without a disk cache (the workers hand kernels over through it)."""
        from nvfp4_megamoe.kernels import cute_host
        from nvfp4_megamoe.kernels.compile_workers import WorkerPool

        if self._pool is None and cute_host.cache_folder() is not None:
            self._pool = WorkerPool(processes)

    def start_warmup(self, config, weights, device: str | torch.device, processes: int | None = None) -> None:
        """Start compiling every kernel these weights' shapes can launch on ``device``, in ``processes`` worker
        processes (``cute_host.start_compile_all``, default one per CPU core, or those :meth:`start_workers` started);
        :meth:`warmup` waits for them. Only the weights' shapes and dtypes are looked at: ``load_model`` calls this
        while their bytes are still being copied."""
        from nvfp4_megamoe.kernels import cute_host

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:   # "cuda:0", as the forward's tensors say it: the caches' keys
            dev = torch.device("cuda", torch.cuda.current_device())
        with cute_host.collecting() as jobs:
            self._warm_shapes(config, weights, dev)
        pool, self._pool = self._pool, None
        self._pending = cute_host.start_compile_all(jobs, processes, pool)

    def cancel_warmup(self) -> None:
        """Stop the compiles :meth:`start_warmup` started (no new job starts; those running finish)."""
        if self._pool is not None:
            self._pool.discard()
            self._pool = None
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def warmup(self, model, processes: int | None = None) -> float:
        """Finish compiling (:meth:`start_warmup`, started here if it was not) every kernel this model's shapes can
        launch, then run tiny forwards so that nothing else is left for a first call to set up; returns seconds.
        Kernels already in the disk cache are loaded, not compiled. ``warmup_phases`` says where the time went."""
        t0 = time.perf_counter()
        dev = model.device
        if self._pending is None:
            self.start_warmup(model.config, model.weights, dev, processes)
        self.compile_report = []
        self.compiled_at_warmup = self._pending.wait(report=self.compile_report)
        self._pending = None
        self.fuse_same_input(model.weights)
        t_kernels = time.perf_counter()
        # eager (T = 1 is a decode step): a graph captured here would be for a throwaway state, and each capture took
        # about 0.37 s of a warm load on the H200; a user's state captures its own at its first step
        graphs, model.decode_graphs = model.decode_graphs, None
        try:
            for t in WARMUP_TOKENS:
                model(torch.zeros(1, t, dtype=torch.long, device=dev))
        finally:
            model.decode_graphs = graphs
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_end = time.perf_counter()
        self.warmup_phases = {"kernels": t_kernels - t0, "forwards": t_end - t_kernels}
        self.warmup_seconds = t_end - t0
        return self.warmup_seconds

    def _warm_shapes(self, cfg, weights, dev: torch.device) -> None:
        """Ask every kernel family for what these weights need (inside ``cute_host.collecting``: nothing compiles)."""
        from nvfp4_megamoe.kernels import sm90_compressor, sm90_decode_attention, sm90_indexer, sm90_mhc, sm90_router
        from nvfp4_megamoe.kernels import sm90_heuristics, sm90_qkv_step

        layers = weights.layers.values()
        # the router: one kernel per layer kind (top-k with or without a bias; hash, per tid2eid dtype)
        if sm90_router.can_implement(cfg.n_routed_experts, cfg.top_k, cfg.scoring_func):
            kinds = {(lw.moe.tid2eid is not None, lw.moe.bias is not None,
                      lw.moe.tid2eid.dtype if lw.moe.tid2eid is not None else None) for lw in layers}
            for hashed, bias, dtype in sorted(kinds, key=repr):
                config = sm90_router.RouterConfig(cfg.n_routed_experts, cfg.top_k, cfg.scoring_func,
                                                  float(cfg.routed_scaling_factor), bias=bias and not hashed)
                sm90_router.warmup(config, dev, hashed=hashed, tid2eid_dtype=dtype or torch.int64)
        for lw in layers:
            self._moe_layer(lw.moe, cfg.top_k, cfg.swiglu_limit, dev)
            a = lw.attn
            fused = [g for g in same_input_linears(lw) if fused_kind(g) == "fp8"]
            for g in fused:   # the one weight fuse_same_input makes of them (in place of theirs)
                w = g[0]
                self._fp8_ready(Fp8Linear(w.weight.new_empty(sum(m.out_features for m in g), w.weight.shape[1]),
                                          w.scale), 1, dev, shapes_only=True)
            in_fused = {id(w) for g in fused for w in g}
            for w in (w for w in _kernel_linears(lw) if id(w) not in in_fused):
                groups = cfg.o_groups if w is a.wo_a else 1
                if isinstance(w, Fp8Linear):
                    self._fp8_ready(w, groups, dev, shapes_only=True)
                else:
                    self._linear_ready(w.weight.shape[0] // groups, 2 * w.weight.shape[1], dev, groups)
        if sm90_mhc.Sm90HcPre.can_implement(cfg.hc_mult, cfg.hidden_size):
            sm90_mhc.warmup(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, dev)
            # the fused form's clusters at one token and at the most tokens the runtime gives it
            sm90_mhc.warmup_fused(cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
                                  dev, token_counts=(1, sm90_heuristics.HC_PRE_FUSED_MAX_TOKENS))
        ratios = {lw.attn.compress_ratio for lw in layers}
        if sm90_decode_attention.Sm90DecodeAttention.can_implement(cfg.num_heads, cfg.head_dim):
            # CSA and HCA both pass -1-padded indices (HCA: every valid row of its fixed-size store)
            modes = ("window",) + (("indexed",) if ratios - {0} else ())
            # prefill: HCA's queries each see their own count of entries ("dense"), CSA's their picks ("indexed")
            prefill = ("window",) + (("indexed",) if 4 in ratios else ()) + (("dense",) if ratios - {0, 4} else ())
            sm90_decode_attention.warmup(modes, cfg.num_heads, cfg.head_dim ** -0.5, dev, prefill=prefill)
            # the step's query and key (``step_qkv``), for the query the attention kernel reads: one RoPE width a kind
            # of layer (the main and the compressed layers' frequencies have the same length in V4: one kernel)
            eps = float(cfg.rms_norm_eps)
            widths = sorted({cfg.main_rope.dim, cfg.compress_rope.dim})
            sm90_qkv_step.warmup([sm90_qkv_step.QkvStepConfig(cfg.head_dim, rd, eps) for rd in widths
                                  if sm90_qkv_step.can_implement(cfg.head_dim, rd, eps)], dev)
        if 4 in ratios:
            sm90_indexer.warmup(cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, dev, prefill=True)
        rope_pairs = cfg.compress_rope.dim // 2
        steps = []   # each compressor's shape (CSA layers: the indexer's too), as ``compress_step`` launches it
        for lw in layers:
            a = lw.attn
            if not a.compress_ratio:
                continue
            compressors = [a.compressor] + ([a.indexer.compressor] if a.indexer is not None else [])
            for cw in compressors:
                ratio, width = cw.ape.shape
                d = cw.norm.shape[-1]
                steps.append(_compress_config(ratio, d, width == 2 * d, rope_pairs, cfg.rms_norm_eps))
        sm90_compressor.warmup([c for c in steps if sm90_compressor.Sm90CompressStep.can_implement(c)], dev)


def _per_query(n_visible: torch.Tensor, n: int, t: int, device: torch.device) -> torch.Tensor:
    """A chunk's visible-entry counts, int [T] (or [n, T]), as the kernels' int32 [n * T], one per query of each slot
    (query t of slot s is request s * T + t)."""
    return n_visible.to(device, torch.int32).expand(n, t).reshape(n * t).contiguous()


def _compress_config(ratio: int, dim: int, overlap: bool, rope_pairs: int, eps: float):
    """The compressor step kernel's configuration for a compressor of these shapes (``rope_pairs``: the entries of
    ``inv_freq``), its cluster and slot groups as ``sm90_heuristics`` picks them (what ``sm90_compress_step``
    launches)."""
    from nvfp4_megamoe.kernels.sm90_heuristics import compress_step_config

    return compress_step_config(ratio, dim, overlap, 2 * rope_pairs, eps)


def fused_kind(group: tuple[Linear, ...]) -> str | None:
    """How :meth:`HopperBackend.fuse_same_input` makes one weight of ``group`` (linears of one input), or None:
    ``"fp8"`` for FP8 linears of one K, weight and scale dtype, each a whole number of 128-row scale blocks, whose
    concatenation the FP8 kernel tiles; ``"f32"`` for BF16 weights of one K small enough to run against a float32 copy.
    NVFP4 linears are not fused: each has its own global scale (``alpha``), which the kernel takes one of per call."""
    from nvfp4_megamoe.kernels import sm90_fp8_linear

    first = group[0]
    k = first.weight.shape[1]
    if len(group) < 2 or any(type(w) is not type(first) or w.weight.shape[1] != k
                             or w.weight.dtype != first.weight.dtype for w in group):
        return None
    if isinstance(first, Fp8Linear):
        rows = sum(w.out_features for w in group)
        if (all(w.scale.dtype == first.scale.dtype and w.out_features % sm90_fp8_linear.SCALE_BLOCK == 0 for w in group)
                and sm90_fp8_linear.can_implement(rows, k)):
            return "fp8"
        return None
    if isinstance(first, DenseLinear) and first.weight.dtype == torch.bfloat16 and all(
            w.weight.numel() * 4 <= F32_COPY_MAX_BYTES for w in group):
        return "f32"
    return None


def _concat_fp8(group: tuple[Fp8Linear, ...]) -> Fp8Linear:
    """One FP8 linear of ``group``'s rows (and block-scale rows) in order; each member's tensors become views of it
    (its bytes are then held once)."""
    def cat(ts: list[torch.Tensor]) -> torch.Tensor:   # one-byte dtypes (E4M3, E8M0) concatenated as their bytes
        if ts[0].element_size() == 1:
            return torch.cat([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
        return torch.cat(ts)

    fused = Fp8Linear(cat([w.weight for w in group]), cat([w.scale for w in group]))
    row = block = 0
    for w in group:
        n, blocks = w.weight.shape[0], w.scale.shape[0]
        w.weight, w.scale = fused.weight[row:row + n], fused.scale[block:block + blocks]
        row, block = row + n, block + blocks
    return fused


def _kernel_linears(lw) -> list[Nvfp4Linear | Fp8Linear]:
    """Every NVFP4 and FP8 linear of a layer's attention and shared expert (what ``linear`` / ``grouped_linear``
    launch kernels for)."""
    a, shared = lw.attn, lw.moe.shared
    found = [a.wq_a, a.wq_b, a.wkv, a.wo_a, a.wo_b, shared.w13, shared.w1, shared.w3, shared.w2]
    if a.indexer is not None:
        found.append(a.indexer.wq_b)
    return [w for w in found if isinstance(w, (Nvfp4Linear, Fp8Linear))]
