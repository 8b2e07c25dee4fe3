"""FP8 x FP8 (W8A8) block-scaled GEMM on Hopper (sm_90a) for prefill-sized dense linears, and its activation
quantiser.

What the official DeepSeek-V4 inference runs for its FP8 linears (as DeepGEMM does): x is quantised per token and
128 K (a 1 x 128 block: float32 scale ``amax / 448``, E4M3 values ``x / scale``), the weight is the released E4M3
[G * N, K] with one scale per 128 x 128 block, and

    out[t, n] = sum over 128-K blocks kb of (xq[t, kb] . w[n, kb]) * sx[t, kb] * sw[n // 128, kb]

in float32. FP8 tensor cores run at twice the BF16 rate, so this reaches more of the H200's matmul rate than the
weight dequantised to BF16 and a cuBLAS BF16 GEMM (``sm90_fp8_linear``'s long calls) can.

:class:`Sm90Fp8ActQuant`: x BF16 or float32 [T, C] -> E4M3 bytes [T, C] and float32 scales [T, C / 128], one warp a
block (4 values a lane, the block's amax by butterfly shuffles). A zero block gets scale 0 and zero bytes (the
division is by 1 there), so its products are 0. Bit for bit what :func:`fp8_reference.fp8_act_quantize` computes: the
same float32 division (IEEE, ``div.rn``) and the same round-to-nearest-even cast (every quotient is at most 448 in
magnitude up to one rounding, where saturating and torch's cast agree).

:class:`Sm90Fp8Gemm`: one CTA a ``block_m`` x ``block_n`` output tile (tokens x weight rows) of one group; a
producer warpgroup, of which one thread issues the TMA loads of both operands' 128-K tiles (K-major, 128-byte
swizzle, rows past T zero-filled) into a ring of ``stages`` slots with full / empty mbarriers
(``PipelineTmaAsync``); ``warpgroups`` consumer warpgroups, each 64 tokens of the tile, running ``wgmma
m64nBk32`` E4M3 x E4M3 -> float32 on both operands in shared memory. Promotion, as DeepGEMM does it: a 128-K
block's four k32 steps accumulate into a temporary accumulator (the first step overwrites it), then each value is
multiplied by ``sx[token, kb] * sw[n // 128, kb]`` and added into the main float32 accumulator, so every block's
partial dot product carries its own scales exactly as the formula above. The promotion of block kb waits for its
MMAs (``wait_group 0``), then the MMAs of block kb + 1 are issued and block kb's ring slot is released; while one
warpgroup promotes, the other's MMAs keep the tensor cores busy. Block kb + 1's scales are loaded (from global
memory: a few bytes a thread, L2-resident) just before its MMAs are issued, so their latency hides behind them. The
float32 results are stored straight from the registers (8 bytes a store; rows past T are not stored).

Register budget: consumers raise their registers to ``CONSUMER_REGISTERS`` (``setmaxnreg``), the producer lowers
its own to ``PRODUCER_REGISTERS``; a consumer thread holds the tile's accumulators twice (``block_n`` / 2 floats
each: the main one and the temporary one).

Accumulator layout (the wgmma D fragment of a m64nB tile, CuTe's ``CLayout_64xN``): value ``i = v + 2 h + 4 j`` of
thread ``l`` of warp ``w`` of the warpgroup is row ``16 w + l // 4 + 8 h``, column ``8 j + 2 (l % 4) + v``.

Groups (``wo_a``): a grid dimension; group g reads x's columns g K .. (g + 1) K, W's rows g N .. (g + 1) N and
writes out's columns g N .. (g + 1) N (the operands are viewed as (rows, K, G) tensors for the TMA).

The configuration is an ``Fp8GemmConfig`` (``sm90_config``) picked by ``sm90_heuristics.fp8_gemm_config``;
:meth:`Sm90Fp8Gemm.can_implement` says whether the kernel takes one; ``sm90_fp8_linear`` runs it for calls of
``sm90_heuristics.FP8_W8A8_MIN_TOKENS`` tokens and more. On an H200 a V4-Flash layer's FP8 linears at 2,048 tokens
ran at 51 % of the FP8 matmul rate (``docs/benchmarks.md``).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import K_TILE, SMEM_LIMIT, Fp8GemmConfig
from .sm90_fp8_linear import SCALE_BLOCK, _scale_operand, fp8_operands
from .sm90_heuristics import FP8_GEMM_SMEM_RESERVE, fp8_gemm_config, fp8_gemm_configs

E4M3_MAX = 448.0             # the largest finite E4M3 value: a block's amax maps to it
CONSUMER_REGISTERS = 232     # per consumer thread after ``setmaxnreg`` (two warpgroups: 2 x 128 x 232 + 128 x 40 fit
PRODUCER_REGISTERS = 40      # the 64 K registers of an SM)
BLOCK_NS = (64, 128, 192)    # tile widths the kernel takes (a 192-wide tile spans two 128-row scale blocks)
K_STEPS = K_TILE // 32       # wgmma k32 steps per 128-K block


def stage_bytes(config: Fp8GemmConfig) -> int:
    """Shared memory of one ring slot: a 128-K tile of both operands, one byte an element."""
    return (config.block_m + config.block_n) * K_TILE


def gemm_violations(config: Fp8GemmConfig) -> list[str]:
    """What in ``config`` the kernel does not take (empty: it takes it)."""
    c, bad = config, []
    if c.block_n not in BLOCK_NS:
        bad.append(f"block_n must be one of {BLOCK_NS}, got {c.block_n}")
    elif c.n <= 0 or c.n % SCALE_BLOCK or c.n % c.block_n:
        bad.append(f"N={c.n} must be a positive multiple of {SCALE_BLOCK} and of block_n={c.block_n}")
    if c.k <= 0 or c.k % K_TILE:
        bad.append(f"K={c.k} must be a positive multiple of {K_TILE}")
    if c.groups < 1:
        bad.append(f"groups must be >= 1, got {c.groups}")
    if c.warpgroups not in (1, 2):
        bad.append(f"warpgroups must be 1 or 2, got {c.warpgroups}")
    elif c.stages < 2 or c.stages * stage_bytes(c) + FP8_GEMM_SMEM_RESERVE > SMEM_LIMIT:
        bad.append(f"stages must be >= 2 and fit {SMEM_LIMIT} bytes of shared memory with "
                   f"{stage_bytes(c)} a stage; got {c.stages}")
    return bad


class Sm90Fp8ActQuant:
    """The activation quantiser (module docstring), one warp a 1 x 128 block.

    Launched as ``fn(x, xq, sx, stream)``: ``x`` BF16 or float32 (``x_f32``) [T, C] (C a multiple of 128), ``xq``
    uint8 [T, C] (E4M3 bytes), ``sx`` float32 [T, C / 128].
    """

    THREADS = 256

    def __init__(self, *, x_f32: bool):
        self.x_f32 = x_f32

    def key(self) -> tuple:
        return (self.x_f32,)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        blocks = mX.shape[0] * (mX.shape[1] // K_TILE)
        per_cta = self.THREADS // 32
        self.kernel(mX, mQ, mS).launch(grid=[(blocks + per_cta - 1) // per_cta, 1, 1], block=[self.THREADS, 1, 1],
                                       stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        block = bx * (self.THREADS // 32) + tidx // 32
        per_row = mX.shape[1] // K_TILE
        if block < mX.shape[0] * per_row:
            row = block // per_row
            first = Int64(row) * mX.shape[1] + Int64((block % per_row) * K_TILE + lane * 4)  # element index
            v = cute.make_rmem_tensor((4,), Float32)
            if const_expr(self.x_f32):
                w = ptx.ld_global_v4(mX.iterator.toint() + first * 4)
                for i in cutlass.range_constexpr(4):
                    v[i] = ptx.f32_of_bits(w[i])
            else:
                w = ptx.ld_global_v2_b32(mX.iterator.toint() + first * 2)
                for i in cutlass.range_constexpr(2):   # a BF16 is the high half of its float32
                    v[2 * i] = ptx.f32_of_bits(w[i] << 16)
                    v[2 * i + 1] = ptx.f32_of_bits(w[i] & Int32(-65536))
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(4):
                amax = cute.arch.fmax(amax, cute.arch.fmax(v[i], -v[i]))
            amax = ptx.lane_max(amax)
            scale = ptx.div_rn_f32(amax, Float32(E4M3_MAX))
            div = scale
            if scale == Float32(0.0):
                div = Float32(1.0)          # a zero block: zero bytes, scale 0
            y = cute.make_rmem_tensor((4,), Float32)
            for i in cutlass.range_constexpr(4):
                y[i] = ptx.div_rn_f32(v[i], div)
            q = ptx.f32x4_to_e4m3x4(y[0], y[1], y[2], y[3])
            ptx.st_global_b32(mQ.iterator.toint() + first, q)
            if lane == 0:
                mS[row, block % per_row] = scale


class Sm90Fp8Gemm:
    """One compiled configuration of the W8A8 GEMM (module docstring).

    Launched as ``fn(xq, sx, w, sw, out, stream)``: ``xq`` uint8 (E4M3) [T, G * K], ``sx`` float32 [T, G * K / 128],
    ``w`` uint8 (E4M3) [G * N, K], ``sw`` uint8 (E8M0) or float32 (``scale_f32``) [G * N / 128, K / 128], ``out``
    float32 [T, G * N].
    """

    def __init__(self, config: Fp8GemmConfig):
        bad = gemm_violations(config)
        _expect(not bad, f"FP8 GEMM {config}: " + "; ".join(bad))
        self.config = config
        self.n, self.k, self.groups = config.n, config.k, config.groups
        self.bm, self.bn = config.block_m, config.block_n
        self.consumers = config.warpgroups
        self.threads = 128 * (1 + self.consumers)
        self.stages = config.stages
        self.k_tiles = config.k // K_TILE
        # a tile inside one 128-row scale block has one weight scale a K block; a 192-wide one spans two
        self.sw_count = 1 if SCALE_BLOCK % self.bn == 0 else 2

    @staticmethod
    def can_implement(config: Fp8GemmConfig) -> bool:
        return not gemm_violations(config)

    def key(self) -> tuple:
        return (self.config,)

    @property
    def compile_cost(self) -> int:
        """Relative compile time (``cute_host.start_compile_all``): the promotion is unrolled over the tile."""
        return self.bn // 32

    @cute.jit
    def __call__(self, mXq: cute.Tensor, mSx: cute.Tensor, mW: cute.Tensor, mSw: cute.Tensor, mOut: cute.Tensor,
                 stream):
        f8 = cutlass.Float8E4M3FN
        G, N, K = self.groups, self.n, self.k
        t = mXq.shape[0]
        # (rows, K, G) views of the byte tensors as E4M3, the group a mode of its own (the TMA's third dimension)
        a = cute.make_tensor(cute.recast_ptr(mXq.iterator, dtype=f8),
                             cute.make_layout((t, K, G), stride=(G * K, 1, K)))
        b = cute.make_tensor(cute.recast_ptr(mW.iterator, dtype=f8),
                             cute.make_layout((N, K, G), stride=(K, 1, N * K)))
        k_major = cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(f8, f8, k_major, k_major, Float32, (self.consumers, 1, 1),
                                                      tiler_mn=(64, self.bn))
        tile = (self.bm, self.bn, K_TILE)
        a_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, f8, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, f8, self.stages)
        tma_a, gA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a,
                                                cute.slice_(a_smem, (None, None, 0)), (self.bm, K_TILE))
        tma_b, gB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b,
                                                cute.slice_(b_smem, (None, None, 0)), (self.bn, K_TILE))

        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(b_smem)], 1024]

        self.storage = Storage
        self.kernel(tma_a, gA, tma_b, gB, mSx, mSw, mOut, tiled_mma, a_smem, b_smem).launch(
            grid=[(t + self.bm - 1) // self.bm, N // self.bn, G], block=[self.threads, 1, 1],
            smem=Storage.size_in_bytes(), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               mSx: cute.Tensor, mSw: cute.Tensor, mOut: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()        # token tile, weight row tile, group
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        tx_bytes = (self.bm + self.bn) * K_TILE
        # full: the producer's one arrive plus the TMA's bytes; empty: one arrive per consumer warp
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.consumers),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        gA = cute.local_tile(mA, (self.bm, K_TILE), (None, None, None))     # (bm, 128, m tiles, k tiles, G)
        gB = cute.local_tile(mB, (self.bn, K_TILE), (None, None, None))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                           cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                           cute.group_modes(gB, 0, 2))

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                tAgA_tile = tAgA[(None, bx, None, bz)]
                tBgB_tile = tBgB[(None, by, None, bz)]
                for _kt in cutlass.range(self.k_tiles, unroll=1):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    cute.copy(tma_a, tAgA_tile[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tBgB_tile[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                    pipe.producer_commit(state)
                    state.advance()
                pipe.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume(pipe, sA, sB, mSx, mSw, mOut, tiled_mma, tidx - 128, bx, by, bz)

    @cute.jit
    def consume(self, pipe, sA: cute.Tensor, sB: cute.Tensor, mSx: cute.Tensor, mSw: cute.Tensor,
                mOut: cute.Tensor, tiled_mma: cute.TiledMma, ctid: Int32, bx: Int32, by: Int32, bz: Int32):
        """A consumer warpgroup's share of the tile: the K loop with promotion, then the stores."""
        cw = ctid // 128
        thr_mma = tiled_mma.get_slice(cw * 128)   # the warpgroup's slice (wgmma partitions by warpgroup)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = tiled_mma.partition_shape_C((self.bm, self.bn))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        part = cute.make_rmem_tensor(acc_shape, Float32)
        acc.fill(0.0)

        lane = ctid % 32
        t_count = mSx.shape[0]
        row0 = bx * self.bm + cw * 64 + ((ctid % 128) // 32) * 16 + lane // 4     # token of the thread's h = 0 rows
        rows = cute.make_rmem_tensor((2,), Int32)
        for h in cutlass.range_constexpr(2):
            rows[h] = cutlass.min(row0 + 8 * h, t_count - 1)   # rows past T read the last token's scale (not stored)
        kb0 = bz * self.k_tiles                                  # the group's first column of sx
        n0 = by * self.bn
        sw_row = (bz * self.n + n0) // SCALE_BLOCK
        # scales of the block being computed: sx of the thread's two rows, sw of the tile's one or two scale blocks
        scales = cute.make_rmem_tensor((2 + self.sw_count,), Float32)
        self.load_scales(mSx, mSw, rows, kb0, sw_row, Int32(0), scales)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        pipe.consumer_wait(read)
        self.issue_block(tiled_mma, part, tCrA, tCrB, read.index)
        read.advance()
        for kt in cutlass.range(1, self.k_tiles, unroll=1):
            pipe.consumer_wait(read)
            warpgroup.wait_group(0)
            self.promote(acc, part, scales, n0)
            self.load_scales(mSx, mSw, rows, kb0, sw_row, kt, scales)
            self.issue_block(tiled_mma, part, tCrA, tCrB, read.index)
            pipe.consumer_release(release)
            release.advance()
            read.advance()
        warpgroup.wait_group(0)
        self.promote(acc, part, scales, n0)
        pipe.consumer_release(release)
        self.store(acc, mOut, row0, t_count, bz * self.n + n0, lane % 4)

    @cute.jit
    def issue_block(self, tiled_mma: cute.TiledMma, part: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                    slot: Int32):
        """The four k32 wgmmas of the 128-K block in ring slot ``slot`` into ``part`` (the first overwrites it)."""
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for s in cutlass.range_constexpr(K_STEPS):
            cute.gemm(tiled_mma, part, tCrA[(None, None, s, slot)], tCrB[(None, None, s, slot)], part)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    def load_scales(self, mSx: cute.Tensor, mSw: cute.Tensor, rows: cute.Tensor, kb0: Int32, sw_row: Int32,
                    kt: Int32, scales: cute.Tensor) -> None:
        """``scales`` <- block ``kt``'s: sx of the thread's two rows, then the tile's weight scale(s) as floats."""
        for h in range(2):
            scales[h] = mSx[rows[h], kb0 + kt]
        for i in range(self.sw_count):
            # a 192-wide tile's second scale block exists: the tile ends inside W's last block row at the latest
            r = sw_row + i
            if const_expr(self.config.scale_f32):
                scales[2 + i] = Float32(mSw[r, kt])
            else:
                scales[2 + i] = ptx.e8m0_to_f32(Int32(mSw[r, kt]))

    def promote(self, acc: cute.Tensor, part: cute.Tensor, scales: cute.Tensor, n0: Int32) -> None:
        """``acc += part * sx[row] * sw[column block]`` for every accumulator value (D-fragment indices, module
        docstring): value ``v + 2 h + 4 j`` is row h and column ``8 j + ..`` of the tile."""
        both = cute.make_rmem_tensor((2, self.sw_count), Float32)
        for h in range(2):
            for i in range(self.sw_count):
                both[h, i] = scales[h] * scales[2 + i]
        offset = n0 % SCALE_BLOCK   # where the tile starts in its scale block (0 or 64 with 192-wide tiles)
        for j in range(self.bn // 8):
            for h in range(2):
                s = both[h, 0]
                if const_expr(self.sw_count > 1):
                    s = Float32(cutlass.select_(offset + 8 * j >= SCALE_BLOCK, both[h, 1], both[h, 0]))
                for v in range(2):
                    i = v + 2 * h + 4 * j
                    acc[i] = acc[i] + part[i] * s

    @cute.jit
    def store(self, acc: cute.Tensor, mOut: cute.Tensor, row0: Int32, t_count: Int32, col0: Int32, c: Int32):
        """The thread's values to ``out`` (float32 pairs, 8 bytes a store): rows ``row0`` and ``row0 + 8`` (those
        below T), columns ``col0 + 8 j + 2 c``."""
        base = mOut.iterator.toint()
        width = self.n * self.groups
        for h in cutlass.range_constexpr(2):
            row = row0 + 8 * h
            if row < t_count:
                at = base + (Int64(row) * width + Int64(col0 + 2 * c)) * 4
                for j in cutlass.range_constexpr(self.bn // 8):
                    ptx.st_global_v2_f32(at + j * 32, acc[2 * h + 4 * j], acc[1 + 2 * h + 4 * j])


# -- host -----------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def gemm_op(config: Fp8GemmConfig) -> Sm90Fp8Gemm:
    """One kernel object per configuration (a call does not check it again)."""
    return Sm90Fp8Gemm(config)


@functools.lru_cache(maxsize=None)
def can_implement(n: int, k: int, groups: int = 1) -> bool:
    """Whether the GEMM tiles ``groups`` W [N, K] (N and K multiples of 128), at any token count."""
    return (n > 0 and k > 0 and groups >= 1
            and all(Sm90Fp8Gemm.can_implement(c) for c in fp8_gemm_configs(n, k, groups)))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x BF16 or float32 [T, C] (C a multiple of 128) -> (E4M3 bytes uint8 [T, C], float32 scales [T, C / 128]):
    ``scale = amax / 448`` per 1 x 128 block, values ``x / scale`` (:class:`Sm90Fp8ActQuant`, one launch)."""
    _expect(x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2 and x.shape[1] % K_TILE == 0
            and x.is_contiguous(), f"x must be contiguous bf16 or f32 [T, C], C a multiple of {K_TILE}; got "
                                   f"{x.dtype} {tuple(x.shape)}")
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty(x.shape[0], x.shape[1] // K_TILE, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _launch(Sm90Fp8ActQuant(x_f32=x.dtype == torch.float32), [x, q, s])
    return q, s


def warmup(n: int, k: int, device: torch.device | str, scale_dtype: torch.dtype = torch.uint8, groups: int = 1,
           x_dtype: torch.dtype = torch.float32, min_tokens: int = 1) -> int:
    """Compile every configuration :func:`sm90_fp8_gemm` can pick for ``groups`` W [N, K] with these scales and x at
    ``min_tokens`` tokens or more, and the quantiser, so that no such call compiles; returns how many."""
    dev = torch.device(device)
    scale_f32 = scale_dtype == torch.float32
    w = torch.empty(groups * n, k, dtype=torch.uint8, device=dev)
    sw = torch.empty(groups * n // SCALE_BLOCK, k // K_TILE, dtype=torch.float32 if scale_f32 else torch.uint8,
                     device=dev)
    x = torch.empty(1, groups * k, dtype=x_dtype, device=dev)
    xq = torch.empty(1, groups * k, dtype=torch.uint8, device=dev)
    sx = torch.empty(1, groups * k // K_TILE, dtype=torch.float32, device=dev)
    out = torch.empty(1, groups * n, dtype=torch.float32, device=dev)
    _compile(Sm90Fp8ActQuant(x_f32=x_dtype == torch.float32), [x, xq, sx])
    configs = fp8_gemm_configs(n, k, groups, scale_f32, min_tokens)
    for config in configs:
        _compile(gemm_op(config), [xq, sx, w, sw, out])
    return len(configs) + 1


def sm90_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, groups: int = 1,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear ``out[t, g] = quant(x[t, g]) @ W[g].T`` (module docstring), float32 [T, G * N].

    ``x`` BF16 or float32 [T, G * K] (T >= 1), quantised per token and 128 K first (:func:`quantize_activations`);
    ``weight`` float8_e4m3fn or its uint8 bytes [G * N, K] (group g: rows g N .. (g + 1) N, N and K multiples of
    128); ``scale`` [G * N / 128, K / 128], E8M0 (float8_e8m0fnu or uint8 bytes) or float32. Allocates its
    temporaries on the current stream each call (nothing cached: a CUDA graph may capture it)."""
    _expect(groups >= 1 and weight.dim() == 2 and weight.shape[0] % groups == 0 and weight.shape[1] % K_TILE == 0
            and can_implement(weight.shape[0] // groups, weight.shape[1], groups),
            f"the FP8 GEMM does not tile {groups} W {tuple(weight.shape)} (N and K multiples of 128)")
    n, k = fp8_operands(x, weight, scale, groups)
    _expect(weight.data_ptr() % 16 == 0, "weight must be 16-byte aligned (the TMA's)")
    t = x.shape[0]
    if out is None:
        out = torch.empty(t, groups * n, dtype=torch.float32, device=x.device)
    _expect(tuple(out.shape) == (t, groups * n) and out.dtype == torch.float32 and out.is_contiguous(),
            f"out must be contiguous float32 [T, G*N={groups * n}], got {out.dtype} {tuple(out.shape)}")
    return launch_gemm(x, weight, scale, out, groups)


def launch_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                groups: int) -> torch.Tensor:
    """Quantise x and run the GEMM on operands already checked (:func:`sm90_fp8_gemm`, or ``sm90_fp8_linear``,
    which dispatches here); returns ``out``."""
    n, k, t = weight.shape[0] // groups, weight.shape[1], x.shape[0]
    xq, sx = quantize_activations(x)
    config = fp8_gemm_config(n, k, t, groups, scale.dtype == torch.float32)
    _launch(gemm_op(config), [xq, sx, weight.view(torch.uint8), _scale_operand(scale), out])
    return out
