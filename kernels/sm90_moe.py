"""Host side of the SM90 NVFP4 MoE: routing glue + L1 (SwiGLU) + L2 (routed scatter-add), and a dense linear.

Flow of one layer (on the current CUDA stream, which a prefill call's side stream forks from and joins again; no
host sync, no allocation per call: the workspaces are sized once for ``max_tokens``, so the call is CUDA-graph
capturable):

1. ``Sm90MoeRouting``: pairs (token, slot) sorted by expert -> ``token_of``, ``weight_of``, tiles
   (skipped up to ``DIRECT_MAX_TOKENS`` tokens: each routed pair is a tile of its own, ``direct_top_k`` in
   ``sm90_moe_gemm``; one token's k pairs are k distinct experts, a few tokens' mostly are);
2. ``Sm90Nvfp4GroupedGemm(mode="swiglu")`` over ``w13``: ``h`` [pairs, I] BF16 in sorted order, each
   row in the K order step 3 reads (``k_order``; its CTAs also zero ``out``, so no memset launch);
3. ``Sm90Nvfp4GroupedGemm(mode="scatter")`` over ``w2``: ``out[t] += w * (h @ W2.T)``.

From ``WGMMA_MIN_MEAN`` routed pairs per expert on (prefill), steps 2 and 3 run the WGMMA kernels of
``sm90_moe_wgmma`` instead (same operands and epilogues; ``tuning={"wgmma": True/False}`` forces a path);
they read activations in the ``"staged"`` K order, so ``x`` is first permuted into a workspace
(``Sm90StagedOrder``), while step 1 runs on a side stream.

Weights are format 1 as written by ``convert`` (``docs/format.md``), ``w13`` and ``w2`` row-major or, from a
``--target sm90`` conversion, in Hopper row tiles (``weight_tiles``); the contract of each operand is in
``sm90_moe_gemm``. Compiled kernels are cached in-process by their static configuration (and on
disk unless ``NVFP4_MEGAMOE_KERNEL_CACHE=0``, see ``cute_host``); :meth:`Sm90NvFp4MoE.warmup`
compiles every configuration a layer can pick (:meth:`Sm90NvFp4MoE.config` for each T up to
``max_tokens``), so that no call compiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .sm90_moe_gemm import Sm90Nvfp4GroupedGemm
from .sm90_k_order import Sm90StagedOrder
from .sm90_moe_routing import Sm90MoeRouting, max_tiles_for
from .sm90_moe_wgmma import WGMMA_TILE_TOKENS, Sm90Nvfp4WgmmaGemm, wgmma_fits_k
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .swizzle import swizzled_nbytes

TILE_TOKEN_CHOICES = (8, 16, 32, 64)
WGMMA_MIN_MEAN = 8.0  # mean routed pairs per expert from which the WGMMA (prefill) kernels run
# calls of up to this many tokens skip the routing kernel (one tile per routed pair). Measured on an H200
# (docs/benchmarks.md), with ``block_columns``: T = 4 V4-Flash 116.0 -> 110.0 us, V4-Pro 272.9 -> 267.5 us; from
# T = 8 the experts repeated across tokens cost more than the routing launch (V4-Pro T = 8 480 -> 523 us).
DIRECT_MAX_TOKENS = 4
# calls of up to this many tokens interleave the decode GEMMs' two row tiles (``interleave_rows``). Measured on an
# H200 (docs/benchmarks.md), interleaved against not: T = 4 V4-Flash 128.6 -> 118.0 us, V4-Pro 285.5 -> 278.3 us;
# T = 2 V4-Pro 174.8 -> 168.9 us; from T = 8 slower (V4-Flash T = 16 320.4 -> 342.9 us, V4-Pro T = 8 492.7 -> 508.2).
INTERLEAVE_MAX_TOKENS = 4
# Direct calls with two row tiles apply the block scales to fp32 partial sums (``block_columns`` in sm90_moe_gemm;
# fewer instructions per weight byte). Measured on an H200 (docs/benchmarks.md), with two row tiles: T = 2 V4-Flash
# 62.8 -> 60.9 us, V4-Pro 166.2 -> 164.7 us, V4-Pro T = 1 mixed (89.4 -> 91.3 and 93.8 -> 88.6 us in two runs); with
# one (V4-Flash T = 1) slower, 37.4 -> 41.1 us.
# Direct calls with one row tile (V4-Flash T = 1: 384 CTAs of 4 warps, 2.8 warps per scheduler, L1 issuing in 55 % of
# cycles and streaming at 59 % of the DRAM peak) run L1 with two warps per row group, each over half of K
# (``k_warps``), with 2 k-tiles in flight each. Measured on an H200 (docs/benchmarks.md): V4-Flash T = 1 35.7 ->
# 34.0 us (33.6 with L2 so too, but its registers then spill). With two row tiles the registers do not fit three
# 8-warp CTAs per SM (V4-Flash T = 2 58.6 -> 85.2 us).
# Direct calls launch L2 early (PDL: its CTAs start their first weight loads as L1's CTAs leave, then wait for L1).
# Measured on an H200 (docs/benchmarks.md), with two row tiles, T = 1 / 2 / 4: V4-Pro 83.9 / 153.2 / 246.8 ->
# 80.0 / 152.1 / 246.5 us, V4-Flash T = 2 / 4 58.1 / 104.9 -> 57.8 / 104.2. With one row tile (V4-Flash T = 1) the
# early L2 CTAs, 4 per SM by their registers, piled onto the SMs that L1 left first: 34.1 -> 34.7 us; capped at
# L1's 3 per SM (``max_ctas``), so that they replace L1's CTAs one for one, 33.5-34.1 -> 33.1-33.7 us in four A/B
# runs (``bench/moe_ab.py``), every one of their 18 interleaved rounds faster.
DIRECT_ONE_ROW_TILE_CTAS = 3


class MoeConfig(NamedTuple):
    """What a call with T tokens runs (:meth:`Sm90NvFp4MoE.config`): the arguments of :meth:`Sm90NvFp4MoE.kernels`."""
    tile_tokens: int
    wgmma: bool
    row_tiles: int
    direct: bool
    interleave: bool
    block_columns: bool
    k_warps: int
    min_tokens: int = 0


def _smallest_tile(need: float, choices: tuple[int, ...]) -> int:
    """The smallest of ``choices`` (ascending) that holds ``need`` tokens, else the largest."""
    return next((bn for bn in choices if need <= bn), choices[-1])


def pick_tile_tokens(tokens: int, top_k: int, experts: int) -> int:
    """Tokens per work tile: about twice the mean pairs per expert, in {8, 16, 32, 64}."""
    return _smallest_tile(2 * (tokens * top_k / max(experts, 1)), TILE_TOKEN_CHOICES)


def pick_row_tiles(tokens: int, top_k: int, experts: int, rows: int, sms: int) -> int:
    """Row tiles per warp of the decode kernels: 2 (128 weight rows per CTA, 2 k-tiles in flight) once L1
    has at least two such CTAs per SM for the experts a call can touch, else 1 (64 rows, 4 k-tiles).

    Two row tiles reuse every activation fragment for twice the weight rows (fewer instructions per weight
    byte); below two CTAs per SM the smaller CTAs keep more SMs streaming (V4-Flash at T = 1: 192 vs 384
    CTAs). Measured on an H200: ``docs/benchmarks.md``."""
    touched = min(tokens * top_k, experts)
    return 2 if touched * rows // 128 >= 2 * sms else 1


def use_wgmma(tokens: int, top_k: int, experts: int, min_mean: float = WGMMA_MIN_MEAN) -> bool:
    """The prefill kernels (WGMMA, activations staged in shared memory) from ``min_mean`` pairs per expert."""
    return tokens * top_k / max(experts, 1) >= min_mean


# layers at least this wide (H) run two warpgroups per WGMMA CTA from N = 64 tokens per tile (``wgmma_shape``)
WGMMA_WIDE_HIDDEN = 7168
# ... and up to this N, two m64 row groups per warpgroup (256-row CTAs), which takes N = 96 down to it
WGMMA_TWO_GROUPS_MAX_TOKENS = 80


def wgmma_shape(tile_tokens: int, hidden: int, sms: int = 132) -> dict:
    """CTA shape of the WGMMA kernels of a layer of width ``hidden`` for a token tile: one warpgroup (64 weight rows)
    up to N = 96, where the smaller CTAs let two (three up to N = 48, registers capped at 168) share an SM; two
    warpgroups above, where the accumulators fill the registers and one 128-row CTA reuses each staged activation
    tile twice as much. (Uncapped, N = 32 took 184 registers and fit two CTAs per SM: V4-Pro T = 1024 5.33 ms capped,
    6.53 ms not, on an H200.) From N = 64 on, weights are also prefetched into the L2 8 k-tiles ahead of the register
    pipeline: on an H200 V4-Flash T = 2048 / 4096 took 4-6 % less time, V4-Pro T = 4096 (N = 80) the same, while at
    N = 48 (V4-Pro T = 2048) it cost 14-18 %.

    Layers of ``WGMMA_WIDE_HIDDEN`` and wider take two warpgroups from N = 64. These layers run at the H200's power
    cap, where two warpgroups (half the activation tiles staged from the L2 per weight row) take about 6 % more
    cycles but run at a higher clock: V4-Pro T = 4096 at ~690 W, 1.71 GHz against 1.52 (``bench/moe_power.py``).
    Measured on an H200 in sustained replays (6 interleaved rounds each, docs/benchmarks.md), V4-Pro: T = 3000
    (N = 64) 8461 -> 8282 us, T = 3500 / 4096 (N = 80) 9404 -> 8891 and 9863 -> 9353 (and five more runs of T = 4096,
    5-6.4 % each), T = 4500 (N = 96) 10699 -> 9942; but T = 2048 (N = 48) 7012 -> 7716. V4-Flash was slower so at
    N = 64 / 80 / 96 (T = 2048 / 2500 / 3072: 2041 -> 2369, 2375 -> 2485 (L1 alone), 2713 -> 2834 us).

    Two-warpgroup CTAs fit one per SM (``sms`` of them at once), so nothing hides the start of the CTA that takes an
    SM over; each CTA's L2 prefetches therefore run on into the first weight k-tiles of the block ``sms`` on
    (``prefetch_next``). Sustained replays on an H200 (docs/benchmarks.md), us: V4-Pro T = 4096 8948 -> 8780 (9194 ->
    9235 in a first run), T = 3000 7801 -> 7637; V4-Flash T = 4096 3035 -> 2926 (3104 -> 3047), T = 8192 5736 ->
    5774.

    Wide layers from N = 64 to ``WGMMA_TWO_GROUPS_MAX_TOKENS`` run each warpgroup over two m64 row groups (``m_tiles``,
    256-row CTAs, 2 k-tiles of weights in flight for 4 rows a thread): each staged activation tile then feeds twice
    the weight rows, half the activation bytes the L2 serves the SMs (V4-Pro T = 4096: about 28 of 41 GB a layer
    with 128-row CTAs). Above N = 80 the two groups' accumulators spill (N = 96: 48 / 88 bytes), so ``config`` takes
    N = 96 down to 80 and the few experts above 80 pairs take two tiles. Measured on an H200 in sustained replays
    (docs/benchmarks.md), V4-Pro T = 4096: 8926 -> 8353 us (two groups at N = 80) and 8239 (at N = 96, spilling),
    then 8477 -> 8014 us with the scatter's ids loaded per column (9 of 10 rounds faster). V4-Flash (not wide) at
    T = 4096 was slower so (N = 128, one group: 2748 us; two groups at N = 80 / 96: 3608 / 3427 us)."""
    if tile_tokens <= 48:
        return {"warpgroups": 1, "min_ctas": 3}
    if tile_tokens <= 96 and not (hidden >= WGMMA_WIDE_HIDDEN and tile_tokens >= 64):
        return {"warpgroups": 1, "min_ctas": 2, "l2_ahead": 8}
    if hidden >= WGMMA_WIDE_HIDDEN and tile_tokens <= WGMMA_TWO_GROUPS_MAX_TOKENS:
        return {"m_tiles": 2, "depth": 2, "l2_ahead": 8, "prefetch_next": sms}
    return {"l2_ahead": 8, "prefetch_next": sms}


def pick_wgmma_tile_tokens(tokens: int, top_k: int, experts: int) -> tuple[int, int]:
    """Token tile N of the WGMMA kernels and their narrowest MMA width (``min_tokens``; 0: every tile runs N).

    Below N = 64 (CTAs of three per SM, whose registers hold one loop): the smallest of 32, 48 that holds 1.25x the mean
    pairs per expert m. From there on each tile runs the narrowest width (steps of 16) that holds its tokens, so N can
    hold nearly every expert: m + 3 sqrt(m) (an expert's count under uniform routing spreads by about sqrt(m)), up to
    128; the narrowest width is m - 2 sqrt(m) rounded down, at least 32, or 32 where m + 3 sqrt(m) overflows 128 (the
    last tiles of the experts that overflow take any count). Measured on an H200 in sustained replays
    (docs/benchmarks.md): V4-Pro T = 4096 (N 80 -> 96, widths from 48) 10365 -> 9592 us, V4-Flash T = 4096 (N = 128,
    widths from 64) 3465 -> 3195 us."""
    mean = tokens * top_k / max(experts, 1)
    bn = _smallest_tile(1.25 * mean, WGMMA_TILE_TOKENS)
    if bn < 64:
        return bn, 0
    spread = mean ** 0.5
    bn = _smallest_tile(mean + 3 * spread, WGMMA_TILE_TOKENS)
    if mean + 3 * spread > bn:
        return bn, 32
    return bn, min(bn, max(32, int(mean - 2 * spread) // 16 * 16))


class Sm90NvFp4MoE:
    """Routed experts of one MoE layer shape on Hopper (sm_90a).

    Args:
        hidden: H. intermediate: I (per expert). experts: E. top_k: k.
        swiglu_limit: clamp L of the SwiGLU (None: no clamp).
        max_tokens: the largest T a call may pass (workspaces are sized for it).
        device: CUDA device of the workspaces.
        tuning: extra keyword arguments for both ``Sm90Nvfp4GroupedGemm`` (e.g. ``depth``, ``warps``), under the
            key ``"wg"`` for both ``Sm90Nvfp4WgmmaGemm``, and under ``"l1"`` / ``"l2"`` for one GEMM of either
            path (e.g. ``{"l2": {"split_k": 2}}``).
        weight_tiles: ``w13`` and ``w2`` are in Hopper row tiles (``row_tiles``, converter ``--target sm90``)
            instead of row-major.
    """

    def __init__(self, *, hidden: int, intermediate: int, experts: int, top_k: int,
                 swiglu_limit: float | None, max_tokens: int, device: torch.device | str = "cuda",
                 tuning: dict | None = None, weight_tiles: bool = False):
        self.h, self.i, self.e, self.k = hidden, intermediate, experts, top_k
        self.weight_tiles = weight_tiles
        self.limit = swiglu_limit
        self.max_tokens = max_tokens
        self.tuning = dict(tuning or {})
        pairs = max_tokens * top_k
        dev = torch.device(device)
        self.token_of = torch.zeros(pairs, dtype=torch.int32, device=dev)
        self.weight_of = torch.zeros(pairs, dtype=torch.float32, device=dev)
        self.rank = torch.zeros(pairs, dtype=torch.int32, device=dev)
        self.tiles = torch.zeros(max_tiles_for(pairs, experts, TILE_TOKEN_CHOICES[0]), 3, dtype=torch.int32, device=dev)
        self.num_tiles = torch.zeros(1, dtype=torch.int32, device=dev)
        self.hbuf = torch.empty(pairs, intermediate, dtype=torch.bfloat16, device=dev)
        self.xbuf = torch.empty(max_tokens, hidden, dtype=torch.bfloat16, device=dev)  # x in "staged" order
        self.zeros = torch.zeros(max(hidden, intermediate) // 2, dtype=torch.int32, device=dev)  # an activation row
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        # the routing's stream, beside the permute of x; high priority, so that its one CTA takes the first SM free
        # instead of queueing behind the permute's
        self.side = torch.cuda.Stream(dev, priority=-1) if dev.type == "cuda" else None
        self.permute = Sm90StagedOrder()  # x into the "staged" K order, for the WGMMA L1

    def kernels(self, tile_tokens: int, wgmma: bool = False, row_tiles: int = 1, direct: bool = False,
                interleave: bool = False, block_columns: bool = False, k_warps: int = 1, min_tokens: int = 0
                ) -> tuple[Sm90MoeRouting, Sm90Nvfp4GroupedGemm, Sm90Nvfp4GroupedGemm]:
        """The three kernel objects used for a token tile size (``wgmma``: the prefill GEMMs; ``row_tiles``:
        :func:`pick_row_tiles`, which explicit ``tuning`` keys override; ``direct``: the GEMMs walk the
        routed pairs themselves and the routing kernel is not launched; ``interleave``: the decode GEMMs'
        ``interleave_rows``; ``block_columns``: the direct GEMMs' ``block_columns``, both or neither; ``k_warps``: the
        decode L1's ``k_warps``, with 2 k-tiles in flight per warp). Direct calls launch L2 early (``pdl``), with one
        row tile both GEMMs capped at ``DIRECT_ONE_ROW_TILE_CTAS`` CTAs per SM."""
        if row_tiles == 2:
            shape = {"row_tiles": 2, "depth": 2, **({"pdl": True} if direct else {})}
        else:
            shape = {"pdl": True, "max_ctas": DIRECT_ONE_ROW_TILE_CTAS} if direct else {}
        tuning = dict(getattr(self, "tuning", {}))
        for key in ("wgmma", "wgmma_min_mean", "wgmma_tile_tokens", "direct", "direct_max_tokens",
                    "interleave_max_tokens", "block_columns", "k_warps"):  # what ``config`` decides, passed in as arguments
            tuning.pop(key, None)
        tuning = {**shape, **tuning}
        l1_extra, l2_extra = tuning.pop("l1", {}), tuning.pop("l2", {})
        if k_warps > 1:
            l1_extra = {"k_warps": k_warps, "depth": 2, **l1_extra}
        if direct:
            tuning.update(direct_top_k=self.k, block_columns=block_columns)
        tuning = {"interleave_rows": interleave, "weight_tiles": self.weight_tiles, "stage_x": direct, **tuning}
        wg_extra = {**wgmma_shape(tile_tokens, self.h, self.sms), "weight_tiles": self.weight_tiles,
                    "min_tokens": min_tokens, **tuning.pop("wg", {})}
        if wgmma:
            return (Sm90MoeRouting(experts=self.e, top_k=self.k, tile_tokens=tile_tokens),
                    Sm90Nvfp4WgmmaGemm(m=2 * self.i, k=self.h, mode="swiglu", tile_tokens=tile_tokens,
                                       swiglu_limit=self.limit, h_order="staged", **{**wg_extra, **l1_extra}),
                    Sm90Nvfp4WgmmaGemm(m=self.h, k=self.i, mode="scatter", tile_tokens=tile_tokens,
                                       **{**wg_extra, **l2_extra}))
        return (Sm90MoeRouting(experts=self.e, top_k=self.k, tile_tokens=tile_tokens),
                Sm90Nvfp4GroupedGemm(m=2 * self.i, k=self.h, mode="swiglu", tile_tokens=tile_tokens,
                                     swiglu_limit=self.limit, h_order="lane", **{**tuning, **l1_extra}),
                Sm90Nvfp4GroupedGemm(m=self.h, k=self.i, mode="scatter", tile_tokens=tile_tokens, b_order="lane",
                                     **{**tuning, **l2_extra}))

    def config(self, tokens: int) -> MoeConfig:
        """What a call with ``tokens`` tokens runs. ``direct`` (no routing kernel) up to ``DIRECT_MAX_TOKENS``
        tokens (``tuning`` key ``"direct_max_tokens"``), never with ``tuning={"direct": False}``; ``interleave``
        with two row tiles up to ``INTERLEAVE_MAX_TOKENS`` (``"interleave_max_tokens"``); ``block_columns`` for
        direct calls with two row tiles (``tuning`` key ``"block_columns"``: True / False for every direct call);
        ``k_warps`` 2 (L1) for direct calls with one row tile (``tuning`` key ``"k_warps"``: for every decode call);
        the WGMMA token tile and narrowest MMA width from :func:`pick_wgmma_tile_tokens`, N = 96 taken down to
        ``WGMMA_TWO_GROUPS_MAX_TOKENS`` for wide layers (two m64 groups a warpgroup, :func:`wgmma_shape`; ``tuning`` key
        ``"wgmma_tile_tokens"``: that N, one width, which ``{"wg": {"min_tokens": ..}}`` can widen again)."""
        tuning = getattr(self, "tuning", {})
        wg = tuning.get("wgmma")
        if wg is None:
            wg = (use_wgmma(tokens, self.k, self.e, tuning.get("wgmma_min_mean", WGMMA_MIN_MEAN))
                  and wgmma_fits_k(self.h) and wgmma_fits_k(self.i))
        min_tokens = 0
        if wg:
            bn, min_tokens = pick_wgmma_tile_tokens(tokens, self.k, self.e)
            if self.h >= WGMMA_WIDE_HIDDEN and WGMMA_TWO_GROUPS_MAX_TOKENS < bn <= 96:  # two row groups (wgmma_shape)
                bn, min_tokens = WGMMA_TWO_GROUPS_MAX_TOKENS, min(min_tokens, WGMMA_TWO_GROUPS_MAX_TOKENS)
            if "wgmma_tile_tokens" in tuning:  # e.g. {"wgmma_tile_tokens": 96, "wg": {"min_tokens": 48}}
                bn, min_tokens = tuning["wgmma_tile_tokens"], 0
        else:
            bn = pick_tile_tokens(tokens, self.k, self.e)
        rt = 1
        if not wg and self.h % 128 == 0 and (2 * self.i) % 128 == 0:
            rt = pick_row_tiles(tokens, self.k, self.e, 2 * self.i, self.sms)
        direct_max = tuning.get("direct_max_tokens", DIRECT_MAX_TOKENS) if tuning.get("direct", True) else 0
        interleave = rt == 2 and tokens <= tuning.get("interleave_max_tokens", INTERLEAVE_MAX_TOKENS)
        direct = tokens <= direct_max and not wg
        block_columns = bool(direct and tuning.get("block_columns", rt == 2))
        k_warps = 1 if wg else tuning.get("k_warps", 2 if direct and rt == 1 else 1)
        return MoeConfig(bn, wg, rt, direct, interleave, block_columns, k_warps, min_tokens)

    def warmup(self, ids_dtype: torch.dtype = torch.int32) -> int:
        """Compile every kernel configuration a call with 1 <= T <= ``max_tokens`` can pick (routing ids of
        ``ids_dtype``), so that no call compiles (nor any CUDA-graph capture). Returns how many there are."""
        # compiles specialise on dtypes and ranks only (shapes are dynamic): tiny stand-ins will do
        dev, p = self.hbuf.device, self.k
        u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
        w, sc = torch.empty(1, 1, 16, **u8), torch.empty(1, 16, **u8)
        x, out = torch.empty(1, 16, dtype=torch.bfloat16, device=dev), torch.empty(1, 16, **f32)
        ids, wts = torch.empty(p, dtype=ids_dtype, device=dev), torch.empty(p, **f32)
        common = [self.token_of[:p], self.weight_of[:p], self.tiles, self.num_tiles]
        configs = {self.config(n) for n in range(1, self.max_tokens + 1)}
        for cfg in configs:
            routing, l1, l2 = self.kernels(*cfg)
            pairs = [self.zeros, wts, ids.view(p, 1), self.num_tiles] if cfg.direct else common
            if not cfg.direct:
                _compile(routing, [ids, wts, *common, self.rank[:p]])
            _compile(l1, [w, sc, torch.empty(2, **f32), x, *pairs, self.hbuf[:p], out])
            _compile(l2, [w, sc, torch.empty(1, **f32), self.hbuf[:p], *pairs, out, out])
        if any(cfg.wgmma for cfg in configs):  # one permute kernel serves every WGMMA configuration
            _compile(self.permute, [x, self.xbuf[:1]])
        return len(configs)

    def check_weights(self, w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha) -> None:
        e, h, i = self.e, self.h, self.i
        _expect(w13.dtype == torch.uint8 and tuple(w13.shape) == (e, 2 * i, h // 2),
                f"w13 must be uint8 [E={e}, 2I={2 * i}, H/2={h // 2}], got {w13.dtype} {tuple(w13.shape)}")
        _expect(w2.dtype == torch.uint8 and tuple(w2.shape) == (e, h, i // 2),
                f"w2 must be uint8 [E={e}, H={h}, I/2={i // 2}], got {w2.dtype} {tuple(w2.shape)}")
        _expect(tuple(w13_scale.shape) == (e, swizzled_nbytes(2 * i, h // 16)) and w13_scale.dtype == torch.uint8,
                f"w13_scale must be uint8 [E, swz(2I, H/16)], got {w13_scale.dtype} {tuple(w13_scale.shape)}")
        _expect(tuple(w2_scale.shape) == (e, swizzled_nbytes(h, i // 16)) and w2_scale.dtype == torch.uint8,
                f"w2_scale must be uint8 [E, swz(H, I/16)], got {w2_scale.dtype} {tuple(w2_scale.shape)}")
        for name, a, shape in (("w13_alpha", w13_alpha, (e, 2)), ("w2_alpha", w2_alpha, (e,))):
            _expect(a.dtype == torch.float32 and tuple(a.shape) == shape,
                    f"{name} must be float32 {list(shape)}, got {a.dtype} {tuple(a.shape)}")
        for t in (w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha):
            _expect(t.is_cuda and t.is_contiguous(), "weights must be contiguous CUDA tensors")

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w13_scale: torch.Tensor, w13_alpha: torch.Tensor,
                 w2: torch.Tensor, w2_scale: torch.Tensor, w2_alpha: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` float32 [T, H] = the routed MoE of ``x`` (contract of ``moe_reference``)."""
        t = x.shape[0]
        _expect(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == self.h and x.is_contiguous(),
                f"x must be contiguous bf16 [T, H={self.h}], got {x.dtype} {tuple(x.shape)}")
        _expect(1 <= t <= self.max_tokens, f"T={t} outside [1, max_tokens={self.max_tokens}]")
        _expect(tuple(topk_ids.shape) == (t, self.k) and topk_ids.dtype in (torch.int32, torch.int64),
                f"topk_ids must be int32/int64 [T, k={self.k}]")
        _expect(tuple(topk_weights.shape) == (t, self.k) and topk_weights.dtype == torch.float32,
                f"topk_weights must be float32 [T, k={self.k}]")
        if out is None:
            out = torch.empty(t, self.h, dtype=torch.float32, device=x.device)
        _expect(out.dtype == torch.float32 and tuple(out.shape) == (t, self.h) and out.is_contiguous(),
                "out must be contiguous float32 [T, H]")
        pairs = t * self.k
        cfg = self.config(t)
        routing, l1, l2 = self.kernels(*cfg)
        token_of, hbuf = self.token_of[:pairs], self.hbuf[:pairs]
        if cfg.direct:  # one tile per routed pair, in [T, k] order: no sort, no routing launch
            tiles, weight_of = topk_ids.reshape(pairs, 1), topk_weights.reshape(-1)
            token_of = self.zeros  # the pairs are in [T, k] order; block_columns reads zeros here
        else:
            tiles, weight_of = self.tiles[:max_tiles_for(pairs, self.e, cfg.tile_tokens)], self.weight_of[:pairs]
            routing_args = [topk_ids.reshape(-1), topk_weights.reshape(-1), token_of, weight_of, tiles,
                            self.num_tiles, self.rank[:pairs]]
            if cfg.wgmma:
                # the routing (one CTA) runs beside the permute of x, on a side stream: two parallel branches of a
                # CUDA graph, joined before L1
                main = torch.cuda.current_stream(x.device)
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    _launch(routing, routing_args)
                _launch(self.permute, [x, self.xbuf[:t]])
                x = self.xbuf[:t]
                main.wait_stream(self.side)
            else:
                _launch(routing, routing_args)
        _launch(l1, [w13, w13_scale, w13_alpha.reshape(-1), x, token_of, weight_of, tiles, self.num_tiles, hbuf,
                     out])  # zeroes out; alpha pairs flattened to [2E]
        _launch(l2, [w2, w2_scale, w2_alpha, hbuf, token_of, weight_of, tiles, self.num_tiles, out, out])
        return out


def dense_linear_op(n: int, k: int, tokens: int, out_bf16: bool = True) -> Sm90Nvfp4GroupedGemm:
    """The kernel :func:`nvfp4_linear_sm90` launches for ``tokens`` rows of x [., K] against W [N, K]
    (token tile: the smallest of 8..64 that holds them). ValueError for shapes it does not tile
    (N % 64, K % 128)."""
    return Sm90Nvfp4GroupedGemm(m=n, k=k, mode="store", tile_tokens=_smallest_tile(tokens, TILE_TOKEN_CHOICES),
                                out_bf16=out_bf16)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def _dense_operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, alpha: torch.Tensor,
                    out: torch.Tensor) -> list[torch.Tensor]:
    # one group: the routing operands are unused in "store" mode, 1-element stand-ins (made once per
    # device, not a zero-fill launch per call) fill their places
    n, half_k = weight.shape
    unused = _UNUSED.get(x.device)
    if unused is None:
        unused = _UNUSED[x.device] = torch.zeros(1, 3, dtype=torch.int32, device=x.device)
    return [weight.view(1, n, half_k), weight_scale.reshape(1, -1), alpha.reshape(1), x,
            unused[0, :1], alpha.reshape(1), unused, unused[0, :1], out, out]


def warmup_nvfp4_linear(n: int, k: int, device: torch.device | str, out_dtype: torch.dtype = torch.float32) -> int:
    """Compile every token tile :func:`nvfp4_linear_sm90` can pick for W [N, K] (so no call compiles).
    Returns how many. ValueError for shapes the kernel does not tile."""
    dev = torch.device(device)
    w = torch.empty(n, k // 2, dtype=torch.uint8, device=dev)
    sc = torch.empty(swizzled_nbytes(n, k // 16), dtype=torch.uint8, device=dev)
    alpha = torch.empty(1, dtype=torch.float32, device=dev)
    x, out = torch.empty(1, k, dtype=torch.bfloat16, device=dev), torch.empty(1, n, dtype=out_dtype, device=dev)
    for bn in TILE_TOKEN_CHOICES:
        _compile(dense_linear_op(n, k, bn, out_dtype == torch.bfloat16), _dense_operands(x, w, sc, alpha, out))
    return len(TILE_TOKEN_CHOICES)


def nvfp4_linear_sm90(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, alpha: torch.Tensor,
                      out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense NVFP4 linear ``x @ W.T * alpha`` (the grouped kernel with one group, ``mode="store"``).

    ``x`` bf16 [T, K] (T >= 1); ``weight`` uint8 [N, K/2]; ``weight_scale`` uint8 [swz(N, K/16)]; ``alpha``
    float32 [] or [1] (a CUDA tensor, so no host sync). Returns ``out_dtype`` (bf16 or f32) [T, N].
    """
    n, half_k = weight.shape
    k = 2 * half_k
    _expect(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == k and x.shape[0] >= 1 and x.is_contiguous(),
            f"x must be contiguous bf16 [T >= 1, K={k}], got {x.dtype} {tuple(x.shape)}")
    _expect(weight_scale.numel() == swizzled_nbytes(n, k // 16), "weight_scale must hold swz(N, K/16) bytes")
    _expect(alpha.dtype == torch.float32 and alpha.numel() == 1 and alpha.is_cuda, "alpha must be a float32 CUDA scalar")
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=out_dtype, device=x.device)
    _expect(tuple(out.shape) == (x.shape[0], n) and out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous(),
            f"out must be contiguous bf16/f32 [T, N={n}], got {out.dtype} {tuple(out.shape)}")
    op = dense_linear_op(n, k, x.shape[0], out.dtype == torch.bfloat16)
    _launch(op, _dense_operands(x, weight, weight_scale, alpha, out))
    return out
