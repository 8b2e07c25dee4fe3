"""SM90 (sm_90a) decode attention of DeepSeek-V4: SWA ring + gathered compressed entries + sink, one softmax.

Contract: ``decode_attention_reference`` (``kernels/decode_attention_reference.py``); the host entry
point is :func:`decode_attention`. MQA: one 512-dim BF16 vector per entry is both K and V for all
heads, so the **heads are the MMA M dimension** (64 per CTA) and every KV byte is read from HBM once
per 64 heads (the second head block of a 128-head model reads it again, mostly from L2).

Work split (flash-decoding). A request's entries form one virtual list: window slots ``0..W-1``
then ``indices[b, 0..K-1]`` (or ``0..N-1`` for HCA), cut into chunks of 64 entries. The grid is
``(splits, H / 64, B)``; split ``s`` walks chunks ``[s*cps, (s+1)*cps)`` with ``cps =
ceil(chunks / splits)``. With one split the CTA normalises (sink included) and writes BF16 ``out``;
otherwise it writes its unnormalised float32 ``O`` and ``(m, l)`` and a second kernel
(:class:`Sm90DecodeAttentionCombine`) merges the splits and adds the sink.

CTA (8 warps, 256 threads, one per SM: 201.5 KB of shared memory):
* ``cp.async`` gathers: Q block [64 x 512] once, then KV chunks [64 x 512] into two buffers (the next
  chunk is in flight while one is computed); invalid entries (slot >= window_len, index -1) are
  zero-filled (no HBM read) and get a -inf logit bias. Rows are 1024 B; 16-byte column ``j`` of row
  ``r`` sits at ``j ^ (r % 8)`` (XOR swizzle: ``ldmatrix`` reads conflict-free).
* S = Q K^T: warp ``w`` owns heads ``16 (w % 4) ..+16`` and entries ``32 (w // 4) ..+32``
  (``mma.sync.m16n8k16``, A = Q and B = K both by ``ldmatrix`` from the row-major buffers).
  Logits are in log2 units (``scale * log2 e``). The two warps sharing a head tile exchange their row
  maxima through shared memory, so both hold the same running max ``m`` and each keeps a partial
  row sum ``l`` over its own entries (summed once at the end).
* P (BF16, [64 x 64], shared) @ V: warp ``w`` owns heads ``16 (w % 4)`` and dims ``256 (w // 4) ..+256``
  (128 float32 accumulators per thread); V fragments by ``ldmatrix.trans`` from the same KV buffer.
The running max starts at -1e30 rather than -inf, so fully masked chunks or splits need no branch
(every exp2 of a masked logit is exactly 0).
"""

from __future__ import annotations

import math
from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_attention_ptx as ptx

HEAD_DIM = 512
HEADS_PER_CTA = 64
CHUNK = 64
THREADS = 256
ROW = HEAD_DIM * 2                     # bytes per KV / Q row
Q_BYTES = HEADS_PER_CTA * ROW          # 64 KB
KV_BYTES = CHUNK * ROW                 # 64 KB per buffer
P_ROW = CHUNK * 2                      # 128 B per P row
OFF_Q = 0
OFF_KV = OFF_Q + Q_BYTES
OFF_P = OFF_KV + 2 * KV_BYTES
OFF_BIAS = OFF_P + HEADS_PER_CTA * P_ROW
OFF_MAX = OFF_BIAS + 2 * CHUNK * 4
OFF_L = OFF_MAX + 2 * HEADS_PER_CTA * 4
SMEM_BYTES = OFF_L + 2 * HEADS_PER_CTA * 4
LOG2E = 1.4426950408889634
NEG_BIG = -1.0e30
MODES = ("window", "indexed", "dense")


class Sm90DecodeAttention:
    """One compiled configuration of the split kernel.

    Args:
        mode: ``"window"`` (no compressed entries), ``"indexed"`` (CSA: ``indices`` [B, K], -1 pads)
            or ``"dense"`` (HCA: all N entries of ``kv_compressed``).
        scale: logit scale (512**-0.5 in V4), folded into the kernel with log2(e).

    Operands (all contiguous): ``q`` bf16 [B, H, 512], ``kv_window`` bf16 [B, W, 512], ``window_len``
    int32 [B], ``kv_compressed`` bf16 [B, N, 512], ``indices`` int32 [B, K], ``sink`` f32 [H],
    ``out`` bf16 [B, H, 512], ``o_part`` f32 [B, H, S, 512], ``ml`` f32 [B, H, S, 2] (S = splits,
    the grid's x; with S = 1 ``o_part`` is not touched). In ``"window"`` mode the compressed operands
    are placeholders (any tensors of those dtypes and ranks).
    """

    def __init__(self, *, mode: str, scale: float):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.scale = float(scale)
        self.sl2 = float(scale) * LOG2E

    def key(self) -> tuple:
        return (self.mode, self.scale)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWlen: cute.Tensor, mKvc: cute.Tensor,
                 mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
                 mML: cute.Tensor, stream):
        self.kernel(mQ, mKvw, mWlen, mKvc, mIdx, mSink, mOut, mOpart, mML).launch(
            grid=[mML.shape[2], mQ.shape[1] // HEADS_PER_CTA, mQ.shape[0]], block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWlen: cute.Tensor, mKvc: cute.Tensor,
               mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
               mML: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        split, hb, b = cute.arch.block_idx()
        n_splits = mML.shape[2]
        n_heads = mQ.shape[1]
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        ht = warp % 4
        half = warp // 4
        x = lane % 8                           # the swizzle key of every row an ldmatrix lane addresses

        W = mKvw.shape[1]
        K = Int32(0)
        N = Int32(1)
        if const_expr(self.mode == "indexed"):
            K = mIdx.shape[1]
            N = mKvc.shape[1]
        if const_expr(self.mode == "dense"):
            K = mKvc.shape[1]
            N = mKvc.shape[1]
        n_entries = W + K
        n_chunks = (n_entries + CHUNK - 1) // CHUNK
        cps = (n_chunks + n_splits - 1) // n_splits
        c_begin = split * cps
        c_end = c_begin + cps
        if c_end > n_chunks:
            c_end = n_chunks
        n_mine = c_end - c_begin
        if n_mine < 0:
            n_mine = Int32(0)

        smem = cutlass.memory.SmemAllocator()
        sbase = smem.allocate_array(cutlass.Int8, SMEM_BYTES, byte_alignment=1024).toint()
        wlen = mWlen[b]

        # ---- prologue: Q block and the first two chunks ----
        r = tidx // 4
        sub = tidx % 4
        q_src = mQ.iterator.toint() + (Int64(b) * n_heads + Int64(hb * HEADS_PER_CTA + r)) * ROW
        q_dst = sbase + OFF_Q + r * ROW
        for i in cutlass.range_constexpr(16):
            seg = sub + 4 * i
            ptx.cp_async_16(q_dst + ((seg ^ (r % 8)) << 4), q_src + Int64(seg * 16), Int32(16))
        if n_mine > 0:
            self.load_chunk(mKvw, mKvc, mIdx, sbase, b, wlen, W, K, N, c_begin, Int32(0), r, sub)
        cute.arch.cp_async_commit_group()
        if n_mine > 1:
            self.load_chunk(mKvw, mKvc, mIdx, sbase, b, wlen, W, K, N, c_begin + 1, Int32(1), r, sub)
        cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor((32, 4), Float32)
        acc.fill(0.0)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            m_run[i] = Float32(NEG_BIG)
            l_run[i] = Float32(0.0)

        qa_row = ht * 16 + x + 8 * ((lane // 8) % 2)        # A rows (Q and P): heads
        hi16 = lane // 16
        q_row_addr = sbase + OFF_Q + qa_row * ROW
        p_row_addr = sbase + OFF_P + qa_row * P_ROW
        kb_row = half * 32 + x + 8 * hi16                     # B rows of S: entries (+16 per n-tile pair)
        kb_y = ((lane // 8) % 2) ^ x
        ka_y = hi16 ^ x
        v_row = x + 8 * ((lane // 8) % 2)                     # B rows of PV: entries (+16 per k-step)
        h_row0 = ht * 16 + g                                  # accumulator rows h_row0 and h_row0 + 8

        for it in cutlass.range(0, n_mine, unroll=1):
            slot = it % 2
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()
            kv = sbase + OFF_KV + slot * KV_BYTES

            # ---- S = Q K^T over this warp's 16 heads x 32 entries ----
            s = cute.make_rmem_tensor((4, 4), Float32)
            s.fill(0.0)
            for ks in cutlass.range_constexpr(HEAD_DIM // 16):
                a0, a1, a2, a3 = ptx.ldmatrix_x4(q_row_addr + ((Int32(2 * ks) ^ ka_y) << 4))
                for jp in cutlass.range_constexpr(2):
                    b0, b1, b2, b3 = ptx.ldmatrix_x4(kv + (kb_row + 16 * jp) * ROW + ((Int32(2 * ks) ^ kb_y) << 4))
                    d = ptx.mma_bf16_16816(a0, a1, a2, a3, b0, b1, s[2 * jp, 0], s[2 * jp, 1], s[2 * jp, 2],
                                           s[2 * jp, 3])
                    for i in cutlass.range_constexpr(4):
                        s[2 * jp, i] = d[i]
                    d = ptx.mma_bf16_16816(a0, a1, a2, a3, b2, b3, s[2 * jp + 1, 0], s[2 * jp + 1, 1],
                                           s[2 * jp + 1, 2], s[2 * jp + 1, 3])
                    for i in cutlass.range_constexpr(4):
                        s[2 * jp + 1, i] = d[i]

            # ---- logits (log2 units) + mask, row max over both entry halves ----
            mx0 = Float32(-math.inf)
            mx1 = Float32(-math.inf)
            for j in cutlass.range_constexpr(4):
                col = half * 32 + 8 * j + 2 * c
                bv0, bv1 = ptx.ld_shared_f32x2(sbase + OFF_BIAS + slot * (CHUNK * 4) + col * 4)
                s[j, 0] = s[j, 0] * Float32(self.sl2) + bv0
                s[j, 1] = s[j, 1] * Float32(self.sl2) + bv1
                s[j, 2] = s[j, 2] * Float32(self.sl2) + bv0
                s[j, 3] = s[j, 3] * Float32(self.sl2) + bv1
                mx0 = cute.arch.fmax(mx0, cute.arch.fmax(s[j, 0], s[j, 1]))
                mx1 = cute.arch.fmax(mx1, cute.arch.fmax(s[j, 2], s[j, 3]))
            for sh in cutlass.range_constexpr(2):
                mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, 1 << sh))
                mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, 1 << sh))
            if c == 0:
                ptx.st_shared_f32(sbase + OFF_MAX + (half * HEADS_PER_CTA + h_row0) * 4, mx0)
                ptx.st_shared_f32(sbase + OFF_MAX + (half * HEADS_PER_CTA + h_row0 + 8) * 4, mx1)
            cute.arch.sync_threads()
            other = sbase + OFF_MAX + ((1 - half) * HEADS_PER_CTA + h_row0) * 4
            mx0 = cute.arch.fmax(mx0, ptx.ld_shared_f32(other))
            mx1 = cute.arch.fmax(mx1, ptx.ld_shared_f32(other + 32))
            m_new0 = cute.arch.fmax(m_run[0], mx0)
            m_new1 = cute.arch.fmax(m_run[1], mx1)
            alpha0 = ptx.ex2(m_run[0] - m_new0)
            alpha1 = ptx.ex2(m_run[1] - m_new1)
            m_run[0] = m_new0
            m_run[1] = m_new1

            # ---- P = exp2(S - m) -> shared (BF16), partial row sums, rescale O ----
            sum0 = Float32(0.0)
            sum1 = Float32(0.0)
            p_row0 = sbase + OFF_P + h_row0 * P_ROW + c * 4
            for j in cutlass.range_constexpr(4):
                p0 = ptx.ex2(s[j, 0] - m_new0)
                p1 = ptx.ex2(s[j, 1] - m_new0)
                p2 = ptx.ex2(s[j, 2] - m_new1)
                p3 = ptx.ex2(s[j, 3] - m_new1)
                sum0 = sum0 + p0 + p1
                sum1 = sum1 + p2 + p3
                sw = ((half * 4 + j) ^ g) << 4                # 16-byte column half*4+j of rows h_row0(+8)
                ptx.st_shared_b32(p_row0 + sw, ptx.f32x2_to_bf16x2(p0, p1))
                ptx.st_shared_b32(p_row0 + 8 * P_ROW + sw, ptx.f32x2_to_bf16x2(p2, p3))
            l_run[0] = l_run[0] * alpha0 + sum0
            l_run[1] = l_run[1] * alpha1 + sum1
            for n in cutlass.range_constexpr(32):
                acc[n, 0] = acc[n, 0] * alpha0
                acc[n, 1] = acc[n, 1] * alpha0
                acc[n, 2] = acc[n, 2] * alpha1
                acc[n, 3] = acc[n, 3] * alpha1
            cute.arch.sync_threads()

            # ---- O += P V over this warp's 16 heads x 256 dims ----
            for ks in cutlass.range_constexpr(CHUNK // 16):
                a0, a1, a2, a3 = ptx.ldmatrix_x4(p_row_addr + ((Int32(2 * ks) ^ ka_y) << 4))
                v_addr = kv + (v_row + 16 * ks) * ROW
                for np_ in cutlass.range_constexpr(16):
                    col = half * 32 + 2 * np_ + hi16
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(v_addr + ((col ^ x) << 4))
                    d = ptx.mma_bf16_16816(a0, a1, a2, a3, b0, b1, acc[2 * np_, 0], acc[2 * np_, 1],
                                           acc[2 * np_, 2], acc[2 * np_, 3])
                    for i in cutlass.range_constexpr(4):
                        acc[2 * np_, i] = d[i]
                    d = ptx.mma_bf16_16816(a0, a1, a2, a3, b2, b3, acc[2 * np_ + 1, 0], acc[2 * np_ + 1, 1],
                                           acc[2 * np_ + 1, 2], acc[2 * np_ + 1, 3])
                    for i in cutlass.range_constexpr(4):
                        acc[2 * np_ + 1, i] = d[i]
            cute.arch.sync_threads()
            if it + 2 < n_mine:
                self.load_chunk(mKvw, mKvc, mIdx, sbase, b, wlen, W, K, N, c_begin + it + 2, slot, r, sub)
            cute.arch.cp_async_commit_group()

        cute.arch.cp_async_wait_group(0)
        # ---- row sums over the quad, then over the two entry halves ----
        l0 = l_run[0]
        l1 = l_run[1]
        for sh in cutlass.range_constexpr(2):
            l0 = l0 + cute.arch.shuffle_sync_bfly(l0, 1 << sh)
            l1 = l1 + cute.arch.shuffle_sync_bfly(l1, 1 << sh)
        if c == 0:
            ptx.st_shared_f32(sbase + OFF_L + (half * HEADS_PER_CTA + h_row0) * 4, l0)
            ptx.st_shared_f32(sbase + OFF_L + (half * HEADS_PER_CTA + h_row0 + 8) * 4, l1)
        cute.arch.sync_threads()
        other = sbase + OFF_L + ((1 - half) * HEADS_PER_CTA + h_row0) * 4
        l0 = l0 + ptx.ld_shared_f32(other)
        l1 = l1 + ptx.ld_shared_f32(other + 32)

        head0 = hb * HEADS_PER_CTA + h_row0
        dim0 = half * 256 + 2 * c
        if n_splits == 1:
            sk0 = mSink[head0] * Float32(LOG2E)
            sk1 = mSink[head0 + 8] * Float32(LOG2E)
            big0 = cute.arch.fmax(m_run[0], sk0)
            big1 = cute.arch.fmax(m_run[1], sk1)
            f0 = ptx.ex2(m_run[0] - big0)
            f1 = ptx.ex2(m_run[1] - big1)
            inv0 = f0 / (l0 * f0 + ptx.ex2(sk0 - big0))
            inv1 = f1 / (l1 * f1 + ptx.ex2(sk1 - big1))
            o_row0 = mOut.iterator.toint() + ((Int64(b) * n_heads + Int64(head0)) * HEAD_DIM + Int64(dim0)) * 2
            for n in cutlass.range_constexpr(32):
                ptx.st_global_b32(o_row0 + n * 16, ptx.f32x2_to_bf16x2(acc[n, 0] * inv0, acc[n, 1] * inv0))
                ptx.st_global_b32(o_row0 + 8 * HEAD_DIM * 2 + n * 16,
                                  ptx.f32x2_to_bf16x2(acc[n, 2] * inv1, acc[n, 3] * inv1))
        else:
            row0 = (Int64(b) * n_heads + Int64(head0)) * n_splits + Int64(split)
            row1 = row0 + Int64(8) * n_splits
            p0 = mOpart.iterator.toint() + (row0 * HEAD_DIM + Int64(dim0)) * 4
            p1 = mOpart.iterator.toint() + (row1 * HEAD_DIM + Int64(dim0)) * 4
            for n in cutlass.range_constexpr(32):
                ptx.st_global_v2_f32(p0 + n * 32, acc[n, 0], acc[n, 1])
                ptx.st_global_v2_f32(p1 + n * 32, acc[n, 2], acc[n, 3])
            if half == 0:
                if c == 0:
                    ml = mML.iterator.toint()
                    ptx.st_global_v2_f32(ml + row0 * 8, m_run[0], l0)
                    ptx.st_global_v2_f32(ml + row1 * 8, m_run[1], l1)

    @cute.jit
    def load_chunk(self, mKvw: cute.Tensor, mKvc: cute.Tensor, mIdx: cute.Tensor, sbase: Int32, b: Int32,
                   wlen: Int32, W: Int32, K: Int32, N: Int32, chunk: Int32, slot: Int32,
                   r: Int32, sub: Int32):
        """Thread (r, sub) gathers 16 of the 64 16-byte pieces of row r of the chunk, and its mask bias."""
        e = chunk * CHUNK + r
        src = mKvw.iterator.toint()
        nbytes = Int32(0)
        if e < W:
            if e < wlen:
                nbytes = Int32(16)
                src = src + (Int64(b) * W + Int64(e)) * ROW
        else:
            if const_expr(self.mode != "window"):
                if e < W + K:
                    idx = e - W
                    if const_expr(self.mode == "indexed"):
                        idx = mIdx[b, e - W]
                    if idx >= 0:
                        if idx < N:
                            nbytes = Int32(16)
                            src = mKvc.iterator.toint() + (Int64(b) * N + Int64(idx)) * ROW
        dst = sbase + OFF_KV + slot * KV_BYTES + r * ROW
        for i in cutlass.range_constexpr(16):
            seg = sub + 4 * i
            ptx.cp_async_16(dst + ((seg ^ (r % 8)) << 4), src + Int64(seg * 16), nbytes)
        if sub == 0:
            bias = Float32(0.0)
            if nbytes == 0:
                bias = Float32(-math.inf)
            ptx.st_shared_f32(sbase + OFF_BIAS + slot * (CHUNK * 4) + r * 4, bias)


class Sm90DecodeAttentionCombine:
    """Merge the splits: ``out[b, h] = sum_s 2^(m_s - M) O_s / (2^(sink - M) + sum_s 2^(m_s - M) l_s)``,
    M = max(sink, m_s) (log2 units). Grid (H, B), 128 threads, 4 dims each."""

    def key(self) -> tuple:
        return ()

    @cute.jit
    def __call__(self, mOpart: cute.Tensor, mML: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mOpart, mML, mSink, mOut).launch(
            grid=[mOut.shape[1], mOut.shape[0], 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mML: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        n_heads = mOut.shape[1]
        n_splits = mML.shape[2]
        row = (Int64(b) * n_heads + Int64(h)) * n_splits
        ml = mML.iterator.toint() + row * 8
        sk = mSink[h] * Float32(LOG2E)
        big = sk
        for s in cutlass.range(0, n_splits, unroll=1):
            m_s, _l = ptx.ld_global_v2_f32(ml + Int64(s) * 8)
            big = cute.arch.fmax(big, m_s)
        den = ptx.ex2(sk - big)
        o = cute.make_rmem_tensor((4,), Float32)
        o.fill(0.0)
        op = mOpart.iterator.toint() + (row * HEAD_DIM + Int64(tidx * 4)) * 4
        for s in cutlass.range(0, n_splits, unroll=1):
            m_s, l_s = ptx.ld_global_v2_f32(ml + Int64(s) * 8)
            f = ptx.ex2(m_s - big)
            den = den + f * l_s
            v = ptx.ld_global_v4_f32(op + Int64(s) * (HEAD_DIM * 4))
            for i in cutlass.range_constexpr(4):
                o[i] = o[i] + f * v[i]
        inv = Float32(1.0) / den
        dst = mOut.iterator.toint() + ((Int64(b) * n_heads + Int64(h)) * HEAD_DIM + Int64(tidx * 4)) * 2
        ptx.st_global_v2_b32(dst, ptx.f32x2_to_bf16x2(o[0] * inv, o[1] * inv),
                             ptx.f32x2_to_bf16x2(o[2] * inv, o[3] * inv))


# ----------------------------------------------------------------------------------------------
# host side

_COMPILED: dict[tuple, Callable] = {}
_WORKSPACE: dict[tuple, tuple] = {}


def _cute(t):
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t, assumed_align=16 if t.data_ptr() % 16 == 0 else t.element_size()).mark_layout_dynamic(
        leading_dim=t.dim() - 1)


def compile_op(op, tensors: list, stream=None) -> Callable:
    """Compile ``op`` for these tensors' dtypes and ranks (shapes stay dynamic), cached in-process.

    Works without a GPU: with ``CUTE_DSL_ARCH=sm_90a`` and CPU tensors it builds the sm_90a cubin.
    """
    key = (type(op).__name__, op.key(), tuple((t.dtype, t.dim()) for t in tensors))
    fn = _COMPILED.get(key)
    if fn is None:
        import cuda.bindings.driver as cuda
        fn = cute.compile(op, *[_cute(t) for t in tensors], stream if stream is not None else cuda.CUstream(0))
        _COMPILED[key] = fn
    return fn


def _launch(op, tensors: list) -> None:
    import cuda.bindings.driver as cuda
    import torch
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compile_op(op, tensors, stream)(*[_cute(t) for t in tensors], stream)


def pick_splits(batch: int, heads: int, entries: int, sms: int = 132) -> int:
    """Splits per (request, head block): about one wave of CTAs, no empty split."""
    n_chunks = max(1, -(-entries // CHUNK))
    ctas = batch * (heads // HEADS_PER_CTA)
    splits = max(1, min(n_chunks, -(-sms // ctas)))
    cps = -(-n_chunks // splits)
    return -(-n_chunks // cps)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def decode_attention(q, kv_window, window_len, kv_compressed, indices, sink, scale: float, *,
                     out=None, splits: int | None = None):
    """One decode step of DeepSeek-V4 attention on Hopper (sm_90a); returns BF16 ``out`` [B, H, 512].

    Args (contract and semantics: ``decode_attention_reference``; everything contiguous, on one GPU):
        q: bf16 [B, H, 512], rotated, H a multiple of 64 (64 V4-Flash, 128 V4-Pro).
        kv_window: bf16 [B, W, 512], the SWA ring; slots ``[0, window_len[b])`` are valid.
        window_len: int32 [B], in [0, W].
        kv_compressed: bf16 [B, N, 512] or None (window-only layer).
        indices: int32 [B, K] into ``kv_compressed[b]`` (-1 = padding, anywhere; CSA top-k), or None
            to attend to all N entries (HCA).
        sink: float32 [H]. scale: the logit scale (512**-0.5).
        out: optional bf16 [B, H, 512] to write into. splits: override the flash-decoding split count.

    No host sync and no allocation once a shape has been seen (split workspaces are cached per
    shape), so the call is CUDA-graph capturable after one warm-up call. The output is not inverse-RoPE'd.
    """
    import torch
    b, h, d = q.shape
    _expect(d == HEAD_DIM and h % HEADS_PER_CTA == 0 and q.dtype == torch.bfloat16,
            f"q must be bf16 [B, H (multiple of {HEADS_PER_CTA}), {HEAD_DIM}], got {q.dtype} {tuple(q.shape)}")
    _expect(kv_window.dtype == torch.bfloat16 and kv_window.dim() == 3 and kv_window.shape[0] == b
            and kv_window.shape[2] == d, f"kv_window must be bf16 [B={b}, W, {d}], got {tuple(kv_window.shape)}")
    _expect(window_len.dtype == torch.int32 and tuple(window_len.shape) == (b,), "window_len must be int32 [B]")
    _expect(sink.dtype == torch.float32 and tuple(sink.shape) == (h,), f"sink must be float32 [H={h}]")
    w = kv_window.shape[1]
    if kv_compressed is None:
        mode, kvc, idx, k = "window", kv_window, window_len.view(b, 1), 0
    else:
        _expect(kv_compressed.dtype == torch.bfloat16 and kv_compressed.dim() == 3 and kv_compressed.shape[0] == b
                and kv_compressed.shape[2] == d, f"kv_compressed must be bf16 [B={b}, N, {d}]")
        if indices is None:
            mode, kvc, idx, k = "dense", kv_compressed, window_len.view(b, 1), kv_compressed.shape[1]
        else:
            _expect(indices.dtype == torch.int32 and indices.dim() == 2 and indices.shape[0] == b,
                    f"indices must be int32 [B={b}, K], got {indices.dtype} {tuple(indices.shape)}")
            mode, kvc, idx, k = "indexed", kv_compressed, indices, indices.shape[1]
    for name, t in (("q", q), ("kv_window", kv_window), ("kv_compressed", kvc), ("indices", idx)):
        _expect(t.is_cuda and t.is_contiguous(), f"{name} must be a contiguous CUDA tensor")
    if out is None:
        out = torch.empty(b, h, d, dtype=torch.bfloat16, device=q.device)
    _expect(out.dtype == torch.bfloat16 and tuple(out.shape) == (b, h, d) and out.is_contiguous(),
            "out must be contiguous bf16 [B, H, 512]")
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = pick_splits(b, h, w + k, sms)
    wkey = (q.device, b, h, splits)
    if wkey not in _WORKSPACE:
        o_part = torch.empty((b, h, splits, d) if splits > 1 else (1, 1, 1, 4), dtype=torch.float32, device=q.device)
        _WORKSPACE[wkey] = (o_part, torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device))
    o_part, ml = _WORKSPACE[wkey]
    _launch(Sm90DecodeAttention(mode=mode, scale=scale), [q, kv_window, window_len, kvc, idx, sink, out, o_part, ml])
    if splits > 1:
        _launch(Sm90DecodeAttentionCombine(), [o_part, ml, sink, out])
    return out
