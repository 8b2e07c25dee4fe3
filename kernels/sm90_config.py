"""Static configurations of the SM90 NVFP4 and FP8 GEMMs, of the MoE layer, of the decode compressor step and of
the mHC ``hc_pre`` with its product by ``fn``: what a compiled kernel is specialised on.

Frozen dataclasses, so a configuration is a value: it keys the compile cache (``cute_host``), it prints as what it
is, and a kernel object cannot drift from it. ``sm90_heuristics`` builds them from the layer shape and the token
count; the kernels (``sm90_moe_gemm``, ``sm90_moe_wgmma``) validate them (``can_implement``) and compile them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GEMM_MODES = ("swiglu", "scatter", "store")
K_TILE = 128      # logical K per k-tile of both GEMM families (16 bytes of one weight row per lane)
WIDTH_STEP = 16   # between the MMA widths of one WGMMA kernel (``WgmmaTiling.min_tokens``)
ATTENTION_CHUNK = 64          # KV entries per pipeline step of the decode attention kernel
ATTENTION_HEADS_PER_CTA = 64  # heads per CTA of the decode attention kernel (one wgmma m64 tile)
SMEM_LIMIT = 227 * 1024       # shared memory one CTA may ask for on sm_90 (the launch fails above it)


@dataclass(frozen=True)
class GemmProblem:
    """What one grouped GEMM computes and how its operands are laid out (contract: ``sm90_moe_gemm``).

    Attributes:
        m: weight rows per expert (2I for L1, H for L2, out features for a dense linear).
        k: reduction size (H for L1, I for L2), a multiple of 128.
        mode: ``"swiglu"`` (L1), ``"scatter"`` (L2) or ``"store"`` (dense, one group).
        swiglu_limit: the clamp L of ``"swiglu"`` (None: no clamp).
        weight_tiles: the weights are in Hopper row tiles (``row_tiles``, converter ``--target sm90``).
        b_order: K order of the activation rows the GEMM reads (``k_order``: ``"logical"``, ``"lane"``; the WGMMA
            kernel reads ``"staged"`` rows).
        h_order: ``"swiglu"``: K order ``h`` is written in, the order the L2 GEMM reads.
        out_bf16: ``"store"`` writes BF16 instead of float32.
        direct_top_k: MoE modes without the routing kernel (> 0: the top-k): work tile ``p`` is routed pair ``p``
            alone, read from ``topk_ids`` / ``topk_weights`` in [T, k] order.
        groups: ``"store"``: G independent linears of one launch (a grouped projection such as ``wo_a``): weights
            [G, M, K/2], x [T, G, K], out [T, G, M], one ``alpha`` for all; M a multiple of 128 (each group's block
            scales are whole swizzle atoms).
    """

    m: int
    k: int
    mode: str
    swiglu_limit: float | None = None
    weight_tiles: bool = False
    b_order: str = "logical"
    h_order: str = "logical"
    out_bf16: bool = False
    direct_top_k: int = 0
    groups: int = 1


@dataclass(frozen=True)
class MmaTiling:
    """CTA shape and schedule of the mma.sync GEMM (``Sm90Nvfp4MmaGemm``): decode, mid token counts, dense linears.

    Attributes:
        tile_tokens: tokens per work tile, a multiple of 8 up to 64 (8 per MMA).
        row_tiles: 16-row groups per warp (1 or 2); a CTA is 4 warps, 64 or 128 weight rows.
        depth: k-tiles of weight loads in flight per thread (1, 2 or 4, dividing the k-tiles each warp walks).
        k_warps: warps that share one row group's K (1 or 2; one-token tiles of the MoE modes).
        interleave_rows: decode both row tiles of a k-tile first and interleave their MMAs (two row tiles).
        block_columns: one-token direct tiles use the MMA's 8 columns for the k-tile's 8 scale blocks, so the block
            scales go on fp32 partial sums; both GEMMs of a layer must agree (``"swiglu"`` writes ``h`` scaled).
        stage_x: a direct ``"swiglu"`` CTA first copies its token's row of x into shared memory, in the ``"lane"``
            K order.
        pdl: the direct MoE chain under programmatic dependent launch: L1 (``"swiglu"``) lets L2 launch at once,
            L2 (``"scatter"``) starts its weight loads, then waits for L1's ``h``.
        max_ctas: CTAs per SM at most (0: no cap), by padding the CTA's shared memory.
        k_splits: ``"store"`` with float32 out: K is split over this many CTAs (grid z), each adding its partial sum
            into ``out`` (``red.add``; the caller zeroes ``out``), so that a small linear at few tokens still has a
            CTA on every SM streaming its weights.
    """

    tile_tokens: int = 8
    row_tiles: int = 1
    depth: int = 4
    k_warps: int = 1
    interleave_rows: bool = False
    block_columns: bool = False
    stage_x: bool = False
    pdl: bool = False
    max_ctas: int = 0
    k_splits: int = 1


@dataclass(frozen=True)
class WgmmaTiling:
    """CTA shape and schedule of the WGMMA GEMM (``Sm90Nvfp4WgmmaGemm``): MoE prefill, dense linears from
    ``sm90_heuristics.LINEAR_WGMMA_MIN_TILE`` tokens.

    Attributes:
        tile_tokens: N, tokens per work tile (16..256, a multiple of 16).
        min_tokens: the narrowest MMA width (0: N): a tile runs the narrowest of ``min_tokens``,
            ``min_tokens + 16``, .., N that holds its tokens.
        warpgroups: warpgroups per CTA (1 or 2), each 64 weight rows per m64 group.
        m_tiles: m64 row groups per warpgroup (1 or 2).
        depth: k-tiles of weight loads in flight per thread (2 or 4; 1 only when K is one k-tile).
        min_ctas: CTAs that must fit on one SM (ptxas caps the registers to match; 1: no cap).
        l2_ahead: k-tiles ahead of the register pipeline that the weights are prefetched into the L2 (0: none).
        prefetch_next: with ``l2_ahead``, the CTAs resident at once (0: off): a CTA then prefetches the first weight
            k-tiles of the CTA that many blocks after it.
        k_splits: ``"store"`` with float32 out: K is split over this many CTAs (grid z), as ``MmaTiling.k_splits``.
    """

    tile_tokens: int = 128
    min_tokens: int = 0
    warpgroups: int = 2
    m_tiles: int = 1
    depth: int = 4
    min_ctas: int = 1
    l2_ahead: int = 0
    prefetch_next: int = 0
    k_splits: int = 1


Tiling = MmaTiling | WgmmaTiling


@dataclass(frozen=True)
class Fp8LinearConfig:
    """One compiled FP8 dense linear (``sm90_fp8_linear``): E4M3 weights with 128 x 128 block scales, BF16 x.

    Attributes:
        n: weight rows per group (out features).
        k: in features per group, a multiple of 128.
        groups: G linears of one launch (a grouped projection such as ``wo_a``): weights [G * N, K], x [T, G, K],
            out [T, G, N]; N a multiple of 128 (a CTA's rows share one block row of scales).
        tile_tokens: tokens per work tile, a multiple of 8 up to 64 (8 per MMA).
        row_tiles: 16-row groups per warp (1 or 2); a CTA is 4 warps, 64 or 128 weight rows.
        depth: k-tiles of weight loads in flight per thread (1, 2 or 4; at most 4 / ``row_tiles``).
        k_splits: float32 out: K is split over this many CTAs (grid z), each adding its partial sums into ``out``
            (the caller zeroes it).
        out_bf16: BF16 out instead of float32.
        scale_f32: the block scales are float32 (-Base checkpoints), not E8M0 bytes.
        x_f32: x is float32 (the runtime's activations), rounded to BF16 as the kernel reads it.
    """

    n: int
    k: int
    groups: int = 1
    tile_tokens: int = 8
    row_tiles: int = 1
    depth: int = 4
    k_splits: int = 1
    out_bf16: bool = False
    scale_f32: bool = False
    x_f32: bool = False


@dataclass(frozen=True)
class Fp8WgmmaConfig:
    """One compiled FP8 dense linear on warpgroup MMAs (``sm90_fp8_wgmma``): E4M3 weights with 128 x 128 block
    scales, BF16 x, float32 out; for calls of 32 tokens and more.

    Attributes:
        n: weight rows per group (out features).
        k: in features per group, a multiple of 128.
        groups: G linears of one launch, as ``Fp8LinearConfig.groups`` (N a multiple of 128).
        tile_tokens: N of the MMAs, tokens per work tile (a multiple of 16, 16..256).
        warpgroups: warpgroups per CTA (1 or 2), 64 weight rows each.
        depth: k-tiles of weight loads in flight per thread (2 or 4; 1 only when a CTA walks one k-tile).
        k_splits: K is split over this many CTAs (grid z), each adding its partial sums into ``out`` (the caller
            zeroes it).
        min_ctas: CTAs that must fit on one SM (ptxas caps the registers to match; 1: no cap).
        scale_f32: the block scales are float32 (-Base checkpoints), not E8M0 bytes.
    """

    n: int
    k: int
    groups: int = 1
    tile_tokens: int = 128
    warpgroups: int = 1
    depth: int = 2
    k_splits: int = 1
    min_ctas: int = 1
    scale_f32: bool = False


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One compiled FP8 x FP8 (W8A8) block-scaled GEMM (``sm90_fp8_gemm``): E4M3 activations with one float32 scale
    per token and 128 K, E4M3 weights with 128 x 128 block scales, float32 out.

    Attributes:
        n: weight rows per group (out features), a multiple of 128 and of ``block_n``.
        k: in features per group, a multiple of 128.
        groups: G linears of one launch (``wo_a``): weights [G * N, K], x [T, G * K], out [T, G * N].
        block_n: weight rows (output columns) per CTA tile: 64, 128 or 192 (the wgmma's N).
        warpgroups: consumer warpgroups, each 64 tokens of the tile (``block_m`` = 64 x warpgroups), beside one
            producer warpgroup that issues the TMA loads.
        stages: 128-K stages of both operands in the shared-memory ring.
        scale_f32: the weight's block scales are float32 (-Base checkpoints), not E8M0 bytes.
    """

    n: int
    k: int
    groups: int = 1
    block_n: int = 128
    warpgroups: int = 2
    stages: int = 6
    scale_f32: bool = False

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups


@dataclass(frozen=True)
class GemmConfig:
    """One compiled GEMM: its problem and its tiling (the tiling's type picks the kernel family)."""

    problem: GemmProblem
    tiling: Tiling



@dataclass(frozen=True)
class CompressStepConfig:
    """One compiled decode-step compressor update (``sm90_compressor``): what a CSA, indexer or HCA compressor is,
    and how a slot's work is spread (``sm90_heuristics.compress_step_config`` picks ``cluster`` and ``groups``).

    Attributes:
        ratio: tokens per window (V4: 4 for CSA and its indexer, 128 for HCA).
        dim: d, the width of a compressed entry (V4: 512, the indexer's 128).
        overlap: CSA: an entry pools the previous window's first half too, and the projections are C = 2d wide;
            HCA: C = d.
        rope_dim: the last ``rope_dim`` channels of an entry are rotated (V4: 64).
        eps: the RMSNorm's epsilon (``rms_norm_eps``).
        cluster: CTAs of a slot, one thread-block cluster: each takes ``dim / cluster`` channels (whole warps), and
            the RMSNorm's sum of squares is added up through distributed shared memory.
        groups: thread groups of a CTA, each pooling ``ratio / groups`` of the window's slots for every channel of
            the CTA (partial softmax sums combined through shared memory); ``dim / cluster * groups`` threads.
    """

    ratio: int
    dim: int
    overlap: bool
    rope_dim: int
    eps: float
    cluster: int = 1
    groups: int = 1

    @property
    def width(self) -> int:
        """C, the channels of a token's kv and gate projections."""
        return 2 * self.dim if self.overlap else self.dim

    @property
    def channels(self) -> int:
        """Entry channels one CTA takes."""
        return self.dim // self.cluster

    @property
    def slots(self) -> int:
        """Slots of the window one thread pools (with the overlap, as many of ``prev`` too)."""
        return self.ratio // self.groups


@dataclass(frozen=True)
class HcPreFusedConfig:
    """One compiled mHC ``hc_pre`` with its product by ``fn`` (``sm90_mhc.Sm90HcPreFused``): the token's shape, the
    weights' settings, and how a token is spread (``sm90_heuristics.hc_pre_fused_config`` picks ``cluster``).

    Attributes:
        hc: streams per token (V4: 4).
        hidden: H, the width of a stream (V4-Flash 4096, V4-Pro 7168).
        iters: Sinkhorn rounds of the comb (the first column normalisation counts as one).
        hc_eps: the weights' epsilon. norm_eps: the RMS norms' epsilon (the streams' and the sublayer's).
        norm: the sublayer's RMSNorm (with its weight) follows the collapse in the same launch.
        cluster: CTAs of a token, one thread-block cluster: CTA ``r`` takes columns ``[r * H / cluster, (r + 1) *
            H / cluster)`` of every stream, of ``fn``'s matching columns and of the sublayer input.
    """

    hc: int
    hidden: int
    iters: int
    hc_eps: float
    norm_eps: float
    norm: bool = True
    cluster: int = 1

    @property
    def columns(self) -> int:
        """Columns of each stream (and of the sublayer input) one CTA takes."""
        return self.hidden // self.cluster

    @property
    def chunks(self) -> int:
        """16-byte pieces of the token's streams one CTA reads: one a thread."""
        return self.hc * self.columns // 4

    @property
    def threads(self) -> int:
        """Threads of a CTA: :attr:`chunks` rounded up to whole warps."""
        return -(-self.chunks // 32) * 32


@dataclass(frozen=True)
class MoeShape:
    """An MoE layer as the kernels see it.

    Attributes:
        hidden: H. intermediate: I (per expert). experts: E held by this rank. top_k: k.
        swiglu_limit: clamp of the SwiGLU (None: no clamp).
        weight_tiles: ``w13`` / ``w2`` in Hopper row tiles (``--target sm90``).
        distinct_experts: one token's k pairs go to k distinct experts. False on a rank holding part of the
            experts, which maps the pairs it does not hold to local expert 0 (weight 0): then every call runs the
            routing kernel, which reads each expert once.
    """

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    swiglu_limit: float | None = None
    weight_tiles: bool = False
    distinct_experts: bool = True


@dataclass(frozen=True)
class MoePlan:
    """What a call with T tokens runs: the routing kernel's token tile (None: a direct call, no routing kernel),
    and the L1 and L2 GEMMs."""

    routing_tile: int | None
    l1: GemmConfig
    l2: GemmConfig

    @property
    def direct(self) -> bool:
        return self.routing_tile is None

    @property
    def wgmma(self) -> bool:
        return isinstance(self.l1.tiling, WgmmaTiling)


def replace_tilings(plan: MoePlan, *, l1: dict | None = None, l2: dict | None = None, both: dict | None = None
                    ) -> MoePlan:
    """``plan`` with fields of its GEMMs' tilings replaced (``both``, then ``l1`` / ``l2``): a variant the heuristics
    do not pick, for tests against the reference and A/B benchmarks. The kernels check the result."""
    configs = {}
    for name, own in (("l1", l1), ("l2", l2)):
        config = getattr(plan, name)
        configs[name] = replace(config, tiling=replace(config.tiling, **{**(both or {}), **(own or {})}))
    return replace(plan, **configs)
