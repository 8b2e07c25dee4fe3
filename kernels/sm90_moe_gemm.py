"""SM90 grouped NVFP4 x BF16 GEMM on warp-level MMAs (``mma.sync``, swap-AB) with the MoE epilogues: SwiGLU (L1),
routed scatter-add (L2), store (dense). The decode and mid-size path of the MoE and the dense NVFP4 linear.

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
Direct mode (``GemmProblem.direct_top_k``): work tile ``p`` is routed pair ``p`` alone, ``tiles`` is
``topk_ids`` viewed [P, 1] (int32 or int64), the weights ``topk_weights`` [P] in pair order, token ``p // k``.

Epilogues (``mode``, ``sm90_nvfp4_gemm_parts``):
* ``"swiglu"``: ``h[p, j] = bf16(silu(min(g, L)) * clamp(u, -L, L))`` for sorted pair p (row p of ``h``
  in ``h_order``, the K order the L2 kernel reads), with
  ``g, u = alpha[e, 0] * acc_r, alpha[e, 1] * acc_{r+8}`` (a thread's rows r and r+8 are a
  gate row and its up row thanks to the interleave); B rows are gathered as ``x[token_of[p]]``.
* ``"scatter"``: ``out[token_of[p], r] += alpha * weight[p] * acc`` (fp32 ``red.add``; ``out``
  must be zero first: the L1 kernel zeroes it); B rows are ``h[p]``.
* ``"store"``: ``out[t, r] = alpha * acc`` (f32 or bf16), B rows are ``x[t]``, no routing.

The configuration is a ``GemmProblem`` and an ``MmaTiling`` (``sm90_config``, whose docstrings say what each field
does), picked by ``sm90_heuristics``; :meth:`Sm90Nvfp4MmaGemm.can_implement` says whether a pair is valid.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import e2m1_registers as e2m1r
from . import sm90_ptx as ptx
from .sm90_config import K_TILE, GemmProblem, MmaTiling
from .sm90_nvfp4_gemm_parts import BC_X_LOG2, Nvfp4GemmParts, problem_violations

_BC_X_SCALE_BF16X2 = 0x5F805F80  # 2**BC_X_LOG2 as a pair of BF16
# stage_x: the staged row's 16-byte chunk i sits at byte 16 * (i + i // 8) (16 padding bytes after every 128), so
# that the 4 lane quads' 16-byte reads of one k-tile fall on distinct banks; a k-tile (16 chunks) spans 288 bytes
_STAGED_KTILE_BYTES = 288
# shared memory of an SM (sm_90) and what each resident CTA costs besides its own: ``max_ctas`` pads a CTA's
# allocation so that one more than the cap does not fit
SM_SMEM_BYTES = 228 * 1024
CTA_SMEM_RESERVED = 1024
WARPS = 4  # row groups (warps) per CTA; each owns 16 * row_tiles weight rows


def lane_words(lo: Int32, hi: Int32) -> tuple[Int32, Int32]:
    """Two logical-order activation words, (k, k + 1) and (k + 4, k + 5), as the "lane" K order holds them
    (``k_order``): (k, k + 4) and (k + 1, k + 5), one MMA step's B registers."""
    return ptx.prmt(lo, hi, 0x5410), ptx.prmt(lo, hi, 0x7632)


def mma_violations(problem: GemmProblem, tiling: MmaTiling) -> list[str]:
    """What in (``problem``, ``tiling``) the mma.sync GEMM does not take (empty: it takes it)."""
    bad = problem_violations(problem)
    t, direct = tiling, problem.direct_top_k > 0
    k_tiles = problem.k // K_TILE
    if t.tile_tokens % 8 or not 8 <= t.tile_tokens <= 64:
        bad.append(f"tile_tokens must be a multiple of 8 in [8, 64], got {t.tile_tokens}")
    if t.row_tiles not in (1, 2):
        bad.append(f"row_tiles must be 1 or 2, got {t.row_tiles}")
    elif problem.m % (WARPS * 16 * t.row_tiles):
        bad.append(f"M={problem.m} must be a multiple of the CTA's {WARPS * 16 * t.row_tiles} rows")
    if problem.b_order not in ("logical", "lane"):
        bad.append(f"b_order must be 'logical' or 'lane', got {problem.b_order!r}")
    if t.k_warps not in (1, 2) or (t.k_warps == 2 and not (t.tile_tokens == 8 and problem.mode != "store"
                                                            and k_tiles % 2 == 0)):
        bad.append(f"k_warps must be 1, or 2 with 8-token tiles of an MoE mode and an even number of k-tiles; "
                   f"got {t.k_warps}")
    elif t.depth not in (1, 2, 4) or k_tiles // t.k_warps % t.depth:
        bad.append(f"depth must be 1, 2 or 4 and divide the {k_tiles // t.k_warps} k-tiles a warp walks, "
                   f"got {t.depth}")
    if t.interleave_rows and t.row_tiles != 2:
        bad.append("interleave_rows needs two row tiles")
    if t.block_columns and not (direct and t.tile_tokens == 8):
        bad.append("block_columns needs one-token tiles: direct_top_k > 0, tile_tokens 8")
    if t.stage_x and not (direct and problem.mode == "swiglu" and problem.b_order == "logical"):
        bad.append("stage_x is for a direct 'swiglu' GEMM reading logical-order x")
    if t.pdl and not direct:
        bad.append("pdl is for the direct MoE chain (direct_top_k > 0)")
    if t.max_ctas < 0:
        bad.append(f"max_ctas must be >= 0, got {t.max_ctas}")
    if t.k_splits < 1 or (t.k_splits > 1 and (problem.mode != "store" or problem.out_bf16 or t.k_warps > 1
                                               or k_tiles % (t.k_splits * t.depth))):
        bad.append(f"k_splits must be >= 1, and above 1 only in mode 'store' with float32 out, one K warp and a "
                   f"depth dividing each split's k-tiles ({k_tiles} in all); got {t.k_splits}")
    return bad


class Sm90Nvfp4MmaGemm(Nvfp4GemmParts):
    """One compiled configuration of the mma.sync grouped GEMM (module docstring): ``problem`` and ``tiling``.

    Launched as ``fn(w, s, alpha, x, token_of, weight_of, tiles, num_tiles, out, zero, stream)`` (``cute_host``);
    ``zero`` is the float32 output an L1 (``"swiglu"``) kernel zeroes for the L2 that follows (``out`` of L2).
    """

    violations = staticmethod(mma_violations)
    family = "mma.sync"

    def __init__(self, problem: GemmProblem, tiling: MmaTiling):
        self.configure(problem, tiling)
        self.warps, self.row_tiles = WARPS, tiling.row_tiles
        self.bm = WARPS * 16 * tiling.row_tiles
        self.k_warps = tiling.k_warps
        self.threads = WARPS * self.k_warps * 32
        self.k_splits = tiling.k_splits
        self.n_kt = problem.k // K_TILE // self.k_warps // self.k_splits  # k-tiles per warp
        self.depth = tiling.depth
        self.interleave_rows = tiling.interleave_rows
        # L2 of the direct chain waits for L1's h; L1 lets L2 launch at once (it zeroes out itself, and follows
        # whatever ran before, which may still read that memory, so it is not launched early itself)
        self.pdl = tiling.pdl and problem.mode == "scatter"
        self.early_dependents = tiling.pdl and problem.mode == "swiglu"
        self.block_columns = tiling.block_columns
        self.stage_x = tiling.stage_x
        self.min_ctas = 3 if self.stage_x or self.k_warps > 1 else 0
        self.max_ctas = tiling.max_ctas
        # the K order of the activation words the MMAs take (staged x is in the "lane" order)
        self.read_order = "lane" if self.stage_x else problem.b_order
        # the decoded weights are v * 2**-126 unscaled in this mode; x * 2**BC_X_LOG2 keeps the products normal
        self.epi_scale = float(2 ** (126 - BC_X_LOG2 if self.block_columns else e2m1r.EPILOGUE_LOG2))
        # activations ride the register pipeline too (two k-tiles ahead) when they are few
        b_depth = 2 if self.nb == 1 and not self.stage_x else 0
        self.b_depth = 0 if b_depth and self.depth % b_depth else b_depth
        self.ids_first = True  # the scatter epilogue loads every column's token and weight first (``epilogue``)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor,
                 mTok: cute.Tensor, mRW: cute.Tensor, mTiles: cute.Tensor, mNumTiles: cute.Tensor,
                 mOut: cute.Tensor, mZero: cute.Tensor, stream):
        if const_expr(self.mode == "store"):
            n_tiles = (mX.shape[0] + self.bn - 1) // self.bn
        else:
            n_tiles = mTiles.shape[0]
        self.kernel(mW, mS, mAlpha, mX, mTok, mRW, mTiles, mNumTiles, mOut, mZero).launch(
            grid=[self.m // self.bm, n_tiles, self.groups * self.k_splits], block=[self.threads, 1, 1], stream=stream,
            smem=self.smem_bytes, use_pdl=self.pdl, **self.occupancy)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mAlpha: cute.Tensor, mX: cute.Tensor,
               mTok: cute.Tensor, mRW: cute.Tensor, mTiles: cute.Tensor, mNumTiles: cute.Tensor,
               mOut: cute.Tensor, mZero: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        # grid z: a "store" call's groups times its K shares (group bz // k_splits, share bz % k_splits); elsewhere
        # one, and the first k-tile reads bz all the same, since without the read ptxas allocates the decode kernels'
        # registers differently, and this machine code is the measured one
        bx, by, bz = cute.arch.block_idx()
        split = bz
        if const_expr(self.groups > 1):
            split = bz % self.k_splits
        if const_expr(self.mode == "swiglu"):
            self.zero_output(mZero, bx, by, tidx)
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
            if const_expr(self.groups > 1):
                expert = bz // self.k_splits
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
                      (split * self.k_warps + kpart) * self.n_kt, warp, kpart, g, c)

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
        if const_expr(self.groups > 1):  # x [T, G, K]: the group's K within each token's row
            x_base = x_base + Int64(expert) * (k * 2)
        for nb in cutlass.range_constexpr(0 if self.stage_x else self.nb):
            t = nb * 8 + g
            if t > cnt - 1:
                t = cnt - 1
            brow = begin + t
            if const_expr(self.mode == "swiglu"):
                brow = self.token_of(mTok, brow)
            for half in cutlass.range_constexpr(2):
                b_addr[nb, half] = x_base + Int64(brow) * (k * 2 * self.groups)
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

    def load_a(self, wbuf: cute.Tensor, sbuf: cute.Tensor, a_addr: cute.Tensor, s_addr: cute.Tensor, slot: int,
               kt: Int32) -> None:
        """Pipeline slot ``slot`` <- k-tile ``kt`` of the thread's rows, each from its own address."""
        self.load_weights(wbuf, sbuf, slot, lambda mt, h: (a_addr[mt, h] + Int64(kt * self.kt_bytes),
                                                           s_addr[mt, h] + Int64(kt * 1024)))

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
        # L2: 138 instead of 128, 3 CTAs per SM instead of 4). Which pays depends on T (``sm90_heuristics.moe_plan``).
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
