"""SM90 grouped NVFP4 x BF16 GEMM on warpgroup MMA (``wgmma``), the prefill path of the MoE.

Same operands, work tiles, epilogues (``sm90_nvfp4_gemm_parts``) and call signature as :class:`Sm90Nvfp4MmaGemm`
(``sm90_moe_gemm``, whose docstring holds the layout contract); what changes is the MMA:

* A = the packed NVFP4 weights, decoded to BF16 in registers exactly as in the mma.sync kernel (the
  register fragment of ``wgmma ... m64nNk16`` with A in registers is, per warp, the m16n8k16 A
  fragment), streamed through the same per-thread register pipeline (``depth`` k-tiles ahead), and with
  ``l2_ahead`` prefetched into the L2 that many k-tiles further on;
* B = ``tile_tokens`` (N) activation rows staged in shared memory, K-major, 128-byte swizzle, in a
  ring of ``stages`` tiles of 128 K each, and read by the tensor cores through a matrix descriptor;
  a CTA is ``warpgroups`` x ``m_tiles`` x 64 weight rows, so each staged tile feeds that many rows.
* MMA width: with ``min_tokens`` the k-tile loop is compiled once per width from ``min_tokens`` to N in steps
  of ``width_step``, and a tile runs the narrowest that holds its tokens: with uniform routing an expert's
  count spreads by about its square root around the mean, N must hold the largest (V4-Pro T = 4096: counts
  42..92, mean 64), and columns past a tile's tokens cost MMA time and energy for nothing. A tile stages the
  activation rows of its width only (zero-filled past its tokens).
* K order: the weights keep their per-thread K permutation (a lane quad owns a contiguous 32-K run,
  see ``sm90_moe_gemm``); the activation rows arrive already in the matching order (``"staged"``,
  ``k_order``: the host permutes ``x`` for L1, the L1 epilogue writes ``h`` so for L2), so a staged
  tile is a straight ``cp.async`` copy, 16 bytes per thread and row, no registers on the way.
  Column ``16 s + 8 hi + 2 c + e`` of a staged 128-K tile holds logical
  k = ``32 c + 8 (s // 2) + 2 (s % 2) + hi + 4 e``.

Per k-tile kt: wait for the copies of B(kt), proxy fence, barrier (so every warpgroup is past
``wait_group 1`` of kt - 1: B(kt - 2)'s stage is free), issue the copies of B(kt + stages - 2) into it,
decode A(kt), ``wgmma.fence``, 8 ``wgmma`` (k16 steps) on stage kt % stages, commit, ``wait_group 1``
(with two m64 groups, that for each group in turn: a group's MMAs run while the other group is decoded).
The MMAs of kt run while A(kt + 1) is decoded; activations land ``stages - 2`` tiles ahead.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import Float32, Int32, Int64, const_expr

from . import e2m1_registers as e2m1r
from . import sm90_ptx as ptx
from .row_tiles import ROWS, TILE_BYTES
from .sm90_config import K_TILE, WIDTH_STEP, GemmProblem, WgmmaTiling
from .sm90_nvfp4_gemm_parts import Nvfp4GemmParts, problem_violations

STAGES = 4  # staged activation tiles in the ring (two in flight ahead of the MMAs)


def _smem_bytes(tile_tokens: int) -> int:
    """Shared memory a CTA asks for: the stage ring (N rows of 256 bytes a stage) and room to align it to 1024."""
    return STAGES * tile_tokens * 256 + 2048


def wgmma_violations(problem: GemmProblem, tiling: WgmmaTiling) -> list[str]:
    """What in (``problem``, ``tiling``) the WGMMA GEMM does not take (empty: it takes it)."""
    bad = problem_violations(problem)
    t = tiling
    n_kt = problem.k // K_TILE // max(t.k_splits, 1)  # k-tiles a CTA walks
    if problem.b_order != "staged" or problem.direct_top_k:
        bad.append("the wgmma GEMM reads 'staged' activation rows of routed tiles (b_order 'staged', no direct_top_k)")
    if t.k_splits < 1 or (t.k_splits > 1 and (problem.mode != "store" or problem.out_bf16
                                              or (problem.k // K_TILE) % t.k_splits)):
        bad.append(f"k_splits must be >= 1, and above 1 only in mode 'store' with float32 out and dividing the "
                   f"{problem.k // K_TILE} k-tiles; got {t.k_splits}")
    if problem.mode == "store" and t.prefetch_next:
        bad.append("prefetch_next follows the routed tiles: 0 in mode 'store'")
    if t.tile_tokens % 16 or not 16 <= t.tile_tokens <= 256:
        bad.append(f"tile_tokens must be a multiple of 16 in [16, 256], got {t.tile_tokens}")
    elif _smem_bytes(t.tile_tokens) > ptx.SMEM_LIMIT:
        bad.append(f"{STAGES} stages of N = {t.tile_tokens} take {_smem_bytes(t.tile_tokens)} bytes of shared "
                   f"memory, more than the {ptx.SMEM_LIMIT} a CTA may have")
    min_tokens = t.min_tokens or t.tile_tokens
    if min_tokens % 8 or not 8 <= min_tokens <= t.tile_tokens or (t.tile_tokens - min_tokens) % WIDTH_STEP:
        bad.append(f"min_tokens must be 0 or a multiple of 8 in [8, tile_tokens={t.tile_tokens}] that differs from "
                   f"it by a multiple of {WIDTH_STEP}, got {t.min_tokens}")
    if t.m_tiles not in (1, 2) or t.warpgroups not in (1, 2):
        bad.append(f"m_tiles and warpgroups must be 1 or 2, got {t.m_tiles}, {t.warpgroups}")
    elif problem.m % (64 * t.warpgroups * t.m_tiles):
        bad.append(f"M={problem.m} must be a multiple of the CTA's {64 * t.warpgroups * t.m_tiles} rows")
    elif (t.tile_tokens * 16) % (128 * t.warpgroups):
        bad.append(f"tile_tokens * 16 must be a multiple of the CTA's {128 * t.warpgroups} threads")
    # one k-tile in flight over several computed non-finite outputs on an H200 (the next k-tile's decode reusing the
    # A registers of a wgmma still in flight across the loop's back edge); with one k-tile in all there is none
    if t.depth not in (1, 2, 4) or n_kt % t.depth or (t.depth == 1 and n_kt > 1):
        bad.append(f"depth must divide the {n_kt} k-tiles, and be 2 or 4 unless K is one k-tile; got {t.depth}")
    if t.min_ctas < 1 or t.l2_ahead < 0:
        bad.append(f"min_ctas must be >= 1 and l2_ahead >= 0, got {t.min_ctas}, {t.l2_ahead}")
    if t.prefetch_next < 0 or (t.prefetch_next and not t.l2_ahead):
        bad.append(f"prefetch_next must be >= 0, and 0 without l2_ahead (it continues its prefetches); "
                   f"got {t.prefetch_next}")
    return bad


class Sm90Nvfp4WgmmaGemm(Nvfp4GemmParts):
    """One compiled configuration of the WGMMA grouped GEMM (module docstring): ``problem`` and ``tiling``.

    Launched as :class:`~nvfp4_megamoe.kernels.sm90_moe_gemm.Sm90Nvfp4MmaGemm` is. A CTA is ``warpgroups`` x
    ``m_tiles`` x 64 weight rows: a warp owns ``m_tiles`` adjacent 16-row groups, MMA group mt takes group mt of each
    of the warpgroup's warps, and each group's 8 MMAs a k-tile are a commit group of their own, so one group's decode
    overlaps the other's MMAs.
    """

    violations = staticmethod(wgmma_violations)
    family = "WGMMA"

    def __init__(self, problem: GemmProblem, tiling: WgmmaTiling):
        self.configure(problem, tiling)
        self.min_tokens = tiling.min_tokens or tiling.tile_tokens
        self.width_step = WIDTH_STEP
        self.wgs = tiling.warpgroups
        self.warps = 4 * tiling.warpgroups
        self.threads = 128 * tiling.warpgroups
        self.row_tiles = tiling.m_tiles  # a warp's 16-row groups, one per m64 MMA of its warpgroup
        self.bm = 64 * tiling.warpgroups * tiling.m_tiles
        self.k_splits = tiling.k_splits
        self.n_kt = problem.k // K_TILE // tiling.k_splits  # k-tiles a CTA walks (its share of K)
        self.depth = tiling.depth
        self.n_ld = self.bn * 16 // self.threads  # 16-byte activation chunks per thread per k-tile
        self.stages = STAGES
        # the scatter's ids loaded first (``epilogue``) do not fit under the register cap of three CTAs per SM (ptxas
        # spills 88 bytes at N = 32), nor with two m64 groups (N = 80: 8 bytes)
        self.ids_first = tiling.min_ctas < 3 and tiling.m_tiles == 1
        self.min_ctas = tiling.min_ctas
        self.l2_ahead = tiling.l2_ahead
        self.prefetch_next = tiling.prefetch_next
        self.block_columns = False
        self.epi_scale = float(2 ** e2m1r.EPILOGUE_LOG2)
        self.region = self.bn * 128          # bytes of one 64-K half of a staged tile
        self.stage_bytes = 2 * self.region   # one 128-K tile

    @property
    def smem_bytes(self) -> int:
        """Shared memory a CTA asks for: the stage ring and room to align it to 1024 bytes (the swizzle atoms)."""
        return self.stages * self.stage_bytes + 2048

    @property
    def compile_cost(self) -> int:
        """Relative compile time (``cute_host.start_compile_all``): one k-tile loop per MMA width, each about N wide."""
        return (self.bn // 16) * ((self.bn - self.min_tokens) // self.width_step + 1)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor,
                 mTok: cute.Tensor, mRW: cute.Tensor, mTiles: cute.Tensor, mNumTiles: cute.Tensor,
                 mOut: cute.Tensor, mZero: cute.Tensor, stream):
        # "store": every (group, token tile) of x's rows, times the K shares; the MoE modes: the routed tiles
        tiles = mTiles.shape[0]
        if const_expr(self.mode == "store"):
            tiles = (mX.shape[0] + self.bn - 1) // self.bn * self.groups
        self.kernel(mW, mS, mAlpha, mX, mTok, mRW, mTiles, mNumTiles, mOut, mZero).launch(
            grid=[self.m // self.bm, tiles, self.k_splits], block=[self.threads, 1, 1],
            smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_ctas,
            preferred_smem_carveout=-1 if self.min_ctas > 1 else None)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor,
               mTok: cute.Tensor, mRW: cute.Tensor, mTiles: cute.Tensor, mNumTiles: cute.Tensor,
               mOut: cute.Tensor, mZero: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        if const_expr(self.mode == "swiglu"):
            self.zero_output(mZero, bx, by, tidx)
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.stages * self.stage_bytes + 1024), 1024)
        if const_expr(self.mode == "store"):
            # a dense linear: tile ``by`` is token tile by % tiles of group by // tiles ("expert" = the group)
            rows = mX.shape[0]
            tiles = (rows + self.bn - 1) // self.bn
            begin = (by % tiles) * self.bn
            cnt = rows - begin
            if cnt > self.bn:
                cnt = Int32(self.bn)
            succ = cute.make_rmem_tensor((2,), Int32)
            self.wg_tile(mW, mS, mAlpha, mX, mTok, mRW, mOut, sbuf, by // tiles, begin, cnt, bx, tidx, succ, bz)
        elif by < mNumTiles[0]:
            expert = mTiles[by, 0]
            begin = mTiles[by, 1]
            end = mTiles[by, 2]
            # the block that runs about when this one leaves (``prefetch_next``): its expert and row block
            succ = cute.make_rmem_tensor((2,), Int32)
            succ[0] = expert
            succ[1] = bx
            if const_expr(self.prefetch_next):
                gx = self.m // self.bm
                later = by * gx + bx + self.prefetch_next
                if later // gx < mNumTiles[0]:
                    succ[0] = mTiles[later // gx, 0]
                    succ[1] = later % gx
            self.wg_tile(mW, mS, mAlpha, mX, mTok, mRW, mOut, sbuf, expert, begin, end - begin, bx, tidx, succ,
                         Int32(0))

    @cute.jit
    def wg_tile(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor, mTok: cute.Tensor,
                mRW: cute.Tensor, mOut: cute.Tensor, sbuf: cute.Tensor, expert: Int32, begin: Int32, cnt: Int32,
                bx: Int32, tidx: Int32, succ: cute.Tensor, kz: Int32):
        """Tile (``expert``, rows ``begin`` .. ``begin + cnt``) for row block ``bx``, over K share ``kz``."""
        k = self.k
        wg = tidx // 128
        warp = (tidx % 128) // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        MT = self.row_tiles
        # a warp owns MT adjacent 16-row groups; m64 MMA mt of a warpgroup takes group mt of each of its 4 warps
        row_base = bx * self.bm + (wg * 4 + warp) * 16 * MT

        # --- weights: per-thread addresses and register pipeline (as the mma.sync kernel, MT row tiles) ---
        w_base = self.weight_base(mW, expert, c)
        s_base = self.scale_base(mS, expert, c)
        # row g's addresses, at the first k-tile of the CTA's share of K: the thread's other rows are constant
        # offsets on (``row_offsets``)
        kt0 = kz * self.n_kt
        a_addr = self.weight_row(w_base, row_base + g) + Int64(kt0 * self.kt_bytes)
        s_addr = self.scale_row(s_base, row_base + g) + Int64(kt0 * 1024)

        # --- activation staging: this thread's 16-byte chunks (fixed column chunk, rows n0 + 16 i * wgs) ---
        q16 = tidx % 16          # chunk of a 256-byte (128-K) row: columns 8 q16 .. 8 q16 + 7 of the staged tile
        n0 = tidx // 16
        n8 = n0 % 8              # swizzle phase (the same for all of this thread's rows)
        x_addr = cute.make_rmem_tensor((self.n_ld,), Int64)
        x_bytes = cute.make_rmem_tensor((self.n_ld,), Int32)  # 0 past the tile's tokens: zero-filled, not read
        x_base = mX.iterator.toint() + Int64(q16 * 16) + Int64(kt0 * 256)
        for i in cutlass.range_constexpr(self.n_ld):
            n = n0 + i * (self.threads // 16)
            t = n
            x_bytes[i] = Int32(16)
            if t > cnt - 1:
                t = cnt - 1
                x_bytes[i] = Int32(0)
            brow = begin + t
            if const_expr(self.mode == "swiglu"):
                brow = self.token_of(mTok, brow)
            if const_expr(self.mode == "store"):  # a row of x holds every group's K side by side
                brow = brow * self.groups + expert
            x_addr[i] = x_base + Int64(brow) * (k * 2)
        s_smem = (Int32(sbuf.iterator.toint()) + 1023) & Int32(-1024)  # swizzle atoms need 1024-byte alignment
        # byte offset in a stage of this thread's chunk of row n0: half q16 // 8, row n0, 16-byte chunk (q16 % 8) ^ n8
        st_off = (q16 // 8) * self.region + (n0 // 8) * 1024 + n8 * 128 + (((q16 % 8) ^ n8) * 16)

        D = self.depth
        wbuf = cute.make_rmem_tensor((D, MT, 2, 4), Int32)
        sbufr = cute.make_rmem_tensor((D, MT, 2), Int32)
        for d in cutlass.range_constexpr(D):
            self.load_a(wbuf, sbufr, a_addr, s_addr, d, d)
        if const_expr(self.min_tokens == self.bn):
            self.k_loop(mW, mAlpha, mTok, mRW, mOut, wbuf, sbufr, a_addr, s_addr, x_addr, x_bytes, s_smem, st_off,
                        expert, begin, cnt, row_base, g, c, succ, self.bn)
        else:
            # one specialised loop per MMA width (compile-time N): the smallest that holds the tile's tokens
            for n in cutlass.range_constexpr(self.min_tokens, self.bn + 1, self.width_step):
                lo = 0 if n == self.min_tokens else n - self.width_step
                if cnt > lo and cnt <= n:
                    self.k_loop(mW, mAlpha, mTok, mRW, mOut, wbuf, sbufr, a_addr, s_addr, x_addr, x_bytes, s_smem,
                                st_off, expert, begin, cnt, row_base, g, c, succ, n)

    @cute.jit
    def k_loop(self, mW: cute.Tensor, mAlpha: cute.Tensor, mTok: cute.Tensor, mRW: cute.Tensor, mOut: cute.Tensor,
               wbuf: cute.Tensor, sbufr: cute.Tensor, a_addr: Int64, s_addr: Int64, x_addr: cute.Tensor,
               x_bytes: cute.Tensor, s_smem: Int32, st_off: Int32, expert: Int32, begin: Int32, cnt: Int32,
               row_base: Int32, g: Int32, c: Int32, succ: cute.Tensor, n: cutlass.Constexpr):
        """The k-tile loop and epilogue of one tile, its MMAs ``n`` columns wide (>= the tile's tokens)."""
        D = self.depth
        MT = self.row_tiles
        n_kt = self.n_kt
        S = self.stages
        for st in cutlass.range_constexpr(S - 2):
            if st < n_kt:
                self.stage_b(x_addr, x_bytes, s_smem + st * self.stage_bytes, st_off, st, n)
            cute.arch.cp_async_commit_group()
        acc = cute.make_rmem_tensor((MT, n // 2), Float32)
        acc.fill(0.0)
        for kto in cutlass.range(0, n_kt, D, unroll=1):
            for d in cutlass.range_constexpr(D):
                kt = kto + d
                cw = cute.make_rmem_tensor((MT, 2, 4), Int32)
                cs = cute.make_rmem_tensor((MT, 2), Int32)
                for mt in cutlass.range_constexpr(MT):
                    for h in cutlass.range_constexpr(2):
                        cs[mt, h] = sbufr[d, mt, h]
                        for i in cutlass.range_constexpr(4):
                            cw[mt, h, i] = wbuf[d, mt, h, i]
                nxt = kt + D
                if nxt > n_kt - 1:
                    nxt = n_kt - 1
                self.load_a(wbuf, sbufr, a_addr, s_addr, d, nxt)
                if const_expr(self.l2_ahead > 0):
                    far = kt + D + self.l2_ahead
                    if far < n_kt:
                        for mt in cutlass.range_constexpr(MT):
                            for h in cutlass.range_constexpr(2):
                                ptx.prefetch_l2(a_addr + Int64(far * self.kt_bytes + self.row_offsets(mt, h)[0]),
                                                evict_last=False)
                    elif const_expr(self.prefetch_next):
                        if far < 2 * n_kt:  # the successor's first k-tiles: its rows as this thread's (rebuilt here)
                            succ_row = self.weight_row(self.weight_base(mW, succ[0], c),
                                                       succ[1] * self.bm + row_base % self.bm + g)
                            for mt in cutlass.range_constexpr(MT):
                                for h in cutlass.range_constexpr(2):
                                    ptx.prefetch_l2(succ_row + Int64((far - n_kt) * self.kt_bytes
                                                                     + self.row_offsets(mt, h)[0]), evict_last=False)
                cute.arch.cp_async_wait_group(S - 3)      # this thread's copies of B(kt) landed
                cute.arch.fence_view_async_shared()
                cute.arch.barrier()                        # ... everyone's; and B(kt - 2)'s stage is free
                ahead = kt + S - 2
                if ahead < n_kt:
                    self.stage_b(x_addr, x_bytes, s_smem + (ahead % S) * self.stage_bytes, st_off, ahead, n)
                cute.arch.cp_async_commit_group()
                stage = s_smem + (kt % S) * self.stage_bytes
                # each step's descriptor is the stage's plus its offset / 16: an add instead of a rebuild (no carry out
                # of the 14-bit address field below 256 KiB; V4-Pro T = 1024 5621 -> 5382 us on an H200, docs/design/moe_kernels.md)
                desc0 = ptx.smem_desc_sw128(stage)
                # decoded A: a[mt, h, w, j] = (v_j, v_{j+4}) of word w of row mt * 16 + g + 8 h, times its block scale;
                # each m64 MMA its own commit group, so that the decode of one runs while the other's MMAs do
                a = cute.make_rmem_tensor((MT, 2, 4, 4), Int32)
                for mt in cutlass.range_constexpr(MT):
                    self.decode_rows(cw, cs, a, mt)
                    warpgroup.fence()
                    for w in cutlass.range_constexpr(4):
                        for u in cutlass.range_constexpr(2):
                            s = 2 * w + u
                            desc = desc0 + Int64(((s // 4) * self.region + (s % 4) * 32) >> 4)
                            vals = [acc[mt, i] for i in range(n // 2)]
                            vals = ptx.wgmma_bf16_rs(vals, a[mt, 0, w, 2 * u], a[mt, 1, w, 2 * u],
                                                     a[mt, 0, w, 2 * u + 1], a[mt, 1, w, 2 * u + 1], desc)
                            for i in cutlass.range_constexpr(n // 2):
                                acc[mt, i] = vals[i]
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)

        warpgroup.wait_group(0)
        acc4 = cute.make_rmem_tensor((MT, n // 8, 4), Float32)
        for mt in cutlass.range_constexpr(MT):
            vals = ptx.fence_operands([acc[mt, i] for i in range(n // 2)])
            for nb in cutlass.range_constexpr(n // 8):
                for i in cutlass.range_constexpr(4):
                    acc4[mt, nb, i] = vals[4 * nb + i]
        self.epilogue(acc4, mAlpha, mTok, mRW, mOut, expert, begin, cnt, row_base, g, c)

    def row_offsets(self, mt: int, h: int) -> tuple[int, int]:
        """Bytes from a thread's row g (``row_base + g``) to its row ``mt * 16 + 8 h + g`` in the weights and in the
        scales: constants, as ``row_base`` is a multiple of 16 * MT (of 32 with two groups), so the row stays in g's
        16-row tile (``weight_tiles``), 32-row line group and 128-row block of scales (``scale_row``)."""
        dr = mt * 16 + 8 * h
        w = (mt * ROWS * (self.k // 2) + 8 * h * TILE_BYTES) if self.weight_tiles else dr * (self.k // 2)
        return w, dr * 16

    def load_a(self, wbuf: cute.Tensor, sbuf: cute.Tensor, a_addr: Int64, s_addr: Int64, slot: int, kt: Int32) -> None:
        """Pipeline slot ``slot`` <- k-tile ``kt`` of the thread's rows: row g's addresses plus :meth:`row_offsets`
        (immediate offsets, no registers)."""
        a_kt = a_addr + Int64(kt * self.kt_bytes)
        s_kt = s_addr + Int64(kt * 1024)
        self.load_weights(wbuf, sbuf, slot, lambda mt, h: (a_kt + Int64(self.row_offsets(mt, h)[0]),
                                                           s_kt + Int64(self.row_offsets(mt, h)[1])))

    @cute.jit
    def stage_b(self, x_addr: cute.Tensor, x_bytes: cute.Tensor, stage: Int32, st_off: Int32, kt: Int32,
                n: cutlass.Constexpr):
        """``cp.async`` this thread's 16-byte chunks of k-tile ``kt`` into the stage at shared address ``stage``, those
        of the first ``n`` rows, the MMAs' width: rows past it are not read (rows past the tile's tokens are
        zero-filled: their output columns are never stored)."""
        rows = self.threads // 16  # rows a chunk index spans
        for i in cutlass.range_constexpr(min(self.n_ld, -(-n // rows))):
            ptx.cp_async_16(stage + st_off + i * rows // 8 * 1024, x_addr[i] + Int64(kt * 256), x_bytes[i])
