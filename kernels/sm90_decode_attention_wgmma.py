"""SM90 decode attention on warpgroup MMA: the split kernel of ``sm90_decode_attention`` with ``wgmma``.

Same operands, grid, splits and partial-output contract as :class:`Sm90DecodeAttention` (whose module
docstring holds them); what changes is how a chunk of ``chunk`` KV entries is computed. The CTA is two
warpgroups (256 threads), one CTA per SM.

Shared memory, every tile 128-byte swizzled (16-byte column ``j`` of row ``r`` at ``j ^ (r % 8)``) and cut
into 8 column blocks of 64 dims (one swizzle atom wide): Q [64 heads x 512] once, a ring of ``stages``
KV chunks [chunk x 512], the S exchange buffer and the mask bias. One KV buffer serves both products:
read K-major it is B of ``S = Q K^T`` (N = entries), read MN-major (``tnsp_b``) it is B of ``O += P V``
(N = dims), so every KV byte lands in shared memory once.

Per chunk:
* ``S``: warpgroup ``w`` multiplies dims ``256 w ..+256`` (16 ``wgmma`` m64 x chunk x k16, both operands
  from shared memory), so the 64 x chunk x 512 product is done once per CTA, not once per warpgroup;
  the two halves are summed through shared memory (each thread adds its partner's identical fragment:
  thread ``t`` of both warpgroups holds the same (head, entry) elements, and the sum is commutative, so
  both warpgroups hold bit-identical ``S`` and run the same softmax with no further exchange).
* softmax in registers (log2 units, running max, ``-inf`` bias on invalid entries);
* ``O += P V``: warpgroup ``w`` owns dims ``256 w ..+256`` (128 float32 accumulators per thread), ``P`` is
  the A operand straight from registers (the accumulator fragment of ``S`` is the A fragment of the
  next ``wgmma``), ``chunk / 16`` ``wgmma`` m64 n256 k16.
Loads: all 256 threads gather rows with ``cp.async`` (zero fill for invalid entries) ``stages - 1``
chunks ahead; a barrier per chunk publishes the landed chunk (after a proxy fence: ``wgmma`` reads
shared memory through the async proxy) and frees the slot the previous chunk used.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .sm90_decode_attention import HEAD_DIM, HEADS_PER_CTA, LOG2E, MODES, NEG_BIG, ROW

THREADS = 256
ATOM = 128                                  # bytes of one swizzled row (64 BF16 dims)
BLOCKS = ROW // ATOM                        # 8 column blocks per 512-dim row
Q_BLOCK = HEADS_PER_CTA * ATOM              # 8 KB
SMEM_LIMIT = 227 * 1024
CHUNKS = (16, 32, 64)


def smem_bytes(chunk: int, stages: int) -> int:
    """Dynamic shared memory of a configuration (Q, ring, S exchange, bias, alignment slack)."""
    return BLOCKS * Q_BLOCK + stages * chunk * ROW + 2 * HEADS_PER_CTA * chunk * 4 + stages * chunk * 4 + 1024


class Sm90DecodeAttentionWgmma:
    """One compiled configuration of the WGMMA split kernel.

    Args:
        mode, scale: as :class:`Sm90DecodeAttention`.
        chunk: KV entries per pipeline step (16, 32 or 64).
        stages: KV buffers in the ring (``stages - 1`` chunks in flight while one is computed).
    """

    def __init__(self, *, mode: str, scale: float, chunk: int = 64, stages: int = 2):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if chunk not in CHUNKS:
            raise ValueError(f"chunk must be one of {CHUNKS}, got {chunk}")
        if stages < 2 or smem_bytes(chunk, stages) > SMEM_LIMIT:
            raise ValueError(f"stages={stages} with chunk={chunk} needs {smem_bytes(chunk, stages)} B of shared "
                             f"memory (at least 2 stages, at most {SMEM_LIMIT} B)")
        self.mode = mode
        self.scale = float(scale)
        self.sl2 = float(scale) * LOG2E
        self.chunk = chunk
        self.stages = stages
        self.kv_block = chunk * ATOM                       # one column block of a KV buffer
        self.kv_bytes = BLOCKS * self.kv_block
        self.x_bytes = HEADS_PER_CTA * chunk * 4          # one warpgroup's S half, float32
        self.off_kv = BLOCKS * Q_BLOCK
        self.off_x = self.off_kv + stages * self.kv_bytes
        self.off_bias = self.off_x + 2 * self.x_bytes
        self.tpr = THREADS // chunk                        # loader threads per KV row
        self.upt = 64 // self.tpr                          # 16-byte pieces per loader thread

    def key(self) -> tuple:
        return ("wgmma", self.mode, self.scale, self.chunk, self.stages)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWlen: cute.Tensor, mKvc: cute.Tensor,
                 mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
                 mML: cute.Tensor, stream):
        self.kernel(mQ, mKvw, mWlen, mKvc, mIdx, mSink, mOut, mOpart, mML).launch(
            grid=[mML.shape[2], mQ.shape[1] // HEADS_PER_CTA, mQ.shape[0]], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWlen: cute.Tensor, mKvc: cute.Tensor,
               mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
               mML: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        split, hb, b = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()  # the combine (PDL) may take its SM slots now; it waits for us
        C = self.chunk
        NS = C // 2                                  # S accumulators per thread
        n_splits = mML.shape[2]
        n_heads = mQ.shape[1]
        wg = tidx // 128
        t = tidx % 128
        lane = tidx % 32
        g = lane // 4
        c = lane % 4

        W = mKvw.shape[1]
        K = Int32(0)
        N = Int32(1)
        if const_expr(self.mode == "indexed"):
            K = mIdx.shape[1]
            N = mKvc.shape[1]
        if const_expr(self.mode == "dense"):
            K = mKvc.shape[1]
            N = mKvc.shape[1]
        n_chunks = (W + K + C - 1) // C
        cps = (n_chunks + n_splits - 1) // n_splits
        c_begin = split * cps
        c_end = c_begin + cps
        if c_end > n_chunks:
            c_end = n_chunks
        n_mine = c_end - c_begin
        if n_mine < 0:
            n_mine = Int32(0)

        smem = cutlass.memory.SmemAllocator()
        sraw = smem.allocate_array(cutlass.Int8, smem_bytes(C, self.stages), byte_alignment=16).toint()
        sbase = (Int32(sraw) + 1023) & Int32(-1024)   # swizzle atoms need 1024-byte alignment
        wlen = mWlen[b]

        # ---- prologue: Q block (one commit group with chunk 0), then chunks 1 .. stages - 2 ----
        qr = tidx // 4
        q_src = mQ.iterator.toint() + (Int64(b) * n_heads + Int64(hb * HEADS_PER_CTA + qr)) * ROW
        for i in cutlass.range_constexpr(16):
            seg = tidx % 4 + 4 * i
            ptx.cp_async_16(sbase + (seg // 8) * Q_BLOCK + qr * ATOM + (((seg % 8) ^ (qr % 8)) << 4),
                            q_src + Int64(seg * 16), Int32(16))
        r = tidx // self.tpr
        sub = tidx % self.tpr
        for st in cutlass.range_constexpr(self.stages - 1):
            if n_mine > st:
                self.load_chunk(mKvw, mKvc, mIdx, sbase, b, wlen, W, K, N, c_begin + st, Int32(st), r, sub)
            cute.arch.cp_async_commit_group()

        o = cute.make_rmem_tensor((128,), Float32)
        o.fill(0.0)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            m_run[i] = Float32(NEG_BIG)
            l_run[i] = Float32(0.0)
        x_mine = sbase + self.off_x + wg * self.x_bytes + t * 16
        x_other = sbase + self.off_x + (1 - wg) * self.x_bytes + t * 16

        for it in cutlass.range(0, n_mine, unroll=1):
            slot = it % self.stages
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()                       # chunk `it` landed everywhere; chunk it - 1's slot is free
            nxt = it + self.stages - 1
            if nxt < n_mine:
                self.load_chunk(mKvw, mKvc, mIdx, sbase, b, wlen, W, K, N, c_begin + nxt, nxt % self.stages, r, sub)
            cute.arch.cp_async_commit_group()
            kv = sbase + self.off_kv + slot * self.kv_bytes

            # ---- S half: dims 256 wg ..+256 ----
            s = [Float32(0.0)] * NS
            warpgroup.fence()
            for ks in cutlass.range_constexpr(16):
                blk = wg * 4 + ks // 4
                da = ptx.smem_desc_sw128(sbase + blk * Q_BLOCK + (ks % 4) * 32)
                db = ptx.smem_desc_sw128(kv + blk * self.kv_block + (ks % 4) * 32)
                s = ptx.wgmma_bf16_ss(s, da, db, accumulate=ks > 0)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            s = ptx.fence_operands(s)
            for q in cutlass.range_constexpr(NS // 4):
                ptx.st_shared_v4_f32(x_mine + q * 2048, s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3])
            cute.arch.barrier()
            for q in cutlass.range_constexpr(NS // 4):
                v = ptx.ld_shared_v4_f32(x_other + q * 2048)
                for e in cutlass.range_constexpr(4):
                    s[4 * q + e] = s[4 * q + e] + v[e]

            # ---- softmax (log2 units): bias, running max, P, row sums ----
            bias = sbase + self.off_bias + slot * (C * 4)
            mx0 = Float32(-math.inf)
            mx1 = Float32(-math.inf)
            for j in cutlass.range_constexpr(C // 8):
                bv0, bv1 = ptx.ld_shared_f32x2(bias + (8 * j + 2 * c) * 4)
                s[4 * j] = s[4 * j] * Float32(self.sl2) + bv0
                s[4 * j + 1] = s[4 * j + 1] * Float32(self.sl2) + bv1
                s[4 * j + 2] = s[4 * j + 2] * Float32(self.sl2) + bv0
                s[4 * j + 3] = s[4 * j + 3] * Float32(self.sl2) + bv1
                mx0 = cute.arch.fmax(mx0, cute.arch.fmax(s[4 * j], s[4 * j + 1]))
                mx1 = cute.arch.fmax(mx1, cute.arch.fmax(s[4 * j + 2], s[4 * j + 3]))
            for sh in cutlass.range_constexpr(2):
                mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, 1 << sh))
                mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, 1 << sh))
            m_new0 = cute.arch.fmax(m_run[0], mx0)
            m_new1 = cute.arch.fmax(m_run[1], mx1)
            alpha0 = ptx.ex2(m_run[0] - m_new0)
            alpha1 = ptx.ex2(m_run[1] - m_new1)
            m_run[0] = m_new0
            m_run[1] = m_new1
            sum0 = Float32(0.0)
            sum1 = Float32(0.0)
            pa = cute.make_rmem_tensor((NS // 2,), Int32)   # P as bf16 pairs: the A fragments of P V
            for j in cutlass.range_constexpr(C // 8):
                p0 = ptx.ex2(s[4 * j] - m_new0)
                p1 = ptx.ex2(s[4 * j + 1] - m_new0)
                p2 = ptx.ex2(s[4 * j + 2] - m_new1)
                p3 = ptx.ex2(s[4 * j + 3] - m_new1)
                sum0 = sum0 + p0 + p1
                sum1 = sum1 + p2 + p3
                pa[2 * j] = ptx.f32x2_to_bf16x2(p0, p1)
                pa[2 * j + 1] = ptx.f32x2_to_bf16x2(p2, p3)
            l_run[0] = l_run[0] * alpha0 + sum0
            l_run[1] = l_run[1] * alpha1 + sum1
            for j in cutlass.range_constexpr(32):
                o[4 * j] = o[4 * j] * alpha0
                o[4 * j + 1] = o[4 * j + 1] * alpha0
                o[4 * j + 2] = o[4 * j + 2] * alpha1
                o[4 * j + 3] = o[4 * j + 3] * alpha1

            # ---- O += P V over dims 256 wg ..+256 (V read MN-major from the same buffer) ----
            ov = [o[i] for i in range(128)]
            warpgroup.fence()
            for ks in cutlass.range_constexpr(C // 16):
                db = ptx.smem_desc_sw128(kv + (wg * 4) * self.kv_block + ks * 16 * ATOM, lbo=self.kv_block)
                ov = ptx.wgmma_bf16_rs(ov, pa[4 * ks], pa[4 * ks + 1], pa[4 * ks + 2], pa[4 * ks + 3], db,
                                       tnsp_b=True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            ov = ptx.fence_operands(ov)
            for i in cutlass.range_constexpr(128):
                o[i] = ov[i]

        cute.arch.cp_async_wait_group(0)
        l0 = l_run[0]
        l1 = l_run[1]
        for sh in cutlass.range_constexpr(2):
            l0 = l0 + cute.arch.shuffle_sync_bfly(l0, 1 << sh)
            l1 = l1 + cute.arch.shuffle_sync_bfly(l1, 1 << sh)

        dim0 = wg * 256 + 2 * c
        for hh in cutlass.range_constexpr(2):
            head = hb * HEADS_PER_CTA + (t // 32) * 16 + g + 8 * hh
            mr = m_run[hh]
            lt = l0
            if const_expr(hh == 1):
                lt = l1
            if n_splits == 1:
                sk = mSink[head] * Float32(LOG2E)
                big = cute.arch.fmax(mr, sk)
                f = ptx.ex2(mr - big)
                inv = f / (lt * f + ptx.ex2(sk - big))
                o_row = mOut.iterator.toint() + ((Int64(b) * n_heads + Int64(head)) * HEAD_DIM + Int64(dim0)) * 2
                for j in cutlass.range_constexpr(32):
                    ptx.st_global_b32(o_row + j * 16, ptx.f32x2_to_bf16x2(o[4 * j + 2 * hh] * inv,
                                                                          o[4 * j + 2 * hh + 1] * inv))
            else:
                prow = (Int64(b) * n_heads + Int64(head)) * n_splits + Int64(split)
                pp = mOpart.iterator.toint() + (prow * HEAD_DIM + Int64(dim0)) * 4
                for j in cutlass.range_constexpr(32):
                    ptx.st_global_v2_f32(pp + j * 32, o[4 * j + 2 * hh], o[4 * j + 2 * hh + 1])
                if wg == 0:
                    if c == 0:
                        ptx.st_global_v2_f32(mML.iterator.toint() + prow * 8, mr, lt)

    @cute.jit
    def load_chunk(self, mKvw: cute.Tensor, mKvc: cute.Tensor, mIdx: cute.Tensor, sbase: Int32, b: Int32,
                   wlen: Int32, W: Int32, K: Int32, N: Int32, chunk: Int32, slot: Int32,
                   r: Int32, sub: Int32):
        """Thread (r, sub) gathers ``upt`` of the 64 16-byte pieces of row r of the chunk, and its mask bias."""
        e = chunk * self.chunk + r
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
        dst = sbase + self.off_kv + slot * self.kv_bytes + r * ATOM
        for i in cutlass.range_constexpr(self.upt):
            seg = sub + self.tpr * i
            ptx.cp_async_16(dst + (seg // 8) * self.kv_block + (((seg % 8) ^ (r % 8)) << 4), src + Int64(seg * 16),
                            nbytes)
        if sub == 0:
            bias = Float32(0.0)
            if nbytes == 0:
                bias = Float32(-math.inf)
            ptx.st_shared_f32(sbase + self.off_bias + slot * (self.chunk * 4) + r * 4, bias)
