"""Which configuration of the SM90 kernels runs, from the layer shape and the token count.

Every rule here was chosen by measurement on an H200; the measurements, and the alternatives they rejected, are in
``docs/design/moe_kernels.md`` (MoE GEMMs) and ``docs/design/decode_attention.md`` (decode attention). The kernels
take what these functions build (``sm90_config``) and check it; nothing else picks a configuration.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from .sm90_config import (ATTENTION_CHUNK, ATTENTION_HEADS_PER_CTA, K_TILE, SMEM_LIMIT, CompressStepConfig,
                          Fp8GemmConfig, Fp8LinearConfig, Fp8WgmmaConfig, GemmConfig, GemmProblem, HcPreFusedConfig,
                          MmaTiling, MoePlan, MoeShape,
                          WgmmaTiling)

TILE_TOKEN_CHOICES = (8, 16, 32, 64)      # mma.sync token tiles
WGMMA_TILE_TOKENS = (32, 48, 64, 80, 96, 112, 128)
WGMMA_MIN_MEAN = 8.0                      # mean routed pairs per expert from which the WGMMA kernels run
WGMMA_MIN_WIDTH = 32                      # narrowest MMA width of the WGMMA kernels from N = 64 (widths by 16 to N)
DIRECT_MAX_TOKENS = 4                     # calls up to this many tokens skip the routing kernel
INTERLEAVE_MAX_TOKENS = 4                 # calls up to this many tokens interleave two row tiles' MMAs
LINEAR_SPLIT_CTAS = 256                   # dense linears split K until their CTAs reach this many ...
LINEAR_SPLIT_CTAS_8 = 1024                # ... this many with 8-token tiles (few partial sums to add) ...
LINEAR_SPLIT_MAX_TILES = 2                # ... while they have at most this many token tiles
LINEAR_TWO_ROW_TILES_TOKENS = 32          # dense linears' token tile that runs 128-row CTAs (x fragments reused 2x)
LINEAR_WGMMA_MIN_TILE = 32               # dense linears (float32 out) from this token tile on run the WGMMA kernel ...
LINEAR_WGMMA_NARROW_ROWS = 2048          # ... from twice that tile where W has fewer rows (N x groups) than this ...
LINEAR_WGMMA_TILES = (32, 64, 128)       # ... in token tiles of these N ...
LINEAR_WGMMA_WORK = 16384                # ... one-tile calls on a grid of this many tokens' CTAs / N (K split) ...
LINEAR_WGMMA_MIN_SHARE = 2               # ... while each share keeps this many k-tiles
DIRECT_ONE_ROW_TILE_CTAS = 3              # direct calls with one row tile: CTAs per SM at most (PDL spread)
WGMMA_WIDE_HIDDEN = 7168                  # layers this wide run two-warpgroup WGMMA CTAs from N = 64 ...
WGMMA_TWO_GROUPS_MAX_TOKENS = 80          # ... with two m64 row groups a warpgroup up to this N
FP8_KERNEL_MAX_TOKENS = 64               # FP8 dense linears of more tokens run dequantised to BF16 on cuBLAS
FP8_F32_X_MAX_TOKENS = 8                  # FP8 linear calls up to this many tokens read float32 x as it is; longer
                                          # ones take it cast to BF16 first
WGMMA_L2_AHEAD = 8                        # k-tiles of weights prefetched into the L2 from N = 64


def smallest_tile(need: float, choices: tuple[int, ...]) -> int:
    """The smallest of ``choices`` (ascending) that holds ``need`` tokens, else the largest."""
    return next((bn for bn in choices if need <= bn), choices[-1])


def fit_depth(k_tiles: int, want: int) -> int:
    """The deepest register pipeline of at most ``want`` k-tiles (1, 2 or 4) that divides ``k_tiles``."""
    return max(d for d in (1, 2, 4) if d <= want and k_tiles % d == 0)


# -- mma.sync (decode and mid token counts) -------------------------------------------------------------------------
def pick_tile_tokens(tokens: int, top_k: int, experts: int) -> int:
    """Tokens per work tile: about twice the mean pairs per expert, in {8, 16, 32, 64}."""
    return smallest_tile(2 * (tokens * top_k / max(experts, 1)), TILE_TOKEN_CHOICES)


def pick_row_tiles(tokens: int, top_k: int, experts: int, rows: int, sms: int) -> int:
    """Row tiles per warp: 2 (128-row CTAs: each activation fragment feeds twice the weight rows) once L1 has at
    least two such CTAs per SM for the experts a call can touch, else 1 (smaller CTAs keep more SMs streaming)."""
    touched = min(tokens * top_k, experts)
    return 2 if touched * rows // 128 >= 2 * sms else 1


def use_wgmma(tokens: int, top_k: int, experts: int, min_mean: float = WGMMA_MIN_MEAN) -> bool:
    """The prefill kernels (WGMMA, activations staged in shared memory) from ``min_mean`` pairs per expert."""
    return tokens * top_k / max(experts, 1) >= min_mean


def wgmma_fits_k(k: int) -> bool:
    """Whether the WGMMA kernels take a GEMM whose K is ``k``: 128-K tiles, one of them or an even number (two or
    more k-tiles in flight; one in flight over several computed non-finite outputs on an H200)."""
    return k % K_TILE == 0 and (k == K_TILE or k // K_TILE % 2 == 0)


def mma_tiling(problem: GemmProblem, tile_tokens: int, row_tiles: int = 1, *, k_warps: int = 1,
               interleave: bool = False, block_columns: bool = False, direct: bool = False,
               k_splits: int = 1) -> MmaTiling:
    """The mma.sync tiling of ``problem``. Direct MoE calls (``direct``) run under PDL; with one row tile capped at
    ``DIRECT_ONE_ROW_TILE_CTAS`` CTAs per SM, and L1 staging its token's x in shared memory."""
    k_tiles = problem.k // K_TILE // k_splits
    want = 2 if row_tiles == 2 or k_warps > 1 else 4  # two row tiles or two K warps: registers for 2 in flight
    if not (tile_tokens == 8 and problem.mode != "store" and k_tiles % k_warps == 0):
        k_warps = 1
    depth = fit_depth(k_tiles // k_warps, want)
    moe = problem.mode != "store"
    return MmaTiling(tile_tokens=tile_tokens, row_tiles=row_tiles, depth=depth, k_warps=k_warps, k_splits=k_splits,
                     interleave_rows=interleave and row_tiles > 1, block_columns=block_columns,
                     stage_x=direct and problem.mode == "swiglu" and problem.b_order == "logical",
                     pdl=direct and moe, max_ctas=DIRECT_ONE_ROW_TILE_CTAS if direct and moe and row_tiles == 1 else 0)


def pick_k_splits(ctas: int, k_tiles: int, token_tiles: int, tile_tokens: int) -> int:
    """K shares of a dense linear whose grid has ``ctas`` CTAs without splitting: doubled (while they divide the
    ``k_tiles``) until the grid reaches ``LINEAR_SPLIT_CTAS`` (``LINEAR_SPLIT_CTAS_8`` with 8-token tiles), for
    calls of at most ``LINEAR_SPLIT_MAX_TILES`` token tiles (more tiles fill the SMs themselves, and each share adds
    its partial outputs through the L2)."""
    target = LINEAR_SPLIT_CTAS_8 if tile_tokens == 8 else LINEAR_SPLIT_CTAS
    splits = 1
    if token_tiles <= LINEAR_SPLIT_MAX_TILES:
        while ctas * splits < target and k_tiles % (2 * splits) == 0:
            splits *= 2
    return splits


def linear_wgmma_tiling(n: int, k: int, tokens: int, groups: int = 1, *, tile_tokens: int | None = None,
                        warpgroups: int | None = None, k_splits: int | None = None, sms: int = 132
                        ) -> WgmmaTiling | None:
    """The WGMMA tiling of a dense linear (``"store"``, x in the ``"staged"`` K order), or None where it does not
    tile W. N: the smallest of ``LINEAR_WGMMA_TILES`` that holds the rows (longer calls run several 128-token tiles),
    the CTA shape of the MoE's tile of that N (:func:`wgmma_tiling`) without the successor prefetch (there are no
    routed tiles to follow).

    A call of one token tile is bound by its weight bytes: it wants about ``LINEAR_WGMMA_WORK / N`` CTAs streaming W
    (fewer, larger shares as N grows). It runs 64-row CTAs (one warpgroup) unless 128-row CTAs alone reach twice that
    grid, and splits K (float32 out) until the grid reaches it while each share keeps ``LINEAR_WGMMA_MIN_SHARE``
    k-tiles. Longer calls are bound by the tensor cores: 128-row CTAs (two warpgroups reuse each staged x tile) where
    W has 1024 rows or more, unsplit. The keywords fix a choice (the benchmark's sweep)."""
    bn = tile_tokens or smallest_tile(tokens, LINEAR_WGMMA_TILES)
    rows = n * groups
    if warpgroups is None:
        if tokens <= bn:
            warpgroups = 2 if rows // 128 >= 2 * LINEAR_WGMMA_WORK // bn else 1
        else:
            warpgroups = 2 if rows >= 1024 else 1
    if n % (64 * warpgroups) or (groups > 1 and n % 128) or not wgmma_fits_k(k):
        return None
    splits = k_splits or 1
    if k_splits is None and tokens <= bn:
        ctas = rows // (64 * warpgroups)
        while (ctas * splits < LINEAR_WGMMA_WORK // bn and k % (2 * splits * K_TILE) == 0
               and k // (2 * splits * K_TILE) >= LINEAR_WGMMA_MIN_SHARE and wgmma_fits_k(k // (2 * splits))):
            splits *= 2
    if k % (splits * K_TILE) or not wgmma_fits_k(k // splits):
        return None
    base = wgmma_tiling(bn, 0, 0, k, sms)
    min_ctas = base.min_ctas if warpgroups == base.warpgroups else 3 - warpgroups
    return replace(base, warpgroups=warpgroups, min_ctas=min_ctas,
                   depth=fit_depth(k // K_TILE // splits, 4), prefetch_next=0, k_splits=splits)


def linear_config(n: int, k: int, tokens: int, out_bf16: bool = False, groups: int = 1) -> GemmConfig:
    """The dense NVFP4 linear for ``tokens`` rows of x [., G, K] against ``groups`` W [N, K]: float32 out, calls whose
    mma.sync token tile is ``LINEAR_WGMMA_MIN_TILE`` or larger (twice that where W has fewer than
    ``LINEAR_WGMMA_NARROW_ROWS`` rows: the permute of x into the kernel's order costs more than WGMMA saves on a
    small W) run the WGMMA kernel where it tiles W (:func:`linear_wgmma_tiling`), the others the mma.sync kernel
    (:func:`linear_mma_config`)."""
    if not out_bf16 and smallest_tile(tokens, TILE_TOKEN_CHOICES) >= linear_wgmma_min_tile(n * groups):
        tiling = linear_wgmma_tiling(n, k, tokens, groups)
        if tiling is not None:
            return GemmConfig(GemmProblem(m=n, k=k, mode="store", b_order="staged", groups=groups), tiling)
    return linear_mma_config(n, k, tokens, out_bf16, groups)


def linear_wgmma_min_tile(rows: int) -> int:
    """The mma.sync token tile from which a dense linear of W with ``rows`` rows (N x groups) runs WGMMA."""
    return LINEAR_WGMMA_MIN_TILE * (2 if rows < LINEAR_WGMMA_NARROW_ROWS else 1)


def mma_linear_tiles(n: int, tokens: int) -> tuple[int, int, int]:
    """(token tile, token tiles, row tiles) of a dense linear's mma.sync kernel, NVFP4 or FP8, for W of ``n`` rows:
    the smallest token tile that holds the call, 128-row CTAs at the 32-token tile (x fragments reused 2x)."""
    bn = smallest_tile(tokens, TILE_TOKEN_CHOICES)
    return bn, -(-tokens // bn), 2 if bn == LINEAR_TWO_ROW_TILES_TOKENS and n % 128 == 0 else 1


def linear_mma_config(n: int, k: int, tokens: int, out_bf16: bool = False, groups: int = 1) -> GemmConfig:
    """The mma.sync configuration of a dense linear (:func:`linear_config`'s pick below the WGMMA kernel)."""
    problem = GemmProblem(m=n, k=k, mode="store", out_bf16=out_bf16, groups=groups)
    bn, tiles, row_tiles = mma_linear_tiles(n, tokens)
    splits = 1 if out_bf16 else pick_k_splits(n // 64 * groups * tiles, k // K_TILE, tiles, bn)
    return GemmConfig(problem, mma_tiling(problem, bn, row_tiles, k_splits=splits))


def linear_token_counts() -> tuple[int, ...]:
    """Token counts that between them reach every configuration :func:`linear_config` picks for a weight: each
    mma.sync tile below the narrow weights' WGMMA tile, each WGMMA tile as one call fills it, and a call of two
    128-token tiles (every longer call runs the same)."""
    mma = {t for t in TILE_TOKEN_CHOICES if t < 2 * LINEAR_WGMMA_MIN_TILE}
    return tuple(sorted(mma | set(LINEAR_WGMMA_TILES) | {2 * LINEAR_WGMMA_TILES[-1]}))


def fp8_linear_config(n: int, k: int, tokens: int, out_bf16: bool = False, groups: int = 1,
                      scale_f32: bool = False, x_f32: bool = False) -> Fp8LinearConfig:
    """The FP8 dense linear (``sm90_fp8_linear``) for ``tokens`` rows of x [., G, K] against ``groups`` W [N, K]: the
    NVFP4 linear's mma.sync token tile and row tiles (:func:`mma_linear_tiles`), its K split counted in its own
    CTAs, its pipeline as deep as
    the registers allow (a k-tile of FP8 weights is twice an NVFP4 one's)."""
    bn, tiles, row_tiles = mma_linear_tiles(n, tokens)
    # the grid's CTAs as they are (128 rows with two row tiles): at 32 tokens, splits to 256 of them took 9.0 / 9.5 /
    # 26.9 us for V4-Flash's shared w1, w2 and wo_b where half as many took 12.7 / 12.1 / 33.6
    splits = 1 if out_bf16 else pick_k_splits(n // (64 * row_tiles) * groups * tiles, k // K_TILE, tiles, bn)
    return Fp8LinearConfig(n=n, k=k, groups=groups, tile_tokens=bn, row_tiles=row_tiles,
                           depth=fit_depth(k // K_TILE // splits, 4 // row_tiles), k_splits=splits,
                           out_bf16=out_bf16, scale_f32=scale_f32, x_f32=x_f32)


def fp8_kernel_pays(tokens: int) -> bool:
    """Whether ``tokens`` rows run the FP8 linear kernel; longer calls run the weight dequantised to BF16
    (``Sm90Fp8Dequant``, one launch) and cuBLAS. A V4-Flash layer's FP8 linears on an H200: the kernel 190 us against
    251 at 64 tokens, 308 against 263 at 128 (its BF16 mma.sync MMAs bound it from there on), 669 against 299 at
    256; the largest weights (``wq_b``, ``wo_b``) cross first, the small ones (``wq_a``) last."""
    return tokens <= FP8_KERNEL_MAX_TOKENS


FP8_WGMMA_TOKENS = (33, 128)   # calls of these many tokens (inclusive) run the FP8 WGMMA linear where it tiles W


def fp8_wgmma_pays(tokens: int) -> bool:
    """Whether a call of ``tokens`` rows runs the FP8 WGMMA linear (``sm90_fp8_wgmma``) instead of the mma.sync
    kernel or the dequantised weight on cuBLAS. A V4-Flash layer's FP8 linears on an H200
    (``bench/fp8_linear_bench.py``): at 32 tokens 116.7 us against the mma.sync kernel's 114.6, at 64 144.8 against
    178.6, at 128 181.6 against the dequantised path's 246.9, at 2,048 1,945 against 1,003 (its BF16 MMAs and the
    weights decoded once per token tile bound it there)."""
    return FP8_WGMMA_TOKENS[0] <= tokens <= FP8_WGMMA_TOKENS[1]


FP8_W8A8_MIN_TOKENS = 1024   # calls of this many tokens and more run the W8A8 GEMM where it tiles W


def fp8_w8a8_pays(tokens: int) -> bool:
    """Whether a call of ``tokens`` rows runs the W8A8 GEMM (``sm90_fp8_gemm``: activations quantised per 128 K, as
    the official inference does, and FP8 tensor cores) instead of the weight dequantised to BF16 on cuBLAS: prefill
    chunks. A V4-Flash layer's FP8 linears at 2,048 tokens on an H200 (``bench/fp8_linear_bench.py``): 824.8 us, 51.4 %
    of the FP8 matmul rate, against the dequantised path's 1,003.0 us (42.2 %); calls of 129 to 1,023 tokens (the
    FP8 WGMMA linear's range ends at 128) have not been timed on it and stay on the dequantised path."""
    return tokens >= FP8_W8A8_MIN_TOKENS


def fp8_reads_f32_x(tokens: int) -> bool:
    """Whether the FP8 linear kernel reads float32 activations itself (rounding them to BF16 as it loads them) for a
    call of ``tokens`` rows, saving the cast's launch (a kernel of its own in the step's graph, nine calls a layer;
    a small torch kernel there takes about 0.7 us of GPU time plus its gap). Twice the activation bytes cost the
    kernel itself 5 / 10 / 43 us a layer at 1 / 8 / 16 tokens (a V4-Flash layer's FP8 linears on an H200: 80 / 84 /
    102 us with BF16 x, 85 / 94 / 144 us reading float32). The step with and without the cast at 1-8 tokens has not
    been measured side by side; at 128 sequences the cast won (3.68 against 4.76 ms)."""
    return tokens <= FP8_F32_X_MAX_TOKENS


def fp8_linear_token_counts() -> tuple[int, ...]:
    """Token counts that between them reach every configuration :func:`fp8_linear_config` picks for a weight (each
    token tile, as one call fills it and as two do, and a call of more tiles: every longer one runs the same)."""
    counts = set(TILE_TOKEN_CHOICES) | {2 * t for t in TILE_TOKEN_CHOICES} | {FP8_KERNEL_MAX_TOKENS}
    return tuple(sorted(t for t in counts if fp8_kernel_pays(t)))


# -- FP8 x FP8 (W8A8) GEMM, prefill -------------------------------------------------------------------------------
# The rules below are the tile arithmetic alone: the H200 run of the picks (docs/benchmarks.md, 51 % of the FP8
# rate for a V4-Flash layer at 2,048 tokens) has not been swept against other tile widths or stage counts.
FP8_GEMM_BLOCK_N = (128, 192)            # W8A8 GEMM tile widths the pick weighs (N rows of W per CTA) ...
FP8_GEMM_TILE_OVERHEAD = 32              # ... a tile of B columns taken to cost as B + this many at full rate
FP8_GEMM_ONE_WARPGROUP_TOKENS = 64       # calls up to this many tokens run 64-token tiles (one consumer warpgroup)
FP8_GEMM_MAX_STAGES = 8                  # 128-K stages of the shared-memory ring at most
FP8_GEMM_SMEM_RESERVE = 2048             # bytes kept for the ring's mbarriers and its 1024-byte alignment


def fp8_gemm_stages(block_m: int, block_n: int, k: int) -> int:
    """The deepest ring of 128-K stages (``block_m + block_n`` rows of 128 bytes each) that fits a CTA's shared
    memory, at most ``FP8_GEMM_MAX_STAGES`` and no more than the K-tiles (at least 2)."""
    fit = (SMEM_LIMIT - FP8_GEMM_SMEM_RESERVE) // ((block_m + block_n) * K_TILE)
    return max(2, min(fit, FP8_GEMM_MAX_STAGES, k // K_TILE))


def fp8_gemm_config(n: int, k: int, tokens: int, groups: int = 1, scale_f32: bool = False,
                    sms: int = 132) -> Fp8GemmConfig:
    """The W8A8 GEMM (``sm90_fp8_gemm``) for ``tokens`` rows of x [., G * K] against ``groups`` W [N, K].

    Tokens: 128-token tiles (two consumer warpgroups share each weight tile, half the weight traffic per FLOP of a
    64-token one), 64-token tiles up to ``FP8_GEMM_ONE_WARPGROUP_TOKENS`` tokens. Width: of the ``FP8_GEMM_BLOCK_N``
    that divide N, the one whose grid runs in the least time, counting each wave of CTAs (``sms`` at once, one CTA
    per SM) as long as its tile's columns plus ``FP8_GEMM_TILE_OVERHEAD`` (a wider tile reads less shared memory per
    FLOP): 192 where it saves a wave, e.g. V4-Flash's ``wq_a + wkv`` (N = 1536) at 2048 tokens, 128 tiles of 192
    instead of 192 of 128 on 132 SMs."""
    warpgroups = 1 if tokens <= FP8_GEMM_ONE_WARPGROUP_TOKENS else 2
    block_m = 64 * warpgroups
    m_tiles = -(-tokens // block_m)
    best = None
    for block_n in FP8_GEMM_BLOCK_N:
        if n % block_n:
            continue
        waves = -(-(m_tiles * (n // block_n) * groups) // sms)
        cost = waves * (block_n + FP8_GEMM_TILE_OVERHEAD)
        if best is None or cost < best[0]:
            best = (cost, block_n)
    block_n = best[1] if best else FP8_GEMM_BLOCK_N[0]
    return Fp8GemmConfig(n=n, k=k, groups=groups, block_n=block_n, warpgroups=warpgroups,
                         stages=fp8_gemm_stages(block_m, block_n, k), scale_f32=scale_f32)


def fp8_gemm_configs(n: int, k: int, groups: int = 1, scale_f32: bool = False,
                     min_tokens: int = 1) -> set[Fp8GemmConfig]:
    """Every configuration :func:`fp8_gemm_config` can pick for ``groups`` W [N, K] at ``min_tokens`` tokens or more
    (what a warm-up compiles): each warpgroup count those calls can take with each tile width that divides N."""
    counts = (1, 2) if min_tokens <= FP8_GEMM_ONE_WARPGROUP_TOKENS else (2,)
    return {Fp8GemmConfig(n=n, k=k, groups=groups, block_n=bn, warpgroups=wg,
                          stages=fp8_gemm_stages(64 * wg, bn, k), scale_f32=scale_f32)
            for wg in counts for bn in FP8_GEMM_BLOCK_N if n % bn == 0} or {fp8_gemm_config(n, k, min_tokens, groups,
                                                                                                scale_f32)}


# -- WGMMA (prefill) ------------------------------------------------------------------------------------------------
def pick_wgmma_tile_tokens(tokens: int, top_k: int, experts: int) -> tuple[int, int]:
    """Token tile N of the WGMMA kernels and their narrowest MMA width (0: every tile runs N).

    Below N = 64: the smallest of 32, 48 that holds 1.25x the mean pairs per expert m. From there on each tile runs
    the narrowest width (steps of 16, from ``WGMMA_MIN_WIDTH``) that holds its tokens, so N can hold nearly every
    expert: m + 3 sqrt(m) (an expert's count under uniform routing spreads by about sqrt(m)), up to 128. One
    narrowest width for every N keeps the plans few (one per N, compiled at load)."""
    mean = tokens * top_k / max(experts, 1)
    bn = smallest_tile(1.25 * mean, WGMMA_TILE_TOKENS)
    if bn < 64:
        return bn, 0
    return smallest_tile(mean + 3 * mean ** 0.5, WGMMA_TILE_TOKENS), WGMMA_MIN_WIDTH


def wgmma_tiling(tile_tokens: int, min_tokens: int, hidden: int, k: int, sms: int) -> WgmmaTiling:
    """CTA shape of the WGMMA kernels of a layer of width ``hidden`` for a token tile, one GEMM's K being ``k``.

    One warpgroup (64 weight rows) up to N = 96, so two CTAs (three up to N = 48, registers capped at 168) share an
    SM; two warpgroups above, where one 128-row CTA reuses each staged activation tile twice as much. From N = 64 on
    the weights are also prefetched ``WGMMA_L2_AHEAD`` k-tiles into the L2. Layers of ``WGMMA_WIDE_HIDDEN`` and wider
    take two warpgroups from N = 64 (they run at the power cap, where the larger CTAs run at a higher clock), up to
    N = ``WGMMA_TWO_GROUPS_MAX_TOKENS`` with two m64 row groups a warpgroup (256-row CTAs, 2 k-tiles in flight);
    two-warpgroup CTAs, one per SM, prefetch their successor's first k-tiles (``prefetch_next``)."""
    wide = hidden >= WGMMA_WIDE_HIDDEN
    if tile_tokens <= 48:
        shape = dict(warpgroups=1, min_ctas=3)
    elif tile_tokens <= 96 and not (wide and tile_tokens >= 64):
        shape = dict(warpgroups=1, min_ctas=2, l2_ahead=WGMMA_L2_AHEAD)
    elif wide and tile_tokens <= WGMMA_TWO_GROUPS_MAX_TOKENS:
        shape = dict(m_tiles=2, depth=2, l2_ahead=WGMMA_L2_AHEAD, prefetch_next=sms)
    else:
        shape = dict(l2_ahead=WGMMA_L2_AHEAD, prefetch_next=sms)
    depth = fit_depth(k // K_TILE, shape.pop("depth", 4))
    return WgmmaTiling(tile_tokens=tile_tokens, min_tokens=min_tokens, depth=depth, **shape)


def fp8_wgmma_config(n: int, k: int, tokens: int, groups: int = 1, scale_f32: bool = False
                     ) -> Fp8WgmmaConfig | None:
    """The FP8 WGMMA linear (``sm90_fp8_wgmma``) for ``tokens`` rows of x [., G, K] against ``groups`` W [N, K], or None
    where it does not tile W. ``sm90_fp8_linear`` runs it for the calls :func:`fp8_wgmma_pays` gives it. The grid is the
    NVFP4 WGMMA linear's (:func:`linear_wgmma_tiling`: token tile, warpgroups, K split, all measured for that kernel);
    the register pipeline holds 4 k-tiles at token tiles up to 64 and 2 at 128 (an FP8 k-tile is 32 bytes a row and
    thread, twice NVFP4's, beside 64 accumulators), 128-token tiles run two warpgroups, and ptxas is not capped (the
    registers say how many CTAs share an SM). None where W has no whole CTA of rows."""
    tiling = linear_wgmma_tiling(n, k, tokens, groups)
    if tiling is not None and tiling.tile_tokens > 64 and tiling.warpgroups == 1:
        # one warpgroup staging a 128-token tile holds 64 words of x a thread beside 64 accumulators: ptxas spilled
        # 48 bytes; two share the staging (and the grid's K split is counted for their 128-row CTAs)
        tiling = linear_wgmma_tiling(n, k, tokens, groups, warpgroups=2)
    if tiling is None:
        return None
    shares = k // K_TILE // tiling.k_splits
    return Fp8WgmmaConfig(n=n, k=k, groups=groups, tile_tokens=tiling.tile_tokens, warpgroups=tiling.warpgroups,
                          depth=fit_depth(shares, 4 if tiling.tile_tokens <= 64 else 2), k_splits=tiling.k_splits,
                          scale_f32=scale_f32)


def fp8_wgmma_token_counts() -> tuple[int, ...]:
    """Token counts that between them reach every configuration :func:`fp8_wgmma_config` picks for a weight: each
    token tile as one call fills it, and a call of two 128-token tiles (every longer call runs the same)."""
    return tuple(sorted(set(LINEAR_WGMMA_TILES) | {2 * LINEAR_WGMMA_TILES[-1]}))


# -- the MoE layer ---------------------------------------------------------------------------------------------------
# cached: a layer asks for every T up to its largest (4,096 calls) when it checks and compiles its plans at load
@functools.lru_cache(maxsize=1 << 16)
def moe_plan(shape: MoeShape, tokens: int, sms: int = 132, *, wgmma: bool | None = None) -> MoePlan:
    """What a call with ``tokens`` tokens runs (``wgmma``: force the WGMMA or the mma.sync path, for tests).

    * WGMMA kernels from ``WGMMA_MIN_MEAN`` pairs per expert (both K fit, ``wgmma_fits_k``), their N from
      :func:`pick_wgmma_tile_tokens`, N = 96 taken down to ``WGMMA_TWO_GROUPS_MAX_TOKENS`` for wide layers (two m64
      groups a warpgroup; the few experts above take two tiles);
    * otherwise the mma.sync kernels, with two row tiles per :func:`pick_row_tiles` (where the rows fill 128-row
      CTAs), interleaved up to ``INTERLEAVE_MAX_TOKENS`` tokens;
    * up to ``DIRECT_MAX_TOKENS`` tokens (distinct experts per token) no routing kernel: one tile per routed pair,
      L2 launched early (PDL), the block scales on fp32 partial sums with two row tiles (``block_columns``), and
      with one row tile L1's K split over two warps per row group (``k_warps``)."""
    h, i, e, k = shape.hidden, shape.intermediate, shape.experts, shape.top_k
    if wgmma is None:
        wgmma = use_wgmma(tokens, k, e) and wgmma_fits_k(h) and wgmma_fits_k(i) and wgmma_fits_rows(shape)
    # the WGMMA kernels read "staged" rows (x permuted on the way in, h written so by L1), the mma.sync L2 "lane" rows
    l1 = GemmProblem(m=2 * i, k=h, mode="swiglu", swiglu_limit=shape.swiglu_limit, weight_tiles=shape.weight_tiles,
                     b_order="staged" if wgmma else "logical", h_order="staged" if wgmma else "lane")
    l2 = GemmProblem(m=h, k=i, mode="scatter", weight_tiles=shape.weight_tiles,
                     b_order="staged" if wgmma else "lane")
    if wgmma:
        bn, min_tokens = pick_wgmma_tile_tokens(tokens, k, e)
        if h >= WGMMA_WIDE_HIDDEN and WGMMA_TWO_GROUPS_MAX_TOKENS < bn <= 96:
            bn = WGMMA_TWO_GROUPS_MAX_TOKENS
        return MoePlan(bn, GemmConfig(l1, wgmma_tiling(bn, min_tokens, h, h, sms)),
                       GemmConfig(l2, wgmma_tiling(bn, min_tokens, h, i, sms)))
    rt = pick_row_tiles(tokens, k, e, 2 * i, sms) if h % 128 == 0 and (2 * i) % 128 == 0 else 1
    direct = shape.distinct_experts and tokens <= DIRECT_MAX_TOKENS
    interleave = rt == 2 and tokens <= INTERLEAVE_MAX_TOKENS
    if not direct:
        bn = pick_tile_tokens(tokens, k, e)
        return MoePlan(bn, GemmConfig(l1, mma_tiling(l1, bn, rt, interleave=interleave)),
                       GemmConfig(l2, mma_tiling(l2, bn, rt, interleave=interleave)))
    l1 = GemmProblem(**{**vars(l1), "direct_top_k": k})
    l2 = GemmProblem(**{**vars(l2), "direct_top_k": k})
    block_columns = rt == 2
    return MoePlan(None, GemmConfig(l1, mma_tiling(l1, 8, rt, k_warps=1 if rt == 2 else 2, interleave=interleave,
                                                   block_columns=block_columns, direct=True)),
                   GemmConfig(l2, mma_tiling(l2, 8, rt, interleave=interleave, block_columns=block_columns,
                                             direct=True)))


def wgmma_fits_rows(shape: MoeShape) -> bool:
    """Whether every WGMMA CTA shape :func:`wgmma_tiling` can pick tiles both GEMMs' rows (2I and H): 256-row CTAs
    on wide layers, 128-row ones on the others."""
    rows = 256 if shape.hidden >= WGMMA_WIDE_HIDDEN else 128
    return (2 * shape.intermediate) % rows == 0 and shape.hidden % rows == 0


# -- decode attention ------------------------------------------------------------------------------------------------
MAX_CLUSTER = 4     # the largest cluster pick_cluster picks (a merge of more splits was slower than the combine kernel)
CLUSTER_GRID = 64   # CTAs up to which clusters of more than two CTAs are picked (4-CTA clusters in a full grid were
                    # slower: the GPCs did not hold all of them at once)


def pick_splits(batch: int, heads: int, entries: int, sms: int = 132) -> int:
    """Splits per (request, head block): at most one wave of CTAs (one CTA per SM), no empty split;
    no split at all once the requests alone fill the SMs (no partials, no combine)."""
    n_chunks = max(1, -(-entries // ATTENTION_CHUNK))
    ctas = batch * (heads // ATTENTION_HEADS_PER_CTA)
    splits = max(1, min(n_chunks, sms // ctas))
    cps = -(-n_chunks // splits)
    return -(-n_chunks // cps)   # the fewest splits with that longest split: fewer partials to merge


def pick_cluster(batch: int, heads: int, entries: int, sms: int = 132, max_cluster: int = MAX_CLUSTER) -> int:
    """Cluster size for :func:`pick_splits`' splits (1: no cluster, partials through HBM and the combine
    kernel). A cluster is all the splits of a head block, rounded up to a power of two (the extra CTAs
    hold no chunk and share the merge), at most ``max_cluster``; clusters of more than two CTAs only
    while the grid has at most ``CLUSTER_GRID`` CTAs."""
    splits = pick_splits(batch, heads, entries, sms)
    ctas = batch * (heads // ATTENTION_HEADS_PER_CTA)
    cl = 1 << (splits - 1).bit_length()
    if splits == 1 or cl > max_cluster or cl * ctas > sms or (cl > 2 and cl * ctas > CLUSTER_GRID):
        return 1
    return cl


# -- decode indexer top-k --------------------------------------------------------------------------------------------
SORT_TOPK_MAX_KEYS = 1 << 20  # keys (all requests) up to which the sort kernel's segment passes beat torch.topk


def sort_topk_pays(batch: int, entries: int, k: int, segment: int = 4096) -> bool:
    """Whether the sort kernel beats ``torch.topk`` on ``batch`` lists of ``entries`` keys: one CTA a list up to
    ``segment`` keys, segment passes over longer lists up to ``SORT_TOPK_MAX_KEYS`` keys in all."""
    return max(entries, k) <= segment or batch * entries <= SORT_TOPK_MAX_KEYS


# -- decode compressor step ------------------------------------------------------------------------------------------
COMPRESS_MAX_CLUSTER = 8       # CTAs of a slot at most: the portable cluster size (16 needs a non-portable opt-in)
COMPRESS_MIN_CHANNELS = 32     # channels of a CTA at least: one warp, so that RoPE pairs stay in a warp
COMPRESS_MAX_THREADS = 1024    # threads of a CTA: channels x slot groups


def compress_step_config(ratio: int, dim: int, overlap: bool, rope_dim: int, eps: float) -> CompressStepConfig:
    """How ``Sm90CompressStep`` spreads one slot's update, from the compressor's shape alone (one compile per
    compressor, whatever the batch).

    A step reads a few tens of KB a slot (HCA: 768 KB, the window and ``ape``) and does a few dependent float
    operations per value: at a small batch its time is the latency of one SM pulling those bytes and of each
    thread's chain over the window's slots, not bandwidth. So a slot's channels go to as many CTAs as a portable
    cluster holds while each keeps a whole warp of channels (d = 512: 8 CTAs of 64; the indexer's d = 128: 4 of
    32), and a CTA's threads split the slots into the most groups that divide the window and fit 1024 threads
    (HCA: 16 groups of 8 slots, every thread's 8 slots loaded at once; CSA: 4 groups of one slot and its ``prev``
    twin). At a large batch the grid is many waves of such CTAs, each as short, so the split costs little there."""
    cluster = 1
    while (cluster < COMPRESS_MAX_CLUSTER and dim % (2 * cluster) == 0
           and (dim // (2 * cluster)) % COMPRESS_MIN_CHANNELS == 0):
        cluster *= 2
    channels = dim // cluster
    groups = max([g for g in range(1, ratio + 1) if ratio % g == 0 and channels * g <= COMPRESS_MAX_THREADS],
                 default=1)
    return CompressStepConfig(ratio=ratio, dim=dim, overlap=overlap, rope_dim=rope_dim, eps=float(eps),
                              cluster=cluster, groups=groups)


# -- mHC hc_pre with its product by fn --------------------------------------------------------------------------------
HC_PRE_CLUSTERS = (16, 8, 4, 2, 1)   # CTAs of a token, largest first; 16 is Hopper's largest (non-portable) cluster
HC_PRE_PORTABLE_CLUSTER = 8          # the largest cluster any GPC of the H200 places
HC_PRE_MAX_THREADS = 1024            # a CTA's threads: one 16-byte piece of the token's streams each


HC_PRE_FUSED_MAX_TOKENS = 16


def hc_pre_fused_pays(tokens: int) -> bool:
    """Whether ``Sm90HcPreFused`` (the product by ``fn`` in the kernel) beats cuBLAS's product then ``Sm90HcPre``
    for a call of ``tokens`` tokens. Measured on the H200 (``bench/hc_pre_bench.py``, L2 cold, V4-Flash / V4-Pro):
    1 token 12.2 / 14.2 us against 14.3 / 17.6; 8 tokens 13.0 / 15.9 against 23.2 / 28.9; 32 tokens 22.1 / 36.0
    against 24.6 / 31.3; 128 tokens 55.0 / 102.2 against 30.0 / 42.0: every CTA of a token's cluster reads its slice
    of ``fn`` for each token, where cuBLAS reads ``fn`` once for all of them."""
    return tokens <= HC_PRE_FUSED_MAX_TOKENS


def hc_pre_fused_config(hc: int, hidden: int, tokens: int, *, iters: int, hc_eps: float, norm_eps: float,
                        norm: bool = True, sms: int = 132) -> HcPreFusedConfig:
    """How ``Sm90HcPreFused`` spreads a token over a cluster of CTAs.

    At a decode step's few tokens the launch is latency: a token reads all of ``fn`` (24 x hc x H floats: 1.5 MB for
    V4-Flash, 2.75 MB for V4-Pro), which one SM pulls at roughly 100 GB/s, so the reads are split over as many SMs
    as a cluster holds, each CTA's loads all in flight at once (one 16-byte piece of the streams and the 24 of
    ``fn`` that multiply it a thread). 16-CTA clusters (non-portable: CuTeDSL opts every kernel in) while the grid
    stays within one wave of ``sms`` CTAs, else 8, the portable size (a GPC with fewer than 16 SMs free cannot place
    a 16-CTA cluster, so a grid of them queues); a cluster must cut each stream into whole 16-byte pieces and keep
    its CTAs within ``HC_PRE_MAX_THREADS`` threads. Measured on the H200 (``bench/hc_pre_bench.py``, L2 cold): at
    one token 16 CTAs beat 8 (V4-Flash 12.1 against 12.5 us, V4-Pro 14.2 against 14.5), at eight tokens 8 beat 16
    (12.4 against 12.9, 14.8 against 16.0), so 16 only while the grid fills at most half of the SMs."""
    config = None
    for cluster in HC_PRE_CLUSTERS:
        config = HcPreFusedConfig(hc=hc, hidden=hidden, iters=iters, hc_eps=float(hc_eps), norm_eps=float(norm_eps),
                                  norm=norm, cluster=cluster)
        if cluster > HC_PRE_PORTABLE_CLUSTER and tokens * cluster > sms // 2:
            continue
        if hidden % (4 * cluster) == 0 and config.threads <= HC_PRE_MAX_THREADS:
            return config
    return config
