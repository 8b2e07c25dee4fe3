"""What the two SM90 NVFP4 GEMM families (``sm90_moe_gemm``: mma.sync; ``sm90_moe_wgmma``: WGMMA) share: the
problem's static attributes, where a lane's weight words and block scales are, the register decode of a k-tile of
weights, and the epilogues (SwiGLU, routed scatter-add, store). Layout contract: ``sm90_moe_gemm``.

A kernel class mixes :class:`Nvfp4GemmParts` in, names its rules (``violations``, ``family``), calls
:meth:`Nvfp4GemmParts.configure` from its constructor and sets the tiling attributes the epilogue reads
(``row_tiles``, ``block_columns``, ``ids_first``, ``epi_scale``).
"""

from __future__ import annotations

import math
from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import k_order
from . import sm90_ptx as ptx
from . import e2m1_registers as e2m1r
from .row_tiles import ROWS, TILE_BYTES
from .cute_host import expect
from .sm90_config import GEMM_MODES, K_TILE, GemmProblem, Tiling
from .swizzle import swizzled_nbytes

# block_columns: activations ride the MMA as x * 2**BC_X_LOG2, so that products with the unscaled decoded weights
# (v * 2**-126) are normal floats for 2**-62 < |x| < 2**64; x * 2**64 is a BF16 bit pattern:
BC_X_LOG2 = 64


def problem_violations(problem: GemmProblem) -> list[str]:
    """What in ``problem`` no kernel of either family takes (empty: nothing)."""
    bad = []
    if problem.mode not in GEMM_MODES:
        bad.append(f"mode must be one of {GEMM_MODES}, got {problem.mode!r}")
    if problem.k % K_TILE or problem.k <= 0:
        bad.append(f"K={problem.k} must be a positive multiple of {K_TILE}")
    if problem.b_order not in k_order.ORDERS or problem.h_order not in k_order.ORDERS:
        bad.append(f"b_order and h_order must be one of {k_order.ORDERS}, got {problem.b_order!r}, "
                   f"{problem.h_order!r}")
    if problem.direct_top_k < 0 or (problem.direct_top_k and problem.mode == "store"):
        bad.append(f"direct_top_k must be >= 0, and 0 in mode 'store'; got {problem.direct_top_k}")
    if problem.out_bf16 and problem.mode != "store":
        bad.append("out_bf16 is for mode 'store' only")
    if problem.groups < 1 or (problem.groups > 1 and (problem.mode != "store" or problem.m % 128)):
        bad.append(f"groups must be >= 1, and above 1 only in mode 'store' with M a multiple of 128; "
                   f"got {problem.groups} (M={problem.m})")
    return bad


class Nvfp4GemmParts:
    """Weight addressing, decode and epilogues of an NVFP4 grouped GEMM (module docstring)."""

    violations: Callable[[GemmProblem, Tiling], list[str]]  # the family's rules: what it does not take
    family: str                                           # its name in errors
    k_splits: int = 1                                     # CTAs sharing one tile's K ("store", ``MmaTiling``)

    @classmethod
    def can_implement(cls, problem: GemmProblem, tiling: Tiling) -> bool:
        """Whether the kernel takes this configuration (nothing is built)."""
        return not cls.violations(problem, tiling)

    def configure(self, problem: GemmProblem, tiling: Tiling) -> None:
        """Check the configuration (a ``KernelArgumentError`` naming every broken rule) and take its attributes."""
        bad = type(self).violations(problem, tiling)
        expect(not bad, f"{self.family} NVFP4 GEMM {problem}, {tiling}: " + "; ".join(bad))
        self.tiling = tiling
        self.bn = tiling.tile_tokens
        self.nb = tiling.tile_tokens // 8
        self.set_problem(problem)

    def key(self) -> tuple:
        return (self.problem, self.tiling)

    def set_problem(self, problem: GemmProblem) -> None:
        self.problem = problem
        self.m, self.k, self.mode = problem.m, problem.k, problem.mode
        self.swiglu_limit = problem.swiglu_limit
        self.weight_tiles = problem.weight_tiles
        self.b_order, self.h_order = problem.b_order, problem.h_order
        self.out_bf16 = problem.out_bf16
        self.direct_top_k = problem.direct_top_k
        self.groups = problem.groups
        self.scale_bytes = swizzled_nbytes(problem.m, problem.k // 16)  # per expert
        self.kb4 = math.ceil(problem.k // 16 / 4)  # 512-byte scale atoms per 128 rows

    # -- routing -----------------------------------------------------------------------------------------------------
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

    # -- weights -----------------------------------------------------------------------------------------------------
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

    def load_weights(self, wbuf: cute.Tensor, sbuf: cute.Tensor, slot: int, rows) -> None:
        """Slot ``slot`` of the register pipeline: for each of the thread's rows (``mt``, ``h``) its 16 weight bytes
        and its two block scales of one k-tile, from ``rows(mt, h)`` = (weight address, scale address) there."""
        # a plain (traced, not preprocessed) method, so that ``rows`` can be a Python function: its loops are Python's
        for mt in range(self.row_tiles):
            for h in range(2):
                w_addr, s_addr = rows(mt, h)
                v = ptx.ld_global_v4(w_addr)
                for i in range(4):
                    wbuf[slot, mt, h, i] = v[i]
                sbuf[slot, mt, h] = ptx.ld_global_u16(s_addr)

    @cute.jit
    def decode_rows(self, cw: cute.Tensor, cs: cute.Tensor, a: cute.Tensor, mt: int):
        """Row tile ``mt``'s weight words ``cw`` and block scales ``cs`` of a k-tile -> the BF16 A fragment ``a``
        (``block_columns``: unscaled, the scales go on the partial sums)."""
        for h in cutlass.range_constexpr(2):
            if const_expr(not self.block_columns):
                s01 = ptx.e4m3x2_to_bf16x2_pair(cs[mt, h], e2m1r.DECODE_BIAS)
            for w in cutlass.range_constexpr(4):
                if const_expr(self.weight_tiles):  # row tiles hold Hopper-order words (``row_tiles``)
                    r = e2m1r.decode_e2m1x8_hopper(cw[mt, h, w], ptx.rotr_b32)
                else:
                    r = e2m1r.decode_e2m1x8(cw[mt, h, w])
                for j in cutlass.range_constexpr(4):
                    a[mt, h, w, j] = r[j] if const_expr(self.block_columns) else ptx.mul_bf16x2(r[j], s01[w // 2])

    # -- epilogues ---------------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, acc: cute.Tensor, mAlpha: cute.Tensor, mTok: cute.Tensor, mRW: cute.Tensor,
                 mOut: cute.Tensor, expert: Int32, begin: Int32, cnt: Int32, row_base: Int32, g: Int32, c: Int32):
        if const_expr(self.mode == "swiglu"):
            scale_lo = mAlpha[2 * expert] * Float32(self.epi_scale)      # gate rows
            scale_hi = mAlpha[2 * expert + 1] * Float32(self.epi_scale)  # up rows
        elif const_expr(self.mode == "store"):
            scale_lo = mAlpha[0] * Float32(self.epi_scale)   # one alpha for every group
            scale_hi = scale_lo
        else:
            scale_lo = mAlpha[expert] * Float32(self.epi_scale)
            scale_hi = scale_lo
        out_base = mOut.iterator.toint()
        out_row_elems = self.m * self.groups  # "store": a token's row of out holds every group's M outputs
        if const_expr(self.block_columns):
            # a row's 8 block columns, 2 per lane of its quad, summed where the epilogue reads the tile's token
            for mt in cutlass.range_constexpr(self.row_tiles):
                for h in cutlass.range_constexpr(2):
                    v = acc[mt, 0, 2 * h] + acc[mt, 0, 2 * h + 1]
                    v = v + cute.arch.shuffle_sync_bfly(v, 1)
                    acc[mt, 0, 2 * h] = v + cute.arch.shuffle_sync_bfly(v, 2)
        # "scatter": every column's token and routing weight loaded first, unconditionally (columns past the tile's
        # pairs read its last pair), so the loads issue back to back instead of one latency per column in turn.
        # ``ids_first`` False (where these registers do not fit the CTAs per SM): loaded per column
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
                                addr = out_base + (Int64(p) * out_row_elems + Int64(expert * self.m + r0)) * 2
                                ptx.st_global_b16(addr, ptx.f32x2_to_bf16x2(lo, lo))
                                ptx.st_global_b16(addr + 16, ptx.f32x2_to_bf16x2(hi, hi))
                            else:
                                addr = out_base + (Int64(p) * out_row_elems + Int64(expert * self.m + r0)) * 4
                                if const_expr(self.k_splits > 1):   # a share of K: summed with the others'
                                    ptx.red_add_f32(addr, lo)
                                    ptx.red_add_f32(addr + 32, hi)
                                else:
                                    ptx.st_global_f32(addr, lo)
                                    ptx.st_global_f32(addr + 32, hi)
