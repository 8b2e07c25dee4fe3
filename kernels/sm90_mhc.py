"""SM90 (sm_90a) kernel for the mHC ``hc_pre`` of each token (``mhc_reference.hc_pre``) but its product by ``fn``.

Per token the weights are a few dozen numbers (``(2 + hc) * hc`` mixes in, ``hc`` pre, ``hc`` post and
an ``hc x hc`` doubly-stochastic comb out), but the reference reaches them through about 150 small torch
ops per ``hc_pre`` (sigmoids, a softmax, then ``iters - 1`` rounds of row and column sums and divisions), each
a launch on the GPU, and the RMS norm before and the collapse after are seven more. Here one CTA per token sums
the squares of its streams, its first warp computes the weights in registers, and all of its threads collapse the
streams with ``pre``: one launch after cuBLAS's ``x @ fn.T``. Same formulas in float32 (the norm's scalar
multiplies the products instead of the streams); ``exp`` is ``ex2.approx`` of ``x * log2(e)`` (a few ulp from
torch's). The comb's Sinkhorn rounds are a dependent chain of ``2 * iters`` normalisations; one lane holds one
entry (``hc * hc <= 32``), and a row's or a column's sum is a butterfly of shuffles within its lanes, so a round
costs a few shuffles and one division a lane: at V4-Flash's shapes (4 streams of 4096, 20 rounds) a launch takes
5.9 us at one token, against 10.4 us with one thread running the whole chain (``docs/design/runtime.md``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .sm90_ptx import LOG2E
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import HcPreFusedConfig
from .sm90_heuristics import HC_PRE_CLUSTERS, HC_PRE_MAX_THREADS, hc_pre_fused_config

HC_SIZES = (1, 2, 4)                   # streams per token: a power of two whose comb fits one warp (V4: 4)
PRE_THREADS = 1024                     # Sm90HcPre: threads of a token's CTA (V4-Flash: one 16-byte load a stream)
NORM_CHUNKS = 2                        # Sm90HcPre with the norm: 16-byte pieces of the collapse a thread holds ...
NORM_MAX_HIDDEN = NORM_CHUNKS * PRE_THREADS * 4   # ... so H up to 8192 (V4-Flash 4096, V4-Pro 7168)
FUSED_CLUSTERS = HC_PRE_CLUSTERS          # Sm90HcPreFused: CTAs of a token (16: a non-portable cluster)
FUSED_MAX_THREADS = HC_PRE_MAX_THREADS    # ... and of a CTA, one 16-byte piece of the token's streams each


def _exp(x: Float32) -> Float32:
    return ptx.ex2(x * Float32(LOG2E))


def _sigmoid(x: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + _exp(-x))


def _row_entry(mMM: cute.Tensor, t: Int32, i: int) -> Float32:
    """Entry ``i`` of row ``t`` of the products ``x @ fn.T`` (``Sm90HcPre``: cuBLAS's, in global memory)."""
    return mMM[t, i]


def _weights(op, mix, mBase: cute.Tensor, mScale: cute.Tensor, lane, r) -> tuple:
    """One warp: a token's mixes (its raw products ``mix(i)`` times the RMS norm's reciprocal ``r``) and weights:
    lane ``i * hc + j``'s comb entry (i, j), and lane ``i``'s pre and post (``op``: the kernel, for ``hc``,
    ``iters`` and ``eps``). A row is ``hc`` neighbouring lanes (shuffles across the low bits), a column every
    ``hc``-th lane (the next bits); lanes past the comb's ``hc * hc`` entries repeat them among themselves (traced
    unrolled: plain Python loops). ``mix`` is called in the same places for every kernel, so ``Sm90HcPre`` traces
    the instructions it did when this was its own method."""
    hc = op.hc
    bits = hc.bit_length() - 1
    eps = Float32(op.eps)
    e = lane % (hc * hc)
    logit = mix(2 * hc + e) * r * mScale[2] + mBase[2 * hc + e]
    ex = _exp(logit - ptx.lane_max(logit, 0, bits))               # softmax of the row, + eps
    c = ex * (Float32(1.0) / ptx.lane_sum(ex, 0, bits)) + eps
    c = c * (Float32(1.0) / (ptx.lane_sum(c, bits, bits) + eps))  # the first column normalisation
    for _ in range(op.iters - 1):
        c = c * (Float32(1.0) / (ptx.lane_sum(c, 0, bits) + eps))
        c = c * (Float32(1.0) / (ptx.lane_sum(c, bits, bits) + eps))
    i = lane % hc
    pre = _sigmoid(mix(i) * r * mScale[0] + mBase[i]) + eps
    post = Float32(2.0) * _sigmoid(mix(hc + i) * r * mScale[1] + mBase[hc + i])
    return c, pre, post


class Sm90HcPre:
    """The whole ``hc_pre`` of a token but the product by ``fn``: one CTA per token sums the squares of its
    streams, scales the raw products ``x @ fn.T`` by the RMS norm's reciprocal (the norm is one scalar per token, so
    it commutes with the product), runs the weights' chain (the first warp, a lane per comb entry) and collapses the
    streams with ``pre``. Replaces the norm's and the collapse's seven torch launches.

    Operands: ``x`` f32 [N, hc*H] (each token's streams, contiguous, 16-byte aligned, H a multiple of 4), ``mm``
    f32 [N, (2+hc)*hc], ``base`` f32 [(2+hc)*hc], ``scale`` f32 [3], ``out`` f32 [N, H], ``pre`` f32 [N, hc],
    ``post`` f32 [N, hc], ``comb`` f32 [N, hc*hc], ``weight`` f32 [H].

    With ``norm`` the sublayer's RMSNorm follows in the same launch: ``out = c * rsqrt(mean(c^2) + norm_eps) *
    weight`` for the collapse ``c``, which the CTA keeps in registers (H at most ``NORM_MAX_HIDDEN``); without it
    ``weight`` is not read.
    """

    @staticmethod
    def can_implement(hc: int, hidden: int, norm: bool = False) -> bool:
        """Whether the kernel takes ``hc`` streams (a lane per comb entry) of ``hidden`` (16-byte loads) per token,
        and with ``norm`` the collapse in registers (``NORM_MAX_HIDDEN``)."""
        return hc in HC_SIZES and hidden % 4 == 0 and (not norm or hidden <= NORM_MAX_HIDDEN)

    def __init__(self, *, hc: int, iters: int, hc_eps: float, norm_eps: float, norm: bool = False):
        if hc not in HC_SIZES or iters < 1:
            raise ValueError(f"hc must be one of {HC_SIZES} and iters >= 1, got hc={hc}, iters={iters}")
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, float(hc_eps), float(norm_eps)
        self.norm = norm
        self.threads = PRE_THREADS

    def key(self) -> tuple:
        return (self.hc, self.iters, self.eps, self.norm_eps, self.norm)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mMM: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor,
                 mOut: cute.Tensor, mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mWeight: cute.Tensor,
                 stream):
        self.kernel(mX, mMM, mBase, mScale, mOut, mPre, mPost, mComb, mWeight).launch(
            grid=[mX.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mMM: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor,
               mOut: cute.Tensor, mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mWeight: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        hc = self.hc
        n_warps = PRE_THREADS // 32
        width = mX.shape[1]
        h = mOut.shape[1]
        smem = cutlass.memory.SmemAllocator()
        sb = smem.allocate_array(Float32, n_warps + max(HC_SIZES), byte_alignment=16).toint()
        s_pre = sb + n_warps * 4
        x_row = mX.iterator.toint() + Int64(t) * Int64(width) * 4
        # 1. the sum of squares of the token's hc * H values, 16 bytes a load (all of a thread's loads in flight)
        ss = Float32(0.0)
        for c in cutlass.range(tidx, width // 4, PRE_THREADS, unroll=4):
            v = ptx.ld_global_v4_f32(x_row + Int64(c) * 16)
            ss = ss + v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]
        ss = ptx.lane_sum(ss)
        if tidx % 32 == 0:
            ptx.st_shared_f32(sb + (tidx // 32) * 4, ss)
        cute.arch.sync_threads()
        # 2. the first warp: the mixes (raw products over the RMS), the weights, pre into shared memory
        if tidx < 32:
            total = ptx.shared_sum_f32(sb, n_warps)
            c, pre, post = _weights(self, functools.partial(_row_entry, mMM, t), mBase, mScale, tidx,
                                    cute.math.rsqrt(total / Float32(width) + Float32(self.norm_eps)))
            if tidx < hc * hc:
                mComb[t, tidx] = c
            if tidx < hc:
                mPre[t, tidx] = pre
                mPost[t, tidx] = post
                ptx.st_shared_f32(s_pre + tidx * 4, pre)
        cute.arch.sync_threads()
        # 3. the collapse: out = sum_i pre_i x_i
        pre = cute.make_rmem_tensor((hc,), Float32)
        for i in cutlass.range_constexpr(hc):
            pre[i] = ptx.ld_shared_f32(s_pre + i * 4)
        out_row = mOut.iterator.toint() + Int64(t) * Int64(h) * 4
        if const_expr(not self.norm):
            for c in cutlass.range(tidx, h // 4, PRE_THREADS, unroll=1):
                acc = self.collapse(x_row, h, c, pre)
                ptx.st_global_v2_f32(out_row + Int64(c) * 16, acc[0], acc[1])
                ptx.st_global_v2_f32(out_row + Int64(c) * 16 + 8, acc[2], acc[3])
        else:
            # 4. the RMSNorm of the collapse: its values stay in registers (NORM_CHUNKS 16-byte pieces a thread)
            vals = cute.make_rmem_tensor((NORM_CHUNKS * 4,), Float32)
            sq = Float32(0.0)
            for j in cutlass.range_constexpr(NORM_CHUNKS):
                c = tidx + j * PRE_THREADS
                for e in cutlass.range_constexpr(4):
                    vals[j * 4 + e] = Float32(0.0)
                if c < h // 4:
                    acc = self.collapse(x_row, h, c, pre)
                    for e in cutlass.range_constexpr(4):
                        vals[j * 4 + e] = acc[e]
                        sq = sq + acc[e] * acc[e]
            sq = ptx.lane_sum(sq)
            # the per-warp sums reuse step 1's slots: the first warp read those before the barrier after step 2
            if tidx % 32 == 0:
                ptx.st_shared_f32(sb + (tidx // 32) * 4, sq)
            cute.arch.sync_threads()
            total = ptx.shared_sum_f32(sb, n_warps)
            r = cute.math.rsqrt(total / Float32(h) + Float32(self.norm_eps))
            for j in cutlass.range_constexpr(NORM_CHUNKS):
                c = tidx + j * PRE_THREADS
                if c < h // 4:
                    wv = ptx.ld_global_v4_f32(mWeight.iterator.toint() + Int64(c) * 16)
                    ptx.st_global_v2_f32(out_row + Int64(c) * 16, vals[j * 4] * r * wv[0], vals[j * 4 + 1] * r * wv[1])
                    ptx.st_global_v2_f32(out_row + Int64(c) * 16 + 8, vals[j * 4 + 2] * r * wv[2],
                                         vals[j * 4 + 3] * r * wv[3])

    @cute.jit
    def collapse(self, x_row: Int64, h: Int32, c: Int32, pre: cute.Tensor) -> cute.Tensor:
        """``sum_i pre_i x_i`` of the token's 16-byte piece ``c`` (4 values)."""
        v = ptx.ld_global_v4_f32(x_row + Int64(c) * 16)
        acc = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            acc[e] = pre[0] * v[e]
        for i in cutlass.range_constexpr(1, self.hc):
            v = ptx.ld_global_v4_f32(x_row + (Int64(i) * Int64(h) + Int64(c) * 4) * 4)
            for e in cutlass.range_constexpr(4):
                acc[e] = acc[e] + pre[i] * v[e]
        return acc


def _shared_entry(s_mix: Int32, i) -> Float32:
    """Entry ``i`` of a token's products ``x @ fn.T`` (``Sm90HcPreFused``: the cluster's totals, in shared memory)."""
    return ptx.ld_shared_f32(s_mix + i * 4)


def _why_fused(config: HcPreFusedConfig) -> str:
    return (f"hc_pre with its product {config}: needs hc in {HC_SIZES}, iters >= 1, a cluster of {FUSED_CLUSTERS} "
            f"CTAs that cuts H into 16-byte pieces, and at most {FUSED_MAX_THREADS} threads a CTA (one piece each)")


class Sm90HcPreFused:
    """The whole ``hc_pre`` of a token, its product by ``fn`` too (:class:`Sm90HcPre` takes that from cuBLAS: two
    launches and about 4 us at one token on an H200, before its own 7 us), one
    :class:`~nvfp4_megamoe.kernels.sm90_config.HcPreFusedConfig`.

    A token is a cluster of ``cluster`` CTAs along the grid's x (CTA ``t * cluster + r`` is rank ``r`` of token
    ``t``). Rank ``r`` owns columns ``[r * S, (r + 1) * S)``, ``S = H / cluster``, of every stream, and its thread
    ``k = i * S / 4 + j`` the 16-byte piece ``j`` of stream ``i`` of them (one piece a thread, the threads' pieces in
    the order of the token's flat streams):

    1. each thread loads its piece of x (kept in shared memory for the collapse) and the 24 matching pieces of
       ``fn``'s rows, all in flight together, and sums its squares and its 24 dot products;
    2. a butterfly per warp, the warps' sums in warp order: the CTA's 25 partials; each CTA stores its partials into
       every peer's shared memory (``mapa`` + ``st.shared::cluster``), a cluster barrier, and every CTA adds the
       ``cluster`` partials in rank order, so that every CTA holds the same 25 floats;
    3. the first warp of every CTA runs the weights' chain (:func:`_weights`) on them. Every CTA runs it rather than
       rank 0 broadcasting ``pre``: the chain is on every CTA's path either way, and a broadcast would add a cluster
       barrier (and its round trip) after it; the same floats in, the same instructions, the same ``pre`` out in
       every CTA. Rank 0 writes ``pre``, ``post`` and ``comb``;
    4. thread ``j < S / 4`` collapses piece ``j`` of its columns, ``sum_i pre_i x_i`` in stream order as
       :meth:`Sm90HcPre.collapse`; with ``norm`` the sum of squares of the sublayer input goes round the cluster as
       in step 2 (one float a CTA) before the RMSNorm, the input stays in registers meanwhile; each CTA writes its
       columns.

    Barriers, as ``sm90_compressor``'s: a cluster arrive at the start and a wait before the first remote store (a
    peer's shared memory exists once the peer has started), then an arrive (release) and a wait (acquire) after each
    round of remote stores. Each round writes its own buffer, written once, and no remote access follows the last
    wait, so a CTA may exit while its peers finish. Numerics: the reference's formulas in float32 as
    :class:`Sm90HcPre`, with the sums of the products and of the squares in another order than cuBLAS's.

    Operands: ``x`` f32 [N, hc*H] (each token's streams, contiguous, 16-byte aligned), ``fn`` f32 [(2+hc)*hc, hc*H]
    (contiguous, 16-byte aligned), ``base`` f32 [(2+hc)*hc], ``scale`` f32 [3], ``out`` f32 [N, H], ``pre`` f32
    [N, hc], ``post`` f32 [N, hc], ``comb`` f32 [N, hc*hc], ``weight`` f32 [H] (read only with ``norm``).
    """

    def __init__(self, config: HcPreFusedConfig):
        _expect(self.can_implement(config), _why_fused(config))
        self.config = config
        self.hc, self.iters, self.eps, self.norm_eps = config.hc, config.iters, config.hc_eps, config.norm_eps
        self.norm, self.cluster, self.threads = config.norm, config.cluster, config.threads

    @staticmethod
    def can_implement(config: HcPreFusedConfig) -> bool:
        """Whether the cluster cuts each stream into whole 16-byte pieces, a CTA's pieces fit one a thread, and the
        comb fits one warp (``hc`` in ``HC_SIZES``)."""
        return (config.hc in HC_SIZES and config.iters >= 1 and config.cluster in FUSED_CLUSTERS
                and config.hidden > 0 and config.hidden % (4 * config.cluster) == 0
                and config.threads <= FUSED_MAX_THREADS)

    def key(self) -> tuple:
        return (self.config,)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mFn: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor,
                 mOut: cute.Tensor, mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mWeight: cute.Tensor,
                 stream):
        grid = [mX.shape[0] * self.cluster, 1, 1]   # x: token t's CTAs are t * cluster .. (one cluster)
        if const_expr(self.cluster > 1):
            self.kernel(mX, mFn, mBase, mScale, mOut, mPre, mPost, mComb, mWeight).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1], stream=stream)
        else:
            self.kernel(mX, mFn, mBase, mScale, mOut, mPre, mPost, mComb, mWeight).launch(
                grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor,
               mOut: cute.Tensor, mPre: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mWeight: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        n_cta, hc, h = self.cluster, self.hc, self.config.hidden
        if const_expr(n_cta > 1):
            cute.arch.cluster_arrive_relaxed()   # started: peers may store into this CTA's shared memory (step 2)
        rank = bx % n_cta   # a 1-D cluster of consecutive CTAs: the rank in the cluster
        t = bx // n_cta
        m = (2 + hc) * hc
        parts = m + 1                 # the 24 products and the sum of squares (V4)
        cols = self.config.columns    # S
        pieces = cols // 4            # 16-byte pieces of one stream's columns
        chunks = self.config.chunks   # ... of all the streams': one a thread
        n_warps = self.threads // 32
        h_warps = -(-pieces // 32)    # the warps that hold a piece of the sublayer input
        smem = cutlass.memory.SmemAllocator()
        s_x = smem.allocate_array(Float32, chunks * 4, byte_alignment=16).toint()
        s_warp = smem.allocate_array(Float32, n_warps * parts, byte_alignment=16).toint()
        s_part = smem.allocate_array(Float32, n_cta * parts, byte_alignment=16).toint()   # [rank][part]
        s_mix = smem.allocate_array(Float32, parts, byte_alignment=16).toint()
        s_pre = smem.allocate_array(Float32, max(HC_SIZES), byte_alignment=16).toint()
        s_hw = smem.allocate_array(Float32, n_warps, byte_alignment=16).toint()
        s_hss = smem.allocate_array(Float32, n_cta, byte_alignment=16).toint()
        lane, warp = tid % 32, tid // 32

        # 1. this thread's piece of x and the 24 pieces of fn that multiply it (all loads before any use)
        col = (tid // pieces) * h + rank * cols + (tid % pieces) * 4   # its first column in the token's flat row
        x_row = mX.iterator.toint() + Int64(t) * Int64(hc * h) * 4
        fn_at = mFn.iterator.toint() + Int64(col) * 4
        acc = cute.make_rmem_tensor((parts,), Float32)
        for p in cutlass.range_constexpr(parts):
            acc[p] = Float32(0.0)
        if tid < chunks:
            xv = ptx.ld_global_v4_f32(x_row + Int64(col) * 4)
            fv = [ptx.ld_global_v4_f32(fn_at + Int64(p * hc * h) * 4) for p in range(m)]
            ptx.st_shared_v4_f32(s_x + tid * 16, xv[0], xv[1], xv[2], xv[3])
            for p in cutlass.range_constexpr(m):
                acc[p] = fv[p][0] * xv[0] + fv[p][1] * xv[1] + fv[p][2] * xv[2] + fv[p][3] * xv[3]
            acc[m] = xv[0] * xv[0] + xv[1] * xv[1] + xv[2] * xv[2] + xv[3] * xv[3]

        # 2. the CTA's partials (warps in warp order), into every CTA of the cluster, added in rank order
        for p in cutlass.range_constexpr(parts):
            acc[p] = ptx.lane_sum(acc[p])
        if lane == 0:
            for p in cutlass.range_constexpr(parts):
                ptx.st_shared_f32(s_warp + (warp * parts + p) * 4, acc[p])
        cute.arch.sync_threads()
        part = Float32(0.0)
        if tid < parts:
            part = ptx.ld_shared_f32(s_warp + tid * 4)
            for w in cutlass.range_constexpr(1, n_warps):
                part = part + ptx.ld_shared_f32(s_warp + (w * parts + tid) * 4)
        if const_expr(n_cta > 1):
            cute.arch.cluster_wait()       # every peer has started (its arrive at the top): its shared memory is live
            if tid < parts:
                for q in cutlass.range_constexpr(n_cta):
                    ptx.st_cluster_f32(ptx.mapa(s_part + (rank * parts + tid) * 4, q), part)
            cute.arch.cluster_arrive()     # release: this CTA's stores into its peers ...
            cute.arch.cluster_wait()       # ... acquire: every peer's stores into this CTA's s_part
        else:
            if tid < parts:
                ptx.st_shared_f32(s_part + tid * 4, part)
            cute.arch.sync_threads()

        # 3. the first warp: the totals (rank order), the weights' chain, pre into shared memory; rank 0's outputs
        if tid < 32:
            if tid < parts:
                total = ptx.ld_shared_f32(s_part + tid * 4)
                for q in cutlass.range_constexpr(1, n_cta):
                    total = total + ptx.ld_shared_f32(s_part + (q * parts + tid) * 4)
                ptx.st_shared_f32(s_mix + tid * 4, total)
            cute.arch.sync_warp()
            r = cute.math.rsqrt(ptx.ld_shared_f32(s_mix + m * 4) / Float32(hc * h) + Float32(self.norm_eps))
            c, pre, post = _weights(self, functools.partial(_shared_entry, s_mix), mBase, mScale, tid, r)
            if tid < hc:
                ptx.st_shared_f32(s_pre + tid * 4, pre)
            if rank == 0:
                if tid < hc * hc:
                    mComb[t, tid] = c
                if tid < hc:
                    mPre[t, tid] = pre
                    mPost[t, tid] = post
        cute.arch.sync_threads()

        # 4. the collapse of piece tid of this CTA's columns (stream order, as Sm90HcPre.collapse), then the norm
        pre_r = cute.make_rmem_tensor((hc,), Float32)
        for i in cutlass.range_constexpr(hc):
            pre_r[i] = ptx.ld_shared_f32(s_pre + i * 4)
        y = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            y[e] = Float32(0.0)
        if tid < pieces:
            v = ptx.ld_shared_v4_f32(s_x + tid * 16)
            for e in cutlass.range_constexpr(4):
                y[e] = pre_r[0] * v[e]
            for i in cutlass.range_constexpr(1, hc):
                v = ptx.ld_shared_v4_f32(s_x + (i * pieces + tid) * 16)
                for e in cutlass.range_constexpr(4):
                    y[e] = y[e] + pre_r[i] * v[e]
        out_at = mOut.iterator.toint() + (Int64(t) * Int64(h) + Int64(rank * cols + tid * 4)) * 4
        if const_expr(not self.norm):
            if tid < pieces:
                ptx.st_global_v2_f32(out_at, y[0], y[1])
                ptx.st_global_v2_f32(out_at + 8, y[2], y[3])
        else:
            wv = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                wv[e] = Float32(0.0)
            if tid < pieces:   # the weight's load before the barriers
                w4 = ptx.ld_global_v4_f32(mWeight.iterator.toint() + Int64(rank * cols + tid * 4) * 4)
                for e in cutlass.range_constexpr(4):
                    wv[e] = w4[e]
            sq = ptx.lane_sum(y[0] * y[0] + y[1] * y[1] + y[2] * y[2] + y[3] * y[3])
            if lane == 0:
                ptx.st_shared_f32(s_hw + warp * 4, sq)
            cute.arch.sync_threads()
            total = ptx.shared_sum_f32(s_hw, h_warps)
            if const_expr(n_cta > 1):
                if tid < n_cta:
                    ptx.st_cluster_f32(ptx.mapa(s_hss + rank * 4, tid), total)
                cute.arch.cluster_arrive()   # release, then acquire: every CTA's sum of squares in every s_hss
                cute.arch.cluster_wait()
                total = ptx.shared_sum_f32(s_hss, n_cta)
            rs = cute.math.rsqrt(total / Float32(h) + Float32(self.norm_eps))
            if tid < pieces:
                ptx.st_global_v2_f32(out_at, y[0] * rs * wv[0], y[1] * rs * wv[1])
                ptx.st_global_v2_f32(out_at + 8, y[2] * rs * wv[2], y[3] * rs * wv[3])


class Sm90HcPost:
    """The mHC after a sublayer (``mhc_reference.hc_post``): one CTA per token writes its new streams
    ``y_j = post_j out + sum_i comb_ij x_i``, 16 bytes of each stream a load, in one launch instead of the
    reference's three (the product by ``post``, the comb's [hc, hc] by [hc, H] product, their sum) and the cast of
    ``out`` to float32.

    Operands: ``out`` BF16 or f32 [N, H] (the sublayer's output), ``x`` f32 [N, hc*H] (the streams, contiguous,
    16-byte aligned, H a multiple of 4), ``post`` f32 [N, hc], ``comb`` f32 [N, hc*hc], ``y`` f32 [N, hc*H].
    """

    @staticmethod
    def can_implement(hc: int, hidden: int) -> bool:
        """Whether the kernel takes ``hc`` streams (it unrolls them) of ``hidden`` (16-byte loads) per token."""
        return hc in HC_SIZES and hidden % 4 == 0

    def __init__(self, *, hc: int):
        if hc not in HC_SIZES:
            raise ValueError(f"hc must be one of {HC_SIZES}, got hc={hc}")
        self.hc = hc
        self.threads = PRE_THREADS

    def key(self) -> tuple:
        return (self.hc,)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mX: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mY: cute.Tensor,
                 stream):
        self.kernel(mO, mX, mPost, mComb, mY).launch(grid=[mX.shape[0], 1, 1], block=[self.threads, 1, 1],
                                                     stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mX: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        hc = self.hc
        h = mO.shape[1]
        post = cute.make_rmem_tensor((hc,), Float32)
        comb = cute.make_rmem_tensor((hc * hc,), Float32)
        for i in cutlass.range_constexpr(hc):
            post[i] = mPost[t, i]
        for i in cutlass.range_constexpr(hc * hc):
            comb[i] = mComb[t, i]
        x_row = mX.iterator.toint() + Int64(t) * Int64(hc) * Int64(h) * 4
        y_row = mY.iterator.toint() + Int64(t) * Int64(hc) * Int64(h) * 4
        for c in cutlass.range(tidx, h // 4, PRE_THREADS, unroll=1):
            xs = cute.make_rmem_tensor((hc * 4,), Float32)
            for i in cutlass.range_constexpr(hc):
                v = ptx.ld_global_v4_f32(x_row + (Int64(i) * Int64(h) + Int64(c) * 4) * 4)
                for e in cutlass.range_constexpr(4):
                    xs[i * 4 + e] = v[e]
            o = cute.make_rmem_tensor((4,), Float32)
            for e in cutlass.range_constexpr(4):
                o[e] = mO[t, c * 4 + e].to(Float32)
            for j in cutlass.range_constexpr(hc):
                acc = cute.make_rmem_tensor((4,), Float32)
                for e in cutlass.range_constexpr(4):
                    acc[e] = post[j] * o[e]
                    for i in cutlass.range_constexpr(hc):
                        acc[e] = acc[e] + comb[i * hc + j] * xs[i * 4 + e]
                at = y_row + (Int64(j) * Int64(h) + Int64(c) * 4) * 4
                ptx.st_global_v2_f32(at, acc[0], acc[1])
                ptx.st_global_v2_f32(at + 8, acc[2], acc[3])


def _hc_pre_operands(x: torch.Tensor, fn: torch.Tensor, norm_weight: torch.Tensor | None
                     ) -> tuple[list[int], int, int, torch.Tensor]:
    """The hc_pre hosts' checks of x [..., hc, H], fn and the norm's weight, and x as the float32 rows [N, hc * H] the
    kernels load 16 bytes at a time; -> (lead dims, hc, H, rows)."""
    *lead, hc, h = x.shape
    m = (2 + hc) * hc
    _expect(x.is_cuda and tuple(fn.shape) == (m, hc * h), f"x must be CUDA [..., hc, H] and fn [(2+hc)*hc = {m}, "
            f"hc*H], got x {tuple(x.shape)}, fn {tuple(fn.shape)}")
    if norm_weight is not None:
        _expect(tuple(norm_weight.shape) == (h,), f"norm_weight must be [{h}], got {tuple(norm_weight.shape)}")
    flat = x.float().reshape(-1, hc * h).contiguous()   # a copy only of the embedding's broadcast streams
    if flat.data_ptr() % 16:                             # a view at an odd offset: the kernel loads 16 bytes
        flat = flat.clone()
    return lead, hc, h, flat


def _hc_pre_outputs(n: int, hc: int, h: int, device) -> tuple[torch.Tensor, ...]:
    """The hc_pre kernels' float32 outputs for N tokens: the sublayer input [N, H], pre and post [N, hc], comb
    [N, hc * hc]."""
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(n, h, **f32), torch.empty(n, hc, **f32), torch.empty(n, hc, **f32),
            torch.empty(n, hc * hc, **f32))


def sm90_hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
                hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_reference.hc_pre`` on the GPU: streams x [..., hc, H] -> (sublayer input [..., H], post [..., hc], comb
    [..., hc, hc]), all float32: the product by ``fn`` (cuBLAS), then one launch. With ``norm_weight`` [H] the
    sublayer input comes RMS-normalised (eps ``norm_eps``) and scaled by it, in the same launch."""
    lead, hc, h, flat = _hc_pre_operands(x, fn, norm_weight)
    norm, n = norm_weight is not None, flat.shape[0]
    _expect(Sm90HcPre.can_implement(hc, h, norm), f"x must have {HC_SIZES} streams of a width divisible by 4 (at "
            f"most {NORM_MAX_HIDDEN} with the norm), got {tuple(x.shape)}")
    mm = flat @ fn.float().T
    out, pre, post, comb = _hc_pre_outputs(n, hc, h, x.device)
    if n:
        # the reference runs the first column normalisation whatever ``iters``: 0 rounds of Sinkhorn after it == 1
        scale32 = scale.float().contiguous()
        weight = norm_weight.float().contiguous() if norm else scale32   # not read without the norm
        _launch(Sm90HcPre(hc=hc, iters=max(iters, 1), hc_eps=hc_eps, norm_eps=norm_eps, norm=norm),
                [flat, mm, base.float().contiguous(), scale32, out, pre, post, comb, weight])
    return out.view(*lead, h), post.view(*lead, hc), comb.view(*lead, hc, hc)


def warmup(hc: int, iters: int, hc_eps: float, norm_eps: float, device) -> int:
    """Compile the kernels :func:`sm90_hc_pre` (with and without the sublayer's norm) and :func:`sm90_hc_post` (the
    sublayer's output in BF16 or float32) launch for these settings; returns their count."""
    m = (2 + hc) * hc
    f32 = dict(dtype=torch.float32, device=device)
    for norm in (False, True):
        _compile(Sm90HcPre(hc=hc, iters=max(iters, 1), hc_eps=hc_eps, norm_eps=norm_eps, norm=norm),
                 [torch.empty(1, hc * 16, **f32), torch.empty(1, m, **f32), torch.empty(m, **f32),
                  torch.empty(3, **f32), torch.empty(1, 16, **f32), torch.empty(1, hc, **f32),
                  torch.empty(1, hc, **f32), torch.empty(1, hc * hc, **f32), torch.empty(16, **f32)])
    for dtype in (torch.bfloat16, torch.float32):
        _compile(Sm90HcPost(hc=hc), [torch.empty(1, 16, dtype=dtype, device=device), torch.empty(1, hc * 16, **f32),
                                     torch.empty(1, hc, **f32), torch.empty(1, hc * hc, **f32),
                                     torch.empty(1, hc * 16, **f32)])
    return 4


def sm90_hc_pre_fused(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
                      hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None,
                      cluster: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sm90_hc_pre` in one launch, the product by ``fn`` too (:class:`Sm90HcPreFused`): the same operands and
    outputs. ``cluster`` fixes the CTAs of a token (the benchmark's sweep); by default
    ``sm90_heuristics.hc_pre_fused_config`` picks them from the token count."""
    lead, hc, h, flat = _hc_pre_operands(x, fn, norm_weight)
    norm, n = norm_weight is not None, flat.shape[0]
    config = hc_pre_fused_config(hc, h, n, iters=max(iters, 1), hc_eps=hc_eps, norm_eps=norm_eps, norm=norm)
    if cluster is not None:
        config = replace(config, cluster=cluster)
    _expect(Sm90HcPreFused.can_implement(config), _why_fused(config))
    fn32 = fn.float().contiguous()
    if fn32.data_ptr() % 16:
        fn32 = fn32.clone()
    out, pre, post, comb = _hc_pre_outputs(n, hc, h, x.device)
    if n:
        scale32 = scale.float().contiguous()
        weight = norm_weight.float().contiguous() if norm else scale32   # not read without the norm
        _launch(Sm90HcPreFused(config), [flat, fn32, base.float().contiguous(), scale32, out, pre, post, comb, weight])
    return out.view(*lead, h), post.view(*lead, hc), comb.view(*lead, hc, hc)


def fused_operands(config: HcPreFusedConfig, device) -> list[torch.Tensor]:
    """Operands of one token of this configuration as :func:`sm90_hc_pre_fused` passes them (dtypes, ranks, 16-byte
    aligned): what a compile is specialised on."""
    hc, h = config.hc, config.hidden
    m = (2 + hc) * hc
    f32 = dict(dtype=torch.float32, device=device)
    return [torch.empty(1, hc * h, **f32), torch.empty(m, hc * h, **f32), torch.empty(m, **f32),
            torch.empty(3, **f32), torch.empty(1, h, **f32), torch.empty(1, hc, **f32), torch.empty(1, hc, **f32),
            torch.empty(1, hc * hc, **f32), torch.empty(h, **f32)]


def warmup_fused(hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float, device,
                 token_counts: tuple[int, ...] = (1, 1 << 16)) -> int:
    """Compile the kernels :func:`sm90_hc_pre_fused` launches for these settings (with and without the sublayer's
    norm) at each of ``token_counts`` (by default one token and many: the clusters its heuristic picks for a
    decode step and for a long call); returns their count."""
    configs = dict.fromkeys(hc_pre_fused_config(hc, hidden, n, iters=max(iters, 1), hc_eps=hc_eps, norm_eps=norm_eps,
                                                norm=norm) for n in token_counts for norm in (False, True))
    for config in configs:
        _compile(Sm90HcPreFused(config), fused_operands(config, device))
    return len(configs)


def sm90_hc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``mhc_reference.hc_post`` on the GPU: sublayer output [..., H] (BF16 or f32), streams x [..., hc, H], post
    [..., hc], comb [..., hc, hc] -> new streams f32 [..., hc, H], in one launch."""
    *lead, hc, h = x.shape
    _expect(x.is_cuda and Sm90HcPost.can_implement(hc, h) and tuple(out.shape) == (*lead, h)
            and out.dtype in (torch.bfloat16, torch.float32),
            f"x must be CUDA [..., hc in {HC_SIZES}, H % 4 == 0] and out BF16 or f32 [..., H], got x "
            f"{tuple(x.shape)}, out {tuple(out.shape)} {out.dtype}")
    flat = x.float().reshape(-1, hc * h).contiguous()   # a copy only of the embedding's broadcast streams
    if flat.data_ptr() % 16:
        flat = flat.clone()
    n = flat.shape[0]
    y = torch.empty(n, hc * h, dtype=torch.float32, device=x.device)
    if n:
        _launch(Sm90HcPost(hc=hc), [out.reshape(n, h).contiguous(), flat, post.float().reshape(n, hc).contiguous(),
                                    comb.float().reshape(n, hc * hc).contiguous(), y])
    return y.view(*lead, hc, h)
