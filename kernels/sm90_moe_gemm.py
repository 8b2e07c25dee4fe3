"""SM90 grouped NVFP4 x BF16 GEMM (swap-AB) with the MoE epilogues: SwiGLU (L1), routed scatter-add (L2), store (dense).

Operand roles. The packed NVFP4 weights are the MMA **A** operand (M = weight rows): each thread
loads its rows' E2M1 bytes straight from global memory (16 B per row per 128-K tile), decodes them
to BF16 in registers, multiplied by the row's E4M3 block scale (exact, see ``sm90_ptx``), and
feeds ``mma.sync.m16n8k16`` (a warp-level tensor-core MMA; its A fragment holds rows r and r+8 per
thread, like a WGMMA m64 fragment). Tokens are the **B** operand (N = 8 tokens per MMA), so one
token already fills an MMA; the global scale ``alpha`` rides the epilogue in fp32.

K order. The sum over K is order-free, so each thread owns a contiguous run of K: in a 128-K tile,
lane quad ``c = lane % 4`` owns logical k ``32c .. 32c+31`` (16 weight bytes, 64 activation bytes,
two scale bytes). MMA step ``s = 2w + u`` (w = weight word, u = 0/1) pairs the fragment slots
(2c, 2c+1, 2c+8, 2c+9) with logical k ``8w + (2u, 2u+4, 2u+1, 2u+5)``. The weights are read as
format 1 writes them (``docs/format.md``); the activations either in logical order, permuted the
same way in registers (one ``prmt`` per B register), or already stored in that order
(``b_order="lane"``, ``k_order``), as the L1 epilogue writes ``h`` for L2 (``h_order``).

Layout contract (format 1): ``w`` uint8 [E, M, K/2] (low nibble = even k), ``s`` uint8
[E, swz(M, K/16)] (128x4 swizzle, ``kernels/swizzle.py``), ``alpha`` f32 [E] (L1: the [E, 2]
(gate, up) pair flattened to [2E]); activations BF16
K-major. For L1 the M rows are w13's gate/up rows interleaved by 8 (``kernels/interleave.py``): the
thread holding accumulator row r (gate j) also holds r+8 (up j), so SwiGLU is thread-local.

Work items. ``tiles`` int32 [max_tiles, 3] = (expert, begin, end) over the expert-sorted pair
list (built on the GPU by ``sm90_moe_routing``), ``num_tiles`` int32 [1]; grid = (M / BM,
max_tiles); CTAs past ``num_tiles`` exit at once. Dense mode (one group) tiles the tokens itself.

Epilogues (``mode``):
* ``"swiglu"``: ``h[p, j] = bf16(silu(min(g, L)) * clamp(u, -L, L))`` for sorted pair p (row p of ``h``
  in ``h_order``, the K order the L2 kernel reads), with
  ``g, u = alpha[e, 0] * acc_r, alpha[e, 1] * acc_{r+8}`` (a thread's rows r and r+8 are a
  gate row and its up row thanks to the interleave); B rows are gathered as ``x[token_of[p]]``.
* ``"scatter"``: ``out[token_of[p], r] += alpha * weight[p] * acc`` (fp32 ``red.add``; ``out``
  must be zero first); B rows are ``h[p]``.
* ``"store"``: ``out[t, r] = alpha * acc`` (f32 or bf16), B rows are ``x[t]``, no routing.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import k_order
from . import e2m1_registers as e2m1r
from . import sm90_ptx as ptx
from .row_tiles import ROWS, TILE_BYTES
from .swizzle import swizzled_nbytes

K_TILE = 128  # logical K per tile: 16 bytes of one weight row per lane, 4 lanes per row
MODES = ("swiglu", "scatter", "store")
# block_columns: activations ride the MMA as x * 2**BC_X_LOG2, so that products with the unscaled decoded weights
# (v * 2**-126) are normal floats for 2**-62 < |x| < 2**64; x * 2**64 is a BF16 bit pattern:
BC_X_LOG2 = 64
_BC_X_SCALE_BF16X2 = 0x5F805F80
# stage_x: the staged row's 16-byte chunk i sits at byte 16 * (i + i // 8) (16 padding bytes after every 128), so
# that the 4 lane quads' 16-byte reads of one k-tile fall on distinct banks; a k-tile (16 chunks) spans 288 bytes
_STAGED_KTILE_BYTES = 288
# shared memory of an SM (sm_90) and what each resident CTA costs besides its own: ``max_ctas`` pads a CTA's
# allocation so that one more than the cap does not fit
SM_SMEM_BYTES = 228 * 1024
CTA_SMEM_RESERVED = 1024


def lane_words(lo: Int32, hi: Int32) -> tuple[Int32, Int32]:
    """Two logical-order activation words, (k, k + 1) and (k + 4, k + 5), as the "lane" K order holds them
    (``k_order``): (k, k + 4) and (k + 1, k + 5), one MMA step's B registers."""
    return ptx.prmt(lo, hi, 0x5410), ptx.prmt(lo, hi, 0x7632)


class Sm90Nvfp4GroupedGemm:
    """One compiled configuration: static M, K, mode, token tile and CTA shape.

    Args:
        m: weight rows per expert (2I for L1, H for L2, out features for dense).
        k: reduction size (H for L1, I for L2); a multiple of 128 * depth.
        mode: ``"swiglu"``, ``"scatter"`` or ``"store"`` (module docstring).
        tile_tokens: tokens per work item, a multiple of 8 (<= 64).
        swiglu_limit: the clamp ``L`` of ``"swiglu"`` (None: no clamp).
        warps: warps per CTA; each owns ``16 * row_tiles`` weight rows.
        depth: k-tiles of weight loads kept in flight per thread.
        b_depth: k-tiles of activation loads in flight (0: loaded when used; None: 2 for 8-token tiles).
        split_k: CTAs sharing one tile's K (``"scatter"`` only: its atomics already add partial sums).
        out_bf16: ``"store"`` writes BF16 instead of float32.
        l2_prefetch: bytes the L2 fetches around each weight load (0, 64, 128, 256; ``sm90_ptx.ld_global_v4``).
        pdl: programmatic dependent launch. The kernel may start while the previous kernel of the stream
            still runs (``griddepcontrol``): ``"swiglu"`` zeroes ``out`` first, then waits for the routing;
            ``"scatter"`` reads its tile and starts its weight loads, then waits for L1's ``h``. Both let
            their own dependent start early. Only for the MoE chain routing -> L1 -> L2 (``sm90_moe``).
        pdl_prefetch: with ``pdl``, ``"scatter"`` also asks the L2 for the rest of its weight slice
            before waiting, so the weights stream in while L1 finishes.
        direct_top_k: ``"swiglu"``/``"scatter"`` without the routing kernel (``k`` > 0): work tile ``p`` is
            routed pair ``p`` alone, ``tiles`` is ``topk_ids`` viewed [P, 1] (int32 or int64), the
            weights ``topk_weights`` [P] in pair order, token ``p // k`` (``token_of`` and
            ``num_tiles`` unused). For one token, whose k pairs go to k distinct experts, this reads
            each expert once, like the sorted tiles, and saves the routing launch; an expert repeated
            across tokens is read once per pair (the repeats mostly from L2).
        b_order: K order of the activation rows, ``"logical"`` or ``"lane"`` (``k_order``).
        h_order: ``"swiglu"``: K order ``h`` is written in (``k_order.ORDERS``).
        interleave_rows: decode every row tile of a k-tile first and interleave their MMAs (else one row tile
            after the other); the results are the same, only the schedule differs (``mma_ktile``).
        block_columns: one-token tiles (``direct_top_k`` only) use the MMA's 8 columns for the k-tile's 8 scale
            blocks instead of 8 tokens, so the block scales are applied to fp32 partial sums, 4 multiply-adds a
            k-tile, instead of to every decoded weight word, 32 BF16 multiplies (``mma_ktile``).
            ``"swiglu"`` scales ``x`` by ``2**BC_X_LOG2`` in registers and writes ``h`` scaled so, which is
            what ``"scatter"`` expects: both GEMMs of a layer must agree. The ``token_of`` operand (unused by
            ``direct_top_k``) must then hold at least ``2 * k`` zero bytes: lanes read them in place of the
            activations of the columns they do not feed.
        weight_tiles: ``w`` is in Hopper row tiles (``row_tiles``, converter ``--target sm90``), not row-major.
        k_warps: warps that share one row group's K inside the CTA (1 or 2; MoE modes with ``tile_tokens`` 8, else 1):
            each sums its own k-tiles, so a CTA has ``warps * k_warps`` warps and each walks ``1 / k_warps`` of K.
            More warps per SM hide more latency where a call has few rows (a decode call's few experts). ``"scatter"``
            adds each warp's partial sums to ``out`` itself; ``"swiglu"`` first sums them in shared memory.
        min_ctas: CTAs per SM the launch asks registers for (0: none; default 3 with ``stage_x`` or ``k_warps`` 2,
            see ``occupancy``).
        max_ctas: CTAs per SM at most (0: no cap), by padding the CTA's shared memory (and asking for the largest
            shared-memory carveout): so that a grid launched early (``pdl``) spreads over the SMs as its
            predecessor's CTAs leave instead of filling the first SMs that free up.
        stage_x: ``"swiglu"`` with ``direct_top_k`` only: the CTA first copies its token's ``x`` row (logical order)
            into shared memory in the ``"lane"`` K order (and, with ``block_columns``, scaled by ``2**BC_X_LOG2``),
            so the k-tile loop reads activation words ready for the MMA: no ``prmt`` and no scaling per k-tile
            and warp, once per CTA instead.
    """

    def __init__(self, *, m: int, k: int, mode: str, tile_tokens: int = 8, swiglu_limit: float | None = None,
                 warps: int = 4, row_tiles: int = 1, depth: int = 4, b_depth: int | None = None,
                 split_k: int = 1, out_bf16: bool = False, l2_prefetch: int = 0, pdl: bool = False,
                 pdl_prefetch: bool = False, direct_top_k: int = 0, b_order: str = "logical",
                 h_order: str = "logical", interleave_rows: bool = False, block_columns: bool = False,
                 weight_tiles: bool = False, stage_x: bool = False, k_warps: int = 1, min_ctas: int | None = None,
                 max_ctas: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if tile_tokens % 8 or not 8 <= tile_tokens <= 64:
            raise ValueError(f"tile_tokens must be a multiple of 8 in [8, 64], got {tile_tokens}")
        self.m, self.k, self.mode = m, k, mode
        self.bn = tile_tokens
        self.nb = tile_tokens // 8
        self.warps, self.row_tiles = warps, row_tiles
        self.bm = warps * 16 * row_tiles
        self.split_k = split_k if mode == "scatter" and (k // K_TILE) % split_k == 0 else 1
        if k_warps not in (1, 2):
            raise ValueError(f"k_warps must be 1 or 2, got {k_warps}")
        self.k_warps = k_warps if self.nb == 1 and mode != "store" and (k // K_TILE // self.split_k) % k_warps == 0 else 1
        self.threads = warps * self.k_warps * 32
        self.n_kt = k // K_TILE // self.split_k // self.k_warps  # k-tiles per warp
        self.depth = max(d for d in (1, 2, 4, depth) if d <= depth and self.n_kt % d == 0)
        if m % self.bm:
            raise ValueError(f"M={m} must be a multiple of the CTA's {self.bm} rows")
        if k % K_TILE:
            raise ValueError(f"K={k} must be a multiple of {K_TILE}")
        self.swiglu_limit = swiglu_limit
        self.out_bf16 = out_bf16
        if b_order not in ("logical", "lane") or h_order not in k_order.ORDERS:
            raise ValueError(f"b_order must be 'logical' or 'lane' and h_order one of {k_order.ORDERS}, "
                             f"got {b_order!r}, {h_order!r}")
        self.b_order, self.h_order = b_order, h_order
        self.interleave_rows = interleave_rows and row_tiles > 1
        if l2_prefetch not in ptx.L2_PREFETCH_BYTES:
            raise ValueError(f"l2_prefetch must be one of {ptx.L2_PREFETCH_BYTES}, got {l2_prefetch}")
        self.l2_prefetch = l2_prefetch
        self.direct_top_k = direct_top_k if mode != "store" else 0
        # PDL orders L1 after the routing kernel. A direct L1 follows whatever ran before, which may still read the
        # memory of ``out`` that it zeroes: it is not launched so, but lets L2 (PDL) launch early all the same
        self.pdl = pdl and mode != "store" and not (self.direct_top_k and mode == "swiglu")
        self.early_dependents = pdl and bool(self.direct_top_k) and mode == "swiglu"
        self.pdl_prefetch = pdl_prefetch and self.pdl and mode == "scatter"
        self.scale_bytes = swizzled_nbytes(m, k // 16)  # per expert
        self.kb4 = math.ceil(k // 16 / 4)  # 512-byte scale atoms per 128 rows
        self.block_columns = block_columns
        self.weight_tiles = weight_tiles
        if block_columns and not (self.direct_top_k and self.nb == 1 and self.split_k == 1):
            raise ValueError("block_columns needs one-token tiles: direct_top_k > 0, tile_tokens 8, split_k 1")
        self.stage_x = stage_x and mode == "swiglu" and self.direct_top_k > 0 and b_order == "logical"
        self.min_ctas = (3 if self.stage_x or self.k_warps > 1 else 0) if min_ctas is None else min_ctas
        if max_ctas < 0:
            raise ValueError(f"max_ctas must be >= 0, got {max_ctas}")
        self.max_ctas = max_ctas
        # the K order of the activation words the MMAs take (staged x is in the "lane" order)
        self.read_order = "lane" if self.stage_x else b_order
        # the decoded weights are v * 2**-126 unscaled in this mode; x * 2**BC_X_LOG2 keeps the products normal
        self.epi_scale = float(2 ** (126 - BC_X_LOG2 if block_columns else e2m1r.EPILOGUE_LOG2))
        # activations ride the register pipeline too (two k-tiles ahead) when they are few
        if b_depth is None:
            b_depth = 2 if self.nb == 1 and not self.stage_x else 0
        if b_depth and self.depth % b_depth:
            b_depth = 0
        self.b_depth = b_depth
        self.ids_first = True  # the scatter epilogue loads every column's token and weight first (``epilogue``)

    def key(self) -> tuple:
        return (self.m, self.k, self.mode, self.bn, self.swiglu_limit, self.warps, self.row_tiles, self.depth,
                self.b_depth, self.split_k, self.out_bf16, self.l2_prefetch, self.pdl, self.pdl_prefetch,
                self.early_dependents,
                self.direct_top_k, self.b_order, self.h_order, self.interleave_rows, self.block_columns,
                self.weight_tiles, self.stage_x, self.k_warps, self.min_ctas, self.max_ctas)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor,
                 mTok: cute.Tensor, mRW: cute.Tensor, mTiles: cute.Tensor, mNumTiles: cute.Tensor,
                 mOut: cute.Tensor, mZero: cute.Tensor, stream):
        if const_expr(self.mode == "store"):
            n_tiles = (mX.shape[0] + self.bn - 1) // self.bn
        else:
            n_tiles = mTiles.shape[0]
        self.kernel(mW, mS, mAlpha, mX, mTok, mRW, mTiles, mNumTiles, mOut, mZero).launch(
            grid=[self.m // self.bm, n_tiles, self.split_k], block=[self.threads, 1, 1], stream=stream,
            smem=self.smem_bytes, use_pdl=self.pdl, **self.occupancy)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor,
               mTok: cute.Tensor, mRW: cute.Tensor, mTiles: cute.Tensor, mNumTiles: cute.Tensor,
               mOut: cute.Tensor, mZero: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        if const_expr(self.mode == "swiglu"):
            self.zero_output(mZero, bx, by, tidx)
        if const_expr(self.pdl and self.mode == "swiglu"):
            cute.arch.griddepcontrol_wait()              # the routing's tiles are complete from here
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.early_dependents):
            cute.arch.griddepcontrol_launch_dependents()
        warp = tidx // 32 % self.warps        # the row group
        kpart = tidx // 32 // self.warps       # which share of K (k_warps)
        lane = tidx % 32
        g = lane // 4
        c = lane % 4

        live = Int32(1)
        expert = Int32(0)
        begin = by * self.bn
        end = begin + self.bn
        if const_expr(self.mode == "store"):
            if end > mX.shape[0]:
                end = mX.shape[0]
        elif const_expr(self.direct_top_k > 0):
            expert = Int32(mTiles[by, 0])                # the grid has exactly one tile per pair
            begin = by
            end = by + 1
        else:
            if by >= mNumTiles[0]:
                live = Int32(0)
            else:
                expert = mTiles[by, 0]
                begin = mTiles[by, 1]
                end = mTiles[by, 2]
        if live != 0:
            self.tile(mW, mS, mAlpha, mX, mTok, mRW, mOut, expert, begin, end - begin, bx,
                      (bz * self.k_warps + kpart) * self.n_kt, warp, kpart, g, c)

    @cute.jit
    def token_of(self, mTok: cute.Tensor, p: Int32) -> Int32:
        """The token of sorted pair ``p`` (direct mode: pairs in [T, k] order)."""
        tok = p
        if const_expr(self.direct_top_k > 0):
            tok = p // self.direct_top_k
        else:
            tok = mTok[p]
        return tok

    @cute.jit
    def zero_output(self, mZero: cute.Tensor, bx: Int32, by: Int32, tidx: Int32):
        """Zero the float32 output the L2 scatter accumulates into, spread over the whole L1 grid (saves a
        memset launch). L1 kernels only: the L2 launch that follows is ordered after them."""
        gx, gy, _ = cute.arch.grid_dim()
        n16 = mZero.shape[0] * mZero.shape[1] // 4
        zbase = mZero.iterator.toint()
        for q in cutlass.range((by * gx + bx) * self.threads + tidx, n16, gx * gy * self.threads, unroll=1):
            ptx.st_global_v4_zero(zbase + Int64(q) * 16)

    @cute.jit
    def tile(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor, mTok: cute.Tensor,
             mRW: cute.Tensor, mOut: cute.Tensor, expert: Int32, begin: Int32, cnt: Int32, bx: Int32,
             kt0: Int32, warp: Int32, kpart: Int32, g: Int32, c: Int32):
        k = self.k
        row_base = bx * self.bm + warp * (16 * self.row_tiles)

        # --- per-thread base addresses (bytes) ---
        w_base = self.weight_base(mW, expert, c)
        s_base = self.scale_base(mS, expert, c)
        a_addr = cute.make_rmem_tensor((self.row_tiles, 2), Int64)
        s_addr = cute.make_rmem_tensor((self.row_tiles, 2), Int64)
        for mt in cutlass.range_constexpr(self.row_tiles):
            for h in cutlass.range_constexpr(2):
                r = row_base + mt * 16 + g + h * 8
                a_addr[mt, h] = self.weight_row(w_base, r)
                s_addr[mt, h] = self.scale_row(s_base, r)
        # B row addresses of each 8-token block, for each half of a lane's 64 activation bytes (stage_x: shared
        # addresses, advancing ``b_step`` bytes a k-tile)
        b_addr = cute.make_rmem_tensor((self.nb, 2), Int32 if self.stage_x else Int64)
        b_step = cute.make_rmem_tensor((self.nb, 2), Int32)
        x_base = mX.iterator.toint() + Int64(c * 64)
        for nb in cutlass.range_constexpr(0 if self.stage_x else self.nb):
            t = nb * 8 + g
            if t > cnt - 1:
                t = cnt - 1
            brow = begin + t
            if const_expr(self.mode == "swiglu"):
                brow = self.token_of(mTok, brow)
            for half in cutlass.range_constexpr(2):
                b_addr[nb, half] = x_base + Int64(brow) * (k * 2)
        # block_columns: lane (g, c) feeds B column g, which holds the k-tile's scale block g: the first half of the
        # lane's 32 k when g = 2c, the second when g = 2c + 1, else nothing; those halves read zeros (``mTok``, or
        # with stage_x the zero k-tile after the staged row, read in place)
        smem_s = Int32(0)
        if const_expr(self.smem_bytes > 0):
            smem_s = Int32(cutlass.memory.SmemAllocator().allocate_tensor(
                cutlass.Uint8, cute.make_layout(self.smem_bytes), 16).iterator.toint())
        if const_expr(self.stage_x):
            x_s = smem_s
            zero_s = x_s + (self.k // K_TILE) * _STAGED_KTILE_BYTES
            for half in cutlass.range_constexpr(2):
                feeds = Int32(1)
                if const_expr(self.block_columns):
                    feeds = Int32(g == 2 * c + half)  # arithmetic, not a branch: the addresses stay in registers
                b_addr[0, half] = zero_s + feeds * (x_s - zero_s) + (c * 4 + c // 2) * 16
                b_step[0, half] = feeds * _STAGED_KTILE_BYTES
        elif const_expr(self.block_columns):
            zeros = mTok.iterator.toint() + Int64(c * 64)
            for half in cutlass.range_constexpr(2):
                if g != 2 * c + half:
                    b_addr[0, half] = zeros

        # --- register pipeline of weight words and scale pairs ---
        D = self.depth
        n_kt = self.n_kt
        wbuf = cute.make_rmem_tensor((D, self.row_tiles, 2, 4), Int32)
        sbuf = cute.make_rmem_tensor((D, self.row_tiles, 2), Int32)
        acc = cute.make_rmem_tensor((self.row_tiles, self.nb, 4), Float32)
        acc.fill(0.0)
        DB = self.b_depth
        xbuf = cute.make_rmem_tensor((max(DB, 1), self.nb, 16), Int32)
        kt_last = kt0 + n_kt - 1
        for d in cutlass.range_constexpr(D):
            self.load_a(wbuf, sbuf, a_addr, s_addr, d, kt0 + d)
        if const_expr(self.pdl_prefetch):
            # one lane per row: the rest of the row's slice, a 128-byte line per two k-tiles (row tiles: the
            # row's 64 bytes of every k-tile, which two rows share a line of)
            step = 1 if self.weight_tiles else 2
            if c == 0:
                for mt in cutlass.range_constexpr(self.row_tiles):
                    for h in cutlass.range_constexpr(2):
                        for j in cutlass.range((kt0 + D) // step, (kt0 + n_kt) // step, unroll=1):
                            ptx.prefetch_l2(a_addr[mt, h] + Int64(j * step * self.kt_bytes))
        if const_expr(self.pdl and self.mode == "scatter"):
            cute.arch.griddepcontrol_wait()  # L1's h (the B operand) is complete from here
        if const_expr(self.stage_x):  # while the first weight k-tiles are on their way
            self.stage_row(mX, self.token_of(mTok, begin), x_s, zero_s, (kpart * self.warps + warp) * 32 + g * 4 + c)
        for d in cutlass.range_constexpr(DB):
            self.load_b(xbuf, b_addr, b_step, d, kt0 + d)

        for kto in cutlass.range(0, n_kt, D, unroll=1):
            for d in cutlass.range_constexpr(D):
                kt = kt0 + kto + d
                # activations of this k-tile (from the pipeline, or loaded now when there are many)
                xw = cute.make_rmem_tensor((self.nb, 16), Int32)
                if const_expr(DB > 0):
                    for nb in cutlass.range_constexpr(self.nb):
                        for i in cutlass.range_constexpr(16):
                            xw[nb, i] = xbuf[d % DB, nb, i]
                    nxb = kt + DB
                    if nxb > kt_last:
                        nxb = kt_last
                    self.load_b(xbuf, b_addr, b_step, d % DB, nxb)
                else:
                    self.load_b(xw, b_addr, b_step, None, kt)
                # take this stage's weights, refill the slot with k-tile kt + D (clamped: a re-read hits cache)
                cw = cute.make_rmem_tensor((self.row_tiles, 2, 4), Int32)
                cs = cute.make_rmem_tensor((self.row_tiles, 2), Int32)
                for mt in cutlass.range_constexpr(self.row_tiles):
                    for h in cutlass.range_constexpr(2):
                        cs[mt, h] = sbuf[d, mt, h]
                        for i in cutlass.range_constexpr(4):
                            cw[mt, h, i] = wbuf[d, mt, h, i]
                nxt = kt + D
                if nxt > kt_last:
                    nxt = kt_last
                self.load_a(wbuf, sbuf, a_addr, s_addr, d, nxt)
                self.mma_ktile(cw, cs, xw, acc)

        if const_expr(self.reduce_bytes > 0):
            # the second K warps hand their sums to the first through shared memory; those run the epilogue
            red = smem_s + self.staged_bytes + (warp * 32 + g * 4 + c) * 16
            if kpart == 1:
                for mt in cutlass.range_constexpr(self.row_tiles):
                    ptx.st_shared_v4_f32(red + mt * (self.warps * 512), acc[mt, 0, 0], acc[mt, 0, 1], acc[mt, 0, 2],
                                         acc[mt, 0, 3])
            cute.arch.barrier()
            if kpart == 0:
                for mt in cutlass.range_constexpr(self.row_tiles):
                    v = ptx.ld_shared_v4_f32(red + mt * (self.warps * 512))
                    for i in cutlass.range_constexpr(4):
                        acc[mt, 0, i] = acc[mt, 0, i] + v[i]
                self.epilogue(acc, mAlpha, mTok, mRW, mOut, expert, begin, cnt, row_base, g, c)
        else:
            self.epilogue(acc, mAlpha, mTok, mRW, mOut, expert, begin, cnt, row_base, g, c)

    @property
    def occupancy(self) -> dict:
        """Launch options: ``min_ctas`` CTAs per SM bound the registers (3 CTAs: 168 a thread with 128 threads, 80
        with 256, as ``k_warps`` 2 has). Left alone, ptxas (CUDA 13) gives the staged V4-Flash L1 with
        ``block_columns`` 80 registers and spills in its k-tile loop; with the bound it takes 128 and spills none
        (``tests/kernel_resources_probe.py`` checks every config)."""
        opts = {"min_blocks_per_mp": self.min_ctas, "preferred_smem_carveout": -1} if self.min_ctas else {}
        if self.max_ctas:
            opts["preferred_smem_carveout"] = 100
        return opts

    @property
    def staged_bytes(self) -> int:
        """Shared memory of ``stage_x``: the staged row, then one zero k-tile (0 without ``stage_x``)."""
        return (self.k // K_TILE + 1) * _STAGED_KTILE_BYTES if self.stage_x else 0

    @property
    def reduce_bytes(self) -> int:
        """Shared memory where the second K warps of ``k_warps`` leave their sums (``"swiglu"``)."""
        return self.warps * 32 * self.row_tiles * 16 if self.k_warps > 1 and self.mode == "swiglu" else 0

    @property
    def smem_bytes(self) -> int:
        used = self.staged_bytes + self.reduce_bytes
        if self.max_ctas:  # max_ctas + 1 CTAs of this size (and their reserved bytes) exceed the SM's shared memory
            used = max(used, SM_SMEM_BYTES // (self.max_ctas + 1) - CTA_SMEM_RESERVED + 128)
        return used

    @property
    def kt_bytes(self) -> int:
        """Bytes from one k-tile of a weight row to the next (``weight_tiles``: a row group's whole k-tile)."""
        return ROWS * TILE_BYTES if self.weight_tiles else TILE_BYTES

    def weight_base(self, mW: cute.Tensor, expert: Int32, c: Int32) -> Int64:
        """Where the bytes of lane ``c`` of a quad start in the weights of ``expert`` (:meth:`weight_row` adds a row)."""
        return mW.iterator.toint() + Int64(expert) * (self.m * (self.k // 2)) + Int64(c * 16)

    def weight_row(self, w_base: Int64, r: Int32) -> Int64:
        """Where weight row ``r`` of the expert at ``w_base`` starts its first k-tile (``weight_tiles``: row tiles)."""
        if const_expr(self.weight_tiles):
            return w_base + Int64(r // ROWS) * (ROWS * (self.k // 2)) + Int64((r % ROWS) * TILE_BYTES)
        return w_base + Int64(r) * (self.k // 2)

    def scale_base(self, mS: cute.Tensor, expert: Int32, c: Int32) -> Int64:
        """Where lane ``c`` of a quad finds its two block scales of a row's first k-tile (its 32 K: blocks 2 c and
        2 c + 1) in the scales of ``expert``, before :meth:`scale_row` adds the row: of the k-tile's two 512-byte
        swizzle atoms (``swizzle``), atom c // 2, bytes 2 (c % 2) and 2 (c % 2) + 1 of the row's 4."""
        return mS.iterator.toint() + Int64(expert) * self.scale_bytes + Int64((c // 2) * 512 + (c % 2) * 2)

    def scale_row(self, s_base: Int64, r: Int32) -> Int64:
        """Where row ``r``'s two scales are, from :meth:`scale_base`: its 128-row block of atoms, its 16-byte line
        (r % 32) and 4-byte group ((r // 32) % 4) in an atom. A k-tile on is 1024 bytes (two atoms) on."""
        return s_base + Int64((r // 128) * (self.kb4 * 512) + (r % 32) * 16 + ((r // 32) % 4) * 4)

    @cute.jit
    def load_a(self, wbuf: cute.Tensor, sbuf: cute.Tensor, a_addr: cute.Tensor, s_addr: cute.Tensor,
               slot: cutlass.Constexpr[int], kt: Int32):
        for mt in cutlass.range_constexpr(self.row_tiles):
            for h in cutlass.range_constexpr(2):
                v = ptx.ld_global_v4(a_addr[mt, h] + Int64(kt * self.kt_bytes), self.l2_prefetch)
                for i in cutlass.range_constexpr(4):
                    wbuf[slot, mt, h, i] = v[i]
                sbuf[slot, mt, h] = ptx.ld_global_u16(s_addr[mt, h] + Int64(kt * 1024))

    @cute.jit
    def stage_row(self, mX: cute.Tensor, token: Int32, x_s: Int32, zero_s: Int32, tidx: Int32):
        """``stage_x``: the CTA copies x[token] into shared memory in the "lane" K order (each 16-byte chunk of 8
        logical k is permuted in place, ``k_order``), times ``2**BC_X_LOG2`` with ``block_columns``, and zeroes the
        zero k-tile; then waits for every thread's part."""
        src = mX.iterator.toint() + Int64(token) * (self.k * 2)
        for i in cutlass.range(tidx, self.k // 8, self.threads, unroll=1):
            v = ptx.ld_global_v4_keep(src + Int64(i) * 16)
            words = [*lane_words(v[0], v[2]), *lane_words(v[1], v[3])]
            if const_expr(self.block_columns):
                words = [ptx.mul_bf16x2(wd, Int32(_BC_X_SCALE_BF16X2)) for wd in words]
            ptx.st_shared_v4_b32(x_s + (i + i // 8) * 16, *words)
        if tidx < _STAGED_KTILE_BYTES // 16:
            ptx.st_shared_v4_b32(zero_s + tidx * 16, Int32(0), Int32(0), Int32(0), Int32(0))
        cute.arch.barrier()

    @cute.jit
    def load_b(self, xbuf: cute.Tensor, b_addr: cute.Tensor, b_step: cute.Tensor, slot: cutlass.Constexpr, kt: Int32):
        for nb in cutlass.range_constexpr(self.nb):
            for q in cutlass.range_constexpr(4):
                if const_expr(self.stage_x):
                    v = ptx.ld_shared_v4_b32(b_addr[nb, q // 2] + kt * b_step[nb, q // 2] + q * 16)
                else:
                    v = ptx.ld_global_v4_keep(b_addr[nb, q // 2] + Int64(kt * 256 + q * 16))
                for i in cutlass.range_constexpr(4):
                    if const_expr(slot is None):
                        xbuf[nb, q * 4 + i] = v[i]
                    else:
                        xbuf[slot, nb, q * 4 + i] = v[i]

    @cute.jit
    def mma_ktile(self, cw: cute.Tensor, cs: cute.Tensor, xw: cute.Tensor, acc: cute.Tensor):
        # The MMAs' order changes no result (each accumulator sees its k16 steps in the same order), only the
        # schedule: interleaved, the row tiles' accumulator chains overlap, but ptxas takes more registers (V4-Flash
        # L2: 138 instead of 128, 3 CTAs per SM instead of 4). Which pays depends on T (``Sm90NvFp4MoE.config``).
        # decoded A words: a[mt, h, w, j] = (v_j, v_{j+4}) of word w of row h of row tile mt, times its block scale
        # (block_columns: unscaled, and the MMAs go to per-k-tile sums ``d``, see below)
        a = cute.make_rmem_tensor((self.row_tiles, 2, 4, 4), Int32)
        steps = [(w, u, nb) for w in range(4) for u in range(2) for nb in range(self.nb)]
        dst = acc
        if const_expr(self.block_columns):
            # "scatter" reads h already scaled (the "swiglu" epilogue), stage_x staged x so
            if const_expr(self.mode == "swiglu" and not self.stage_x):
                for i in cutlass.range_constexpr(16):
                    xw[0, i] = ptx.mul_bf16x2(xw[0, i], Int32(_BC_X_SCALE_BF16X2))
            dst = cute.make_rmem_tensor((self.row_tiles, 1, 4), Float32)
            dst.fill(0.0)
        if const_expr(self.interleave_rows):
            for mt in cutlass.range_constexpr(self.row_tiles):
                self.decode_rows(cw, cs, a, mt)
            for w, u, nb in steps:
                for mt in cutlass.range_constexpr(self.row_tiles):
                    self.mma_step(a, xw, dst, mt, w, u, nb)
        else:
            for mt in cutlass.range_constexpr(self.row_tiles):
                self.decode_rows(cw, cs, a, mt)
                for w, u, nb in steps:
                    self.mma_step(a, xw, dst, mt, w, u, nb)
        if const_expr(self.block_columns):
            # Lane quad c's 32 k are scale blocks 2c (words 0, 1) and 2c + 1 (words 2, 3), and B column n is fed by
            # block n's k alone (``tile``): so d[r, n] = (block n of row r) . x, unscaled, and the lane holding
            # d[r, 2c + i] (accumulator i) is the lane that loaded that block's scale.
            for mt in cutlass.range_constexpr(self.row_tiles):
                for h in cutlass.range_constexpr(2):
                    s0, s1 = ptx.e4m3x2_to_f32x2(cs[mt, h])
                    acc[mt, 0, 2 * h] = acc[mt, 0, 2 * h] + s0 * dst[mt, 0, 2 * h]
                    acc[mt, 0, 2 * h + 1] = acc[mt, 0, 2 * h + 1] + s1 * dst[mt, 0, 2 * h + 1]

    @cute.jit
    def decode_rows(self, cw: cute.Tensor, cs: cute.Tensor, a: cute.Tensor, mt: int):
        for h in cutlass.range_constexpr(2):
            if const_expr(not self.block_columns):  # (block_columns: the scales go on the partial sums)
                s01 = ptx.e4m3x2_to_bf16x2_pair(cs[mt, h], e2m1r.DECODE_BIAS)
            for w in cutlass.range_constexpr(4):
                if const_expr(self.weight_tiles):  # row tiles hold Hopper-order words (``row_tiles``)
                    r = e2m1r.decode_e2m1x8_hopper(cw[mt, h, w], ptx.rotr_b32)
                else:
                    r = e2m1r.decode_e2m1x8(cw[mt, h, w])
                for j in cutlass.range_constexpr(4):
                    a[mt, h, w, j] = r[j] if const_expr(self.block_columns) else ptx.mul_bf16x2(r[j], s01[w // 2])

    @cute.jit
    def mma_step(self, a: cute.Tensor, xw: cute.Tensor, acc: cute.Tensor, mt: int, w: int, u: int, nb: int):
        b0, b1 = self.b_pair(xw, nb, 2 * w + u)
        d = ptx.mma_bf16_16816(a[mt, 0, w, 2 * u], a[mt, 1, w, 2 * u], a[mt, 0, w, 2 * u + 1], a[mt, 1, w, 2 * u + 1],
                               b0, b1, acc[mt, nb, 0], acc[mt, nb, 1], acc[mt, nb, 2], acc[mt, nb, 3])
        for i in cutlass.range_constexpr(4):
            acc[mt, nb, i] = d[i]

    def b_pair(self, xw: cute.Tensor, nb: int, step: int) -> tuple[Int32, Int32]:
        """The B registers (k, k + 4), (k + 1, k + 5) of MMA step ``step`` from a lane's 16 activation words."""
        w, u = step // 2, step % 2
        if self.read_order == "lane":
            b0, b1 = xw[nb, 4 * w + 2 * u], xw[nb, 4 * w + 2 * u + 1]
        else:
            b0, b1 = lane_words(xw[nb, 4 * w + u], xw[nb, 4 * w + u + 2])
        return b0, b1

    @cute.jit
    def epilogue(self, acc: cute.Tensor, mAlpha: cute.Tensor, mTok: cute.Tensor, mRW: cute.Tensor,
                 mOut: cute.Tensor, expert: Int32, begin: Int32, cnt: Int32, row_base: Int32, g: Int32, c: Int32):
        if const_expr(self.mode == "swiglu"):
            scale_lo = mAlpha[2 * expert] * Float32(self.epi_scale)      # gate rows
            scale_hi = mAlpha[2 * expert + 1] * Float32(self.epi_scale)  # up rows
        else:
            scale_lo = mAlpha[expert] * Float32(self.epi_scale)
            scale_hi = scale_lo
        out_base = mOut.iterator.toint()
        if const_expr(self.block_columns):
            # a row's 8 block columns, 2 per lane of its quad, summed where the epilogue reads the tile's token
            for mt in cutlass.range_constexpr(self.row_tiles):
                for h in cutlass.range_constexpr(2):
                    v = acc[mt, 0, 2 * h] + acc[mt, 0, 2 * h + 1]
                    v = v + cute.arch.shuffle_sync_bfly(v, 1)
                    acc[mt, 0, 2 * h] = v + cute.arch.shuffle_sync_bfly(v, 2)
        # "scatter": every column's token and routing weight loaded first, unconditionally (columns past the tile's
        # pairs read its last pair), so the loads issue back to back: loaded under each column's branch, each paid a
        # load latency in turn (Nsight Compute: the L2 GEMM of V4-Flash T = 4096 1.16 -> 1.06 ms, docs/benchmarks.md).
        # ``ids_first`` False (WGMMA CTAs capped at three per SM, which these registers do not fit): loaded per column
        nbs = acc.shape[1]  # 8-column blocks (a WGMMA tile may run fewer than N's, ``min_tokens``)
        toks = cute.make_rmem_tensor((nbs, 2), Int32)
        wts = cute.make_rmem_tensor((nbs, 2), Float32)
        if const_expr(self.mode == "scatter" and self.ids_first):
            for nb in cutlass.range_constexpr(nbs):
                for tt in cutlass.range_constexpr(2):
                    t = nb * 8 + 2 * c + tt
                    if t > cnt - 1:
                        t = cnt - 1
                    toks[nb, tt] = self.token_of(mTok, begin + t)
                    wts[nb, tt] = mRW[begin + t]
        for mt in cutlass.range_constexpr(self.row_tiles):
            r0 = row_base + mt * 16 + g
            # the addresses of this thread's first column (pair begin + 2 c) and row: every other column of "swiglu"
            # is a constant distance on, which the stores take as an immediate offset
            if const_expr(self.mode == "swiglu"):
                j = k_order.position((row_base + mt * 16) // 2 + g, self.h_order)
                h_col0 = out_base + (Int64(begin + 2 * c) * (self.m // 2) + Int64(j)) * 2
            out_row = out_base + Int64(r0) * 4
            for nb in cutlass.range_constexpr(nbs):
                for tt in cutlass.range_constexpr(2):
                    t = nb * 8 + 2 * c + tt
                    if t < cnt:
                        p = begin + t
                        if const_expr(self.mode == "swiglu"):
                            gate = acc[mt, nb, tt] * scale_lo       # row r0
                            up = acc[mt, nb, 2 + tt] * scale_hi     # row r0 + 8
                            if const_expr(self.swiglu_limit is not None):
                                lim = Float32(self.swiglu_limit)
                                gate = cute.arch.fmin(gate, lim)
                                up = cute.arch.fmax(cute.arch.fmin(up, lim), -lim)
                            # sigmoid by the approximate reciprocal (<= 1 ulp, h is rounded to BF16): a division is a
                            # dozen instructions and a branch to its slow path per value
                            hval = gate * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gate, fastmath=True)) * up
                            if const_expr(self.block_columns):
                                hval = hval * Float32(2.0 ** BC_X_LOG2)  # the scale "scatter" expects of h
                            ptx.st_global_b16(h_col0 + (nb * 8 + tt) * self.m,
                                              ptx.f32x2_to_bf16x2(hval, hval))
                        elif const_expr(self.mode == "scatter"):
                            if const_expr(self.ids_first):
                                tok, wt = toks[nb, tt], wts[nb, tt]
                            else:
                                tok, wt = self.token_of(mTok, p), mRW[p]
                            addr = out_row + Int64(tok) * (self.m * 4)
                            sw = scale_lo * wt  # (one alpha for both rows)
                            ptx.red_add_f32(addr, acc[mt, nb, tt] * sw)           # row r0
                            ptx.red_add_f32(addr + 32, acc[mt, nb, 2 + tt] * sw)  # row r0 + 8
                        else:
                            lo = acc[mt, nb, tt] * scale_lo       # row r0
                            hi = acc[mt, nb, 2 + tt] * scale_hi   # row r0 + 8
                            if const_expr(self.out_bf16):
                                addr = out_base + (Int64(p) * self.m + Int64(r0)) * 2
                                ptx.st_global_b16(addr, ptx.f32x2_to_bf16x2(lo, lo))
                                ptx.st_global_b16(addr + 16, ptx.f32x2_to_bf16x2(hi, hi))
                            else:
                                addr = out_base + (Int64(p) * self.m + Int64(r0)) * 4
                                ptx.st_global_f32(addr, lo)
                                ptx.st_global_f32(addr + 32, hi)
