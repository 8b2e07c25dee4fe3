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
(:class:`Sm90DecodeAttentionCombine`) merges the splits and adds the sink. The combine is launched with
programmatic dependent launch: it is resident and waiting (``griddepcontrol.wait``) while the split kernel
runs, which hides its launch latency, the larger part of a batch-1 step's cost.

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
* P (BF16, [64 x 64], shared) @ V: with ``pv_heads=32`` (default) warp ``w`` owns heads
  ``32 (w % 2) ..+32`` and dims ``128 (w // 2) ..+128``, so each V fragment (``ldmatrix.trans`` from the
  same KV buffer) feeds two MMAs; ``pv_heads=16``: heads ``16 (w % 4)``, dims ``256 (w // 4)``. Either
  way 128 float32 accumulators per thread; the per-row rescale factors and running max pass through
  shared memory from the S warps.

Splits: :func:`pick_splits` keeps the split kernel to at most one wave (one CTA per SM) and does not
split once the requests alone fill the SMs. Measured on an H200: ``docs/benchmarks.md``.
The running max starts at -1e30 rather than -inf, so fully masked chunks or splits need no branch
(every exp2 of a masked logit is exactly 0).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import expect as _expect, launch as _launch

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
OFF_ALPHA = OFF_L + 2 * HEADS_PER_CTA * 4    # this chunk's rescale factor per head row
OFF_M = OFF_ALPHA + HEADS_PER_CTA * 4        # running max per head row
SMEM_BYTES = OFF_M + HEADS_PER_CTA * 4
LOG2E = 1.4426950408889634
NEG_BIG = -1.0e30
MODES = ("window", "indexed", "dense")


class Sm90DecodeAttention:
    """One compiled configuration of the split kernel.

    Args:
        mode: ``"window"`` (no compressed entries), ``"indexed"`` (CSA: ``indices`` [B, K], -1 pads)
            or ``"dense"`` (HCA: all N entries of ``kv_compressed``).
        scale: logit scale (512**-0.5 in V4), folded into the kernel with log2(e).
        pv_heads: head rows per warp in P @ V: 16 (8 warps = 4 head tiles x 2 dim halves) or 32
            (2 head pairs x 4 dim quarters: each V fragment feeds two MMAs, so V is read from shared
            memory half as often).

    Operands (all contiguous): ``q`` bf16 [B, H, 512], ``kv_window`` bf16 [B, W, 512], ``window_len``
    int32 [B], ``kv_compressed`` bf16 [B, N, 512], ``indices`` int32 [B, K], ``sink`` f32 [H],
    ``out`` bf16 [B, H, 512], ``o_part`` f32 [B, H, S, 512], ``ml`` f32 [B, H, S, 2] (S = splits,
    the grid's x; with S = 1 ``o_part`` is not touched). In ``"window"`` mode the compressed operands
    are placeholders (any tensors of those dtypes and ranks).
    """

    def __init__(self, *, mode: str, scale: float, pv_heads: int = 32):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if pv_heads not in (16, 32):
            raise ValueError(f"pv_heads must be 16 or 32, got {pv_heads}")
        self.mode = mode
        self.scale = float(scale)
        self.sl2 = float(scale) * LOG2E
        self.mt = pv_heads // 16                      # m16 tiles per warp in P @ V
        self.nt = HEAD_DIM // 8 // (8 // (HEADS_PER_CTA // pv_heads))  # n8 tiles (dims) per warp
        self.pv_heads = pv_heads

    def key(self) -> tuple:
        return (self.mode, self.scale, self.pv_heads)

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
        cute.arch.griddepcontrol_launch_dependents()  # the combine (PDL) may take its SM slots now; it waits for us
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

        MT, NT = self.mt, self.nt
        acc = cute.make_rmem_tensor((MT, NT, 4), Float32)
        acc.fill(0.0)
        if tidx < HEADS_PER_CTA:
            ptx.st_shared_f32(sbase + OFF_M + tidx * 4, Float32(NEG_BIG))   # read back only after syncs
        pv_row = ht * 16                                   # P @ V: this warp's first head row ...
        pv_dim = half * 256                                # ... and first dim
        if const_expr(MT == 2):
            pv_row = (warp % 2) * 32
            pv_dim = (warp // 2) * 128
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            m_run[i] = Float32(NEG_BIG)
            l_run[i] = Float32(0.0)

        qa_row = ht * 16 + x + 8 * ((lane // 8) % 2)        # A rows (Q and P): heads
        hi16 = lane // 16
        q_row_addr = sbase + OFF_Q + qa_row * ROW
        p_row_addr = sbase + OFF_P + (qa_row - ht * 16 + pv_row) * P_ROW
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
            if half == 0:
                if c == 0:
                    ptx.st_shared_f32(sbase + OFF_ALPHA + h_row0 * 4, alpha0)
                    ptx.st_shared_f32(sbase + OFF_ALPHA + (h_row0 + 8) * 4, alpha1)
                    ptx.st_shared_f32(sbase + OFF_M + h_row0 * 4, m_new0)
                    ptx.st_shared_f32(sbase + OFF_M + (h_row0 + 8) * 4, m_new1)

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
            cute.arch.sync_threads()

            # ---- O = alpha O + P V over this warp's 16 MT heads x 8 NT dims ----
            for mt in cutlass.range_constexpr(MT):
                al0 = ptx.ld_shared_f32(sbase + OFF_ALPHA + (pv_row + mt * 16 + g) * 4)
                al1 = ptx.ld_shared_f32(sbase + OFF_ALPHA + (pv_row + mt * 16 + g + 8) * 4)
                for n in cutlass.range_constexpr(NT):
                    acc[mt, n, 0] = acc[mt, n, 0] * al0
                    acc[mt, n, 1] = acc[mt, n, 1] * al0
                    acc[mt, n, 2] = acc[mt, n, 2] * al1
                    acc[mt, n, 3] = acc[mt, n, 3] * al1
            for ks in cutlass.range_constexpr(CHUNK // 16):
                pa = cute.make_rmem_tensor((MT, 4), Int32)
                for mt in cutlass.range_constexpr(MT):
                    a0, a1, a2, a3 = ptx.ldmatrix_x4(p_row_addr + mt * 16 * P_ROW + ((Int32(2 * ks) ^ ka_y) << 4))
                    pa[mt, 0] = a0
                    pa[mt, 1] = a1
                    pa[mt, 2] = a2
                    pa[mt, 3] = a3
                v_addr = kv + (v_row + 16 * ks) * ROW
                for np_ in cutlass.range_constexpr(NT // 2):
                    col = pv_dim // 8 + 2 * np_ + hi16
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(v_addr + ((col ^ x) << 4))
                    for mt in cutlass.range_constexpr(MT):
                        for t in cutlass.range_constexpr(2):
                            n = 2 * np_ + t
                            bb0 = b0
                            bb1 = b1
                            if const_expr(t == 1):
                                bb0 = b2
                                bb1 = b3
                            d = ptx.mma_bf16_16816(pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], bb0, bb1,
                                                   acc[mt, n, 0], acc[mt, n, 1], acc[mt, n, 2], acc[mt, n, 3])
                            for i in cutlass.range_constexpr(4):
                                acc[mt, n, i] = d[i]
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

        dim0 = pv_dim + 2 * c
        for mt in cutlass.range_constexpr(MT):
            for hh in cutlass.range_constexpr(2):
                rr = pv_row + mt * 16 + g + 8 * hh           # head row in the block
                lt = ptx.ld_shared_f32(sbase + OFF_L + rr * 4) + ptx.ld_shared_f32(
                    sbase + OFF_L + (HEADS_PER_CTA + rr) * 4)
                mr = ptx.ld_shared_f32(sbase + OFF_M + rr * 4)
                head = hb * HEADS_PER_CTA + rr
                if n_splits == 1:
                    sk = mSink[head] * Float32(LOG2E)
                    big = cute.arch.fmax(mr, sk)
                    f = ptx.ex2(mr - big)
                    inv = f / (lt * f + ptx.ex2(sk - big))
                    o_row = mOut.iterator.toint() + ((Int64(b) * n_heads + Int64(head)) * HEAD_DIM + Int64(dim0)) * 2
                    for n in cutlass.range_constexpr(NT):
                        ptx.st_global_b32(o_row + n * 16, ptx.f32x2_to_bf16x2(acc[mt, n, 2 * hh] * inv,
                                                                              acc[mt, n, 2 * hh + 1] * inv))
                else:
                    prow = (Int64(b) * n_heads + Int64(head)) * n_splits + Int64(split)
                    pp = mOpart.iterator.toint() + (prow * HEAD_DIM + Int64(dim0)) * 4
                    for n in cutlass.range_constexpr(NT):
                        ptx.st_global_v2_f32(pp + n * 32, acc[mt, n, 2 * hh], acc[mt, n, 2 * hh + 1])
                    if pv_dim == 0:
                        if c == 0:
                            ptx.st_global_v2_f32(mML.iterator.toint() + prow * 8, mr, lt)

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


MAX_SPLITS = 1024


class Sm90DecodeAttentionCombine:
    """Merge the splits: ``out[b, h] = sum_s 2^(m_s - M) O_s / (2^(sink - M) + sum_s 2^(m_s - M) l_s)``,
    M = max(sink, m_s) (log2 units). Grid (H, B), ``128 * groups`` threads: the weights ``2^(m_s - M)``
    and the denominator are computed once per block (all splits' ``(m, l)`` loaded in parallel); then
    each group of 128 threads (4 dims each) sums every ``groups``-th split's ``O_s`` and the groups add
    up through shared memory, so the dependent-load chain is S / groups deep. At most ``MAX_SPLITS``."""

    def __init__(self, groups: int = 1):
        self.groups = groups

    def key(self) -> tuple:
        return (self.groups,)

    @cute.jit
    def __call__(self, mOpart: cute.Tensor, mML: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mOpart, mML, mSink, mOut).launch(
            grid=[mOut.shape[1], mOut.shape[0], 1], block=[128 * self.groups, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mML: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor):
        COMBINE_GROUPS = self.groups
        COMBINE_THREADS = 128 * COMBINE_GROUPS
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        # launched with PDL while the split kernel runs: its partials are complete (and flushed) from here
        cute.arch.griddepcontrol_wait()
        lane = tidx % 32
        warp = tidx // 32
        n_warps = COMBINE_THREADS // 32
        n_heads = mOut.shape[1]
        n_splits = mML.shape[2]
        smem = cutlass.memory.SmemAllocator()
        sb = smem.allocate_array(Float32, MAX_SPLITS + 2 * n_warps + max(COMBINE_GROUPS - 1, 1) * HEAD_DIM,
                                 byte_alignment=16).toint()
        s_f = sb
        s_red = sb + MAX_SPLITS * 4
        s_o = s_red + 2 * n_warps * 4

        row = (Int64(b) * n_heads + Int64(h)) * n_splits
        ml = mML.iterator.toint() + row * 8
        sk = mSink[h] * Float32(LOG2E)
        # 1. M = max(sink, m_s)
        mx = sk
        for s in cutlass.range(tidx, n_splits, COMBINE_THREADS, unroll=1):
            m_s, _l = ptx.ld_global_v2_f32(ml + Int64(s) * 8)
            mx = cute.arch.fmax(mx, m_s)
        for sh in cutlass.range_constexpr(5):
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1 << sh))
        if lane == 0:
            ptx.st_shared_f32(s_red + warp * 4, mx)
        cute.arch.sync_threads()
        big = ptx.ld_shared_f32(s_red)
        for w in cutlass.range_constexpr(1, n_warps):
            big = cute.arch.fmax(big, ptx.ld_shared_f32(s_red + w * 4))
        # 2. per-split weights (to shared) and the denominator
        dp = Float32(0.0)
        for s in cutlass.range(tidx, n_splits, COMBINE_THREADS, unroll=1):
            m_s, l_s = ptx.ld_global_v2_f32(ml + Int64(s) * 8)
            f = ptx.ex2(m_s - big)
            ptx.st_shared_f32(s_f + s * 4, f)
            dp = dp + f * l_s
        for sh in cutlass.range_constexpr(5):
            dp = dp + cute.arch.shuffle_sync_bfly(dp, 1 << sh)
        if lane == 0:
            ptx.st_shared_f32(s_red + (n_warps + warp) * 4, dp)
        cute.arch.sync_threads()
        den = ptx.ex2(sk - big)
        for w in cutlass.range_constexpr(n_warps):
            den = den + ptx.ld_shared_f32(s_red + (n_warps + w) * 4)
        # 3. weighted partial outputs: group q takes splits q, q + 4, ...
        q = tidx // (HEAD_DIM // 4)
        d4 = tidx % (HEAD_DIM // 4)
        o = cute.make_rmem_tensor((4,), Float32)
        o.fill(0.0)
        op = mOpart.iterator.toint() + (row * HEAD_DIM + Int64(d4 * 4)) * 4
        for s in cutlass.range(q, n_splits, COMBINE_GROUPS, unroll=4):
            f = ptx.ld_shared_f32(s_f + s * 4)
            v = ptx.ld_global_v4_f32(op + Int64(s) * (HEAD_DIM * 4))
            for i in cutlass.range_constexpr(4):
                o[i] = o[i] + f * v[i]
        if const_expr(COMBINE_GROUPS > 1):
            if q > 0:
                for i in cutlass.range_constexpr(4):
                    ptx.st_shared_f32(s_o + ((q - 1) * HEAD_DIM + d4 * 4 + i) * 4, o[i])
            cute.arch.sync_threads()
        if q == 0:
            for g in cutlass.range_constexpr(1, COMBINE_GROUPS):
                for i in cutlass.range_constexpr(4):
                    o[i] = o[i] + ptx.ld_shared_f32(s_o + ((g - 1) * HEAD_DIM + d4 * 4 + i) * 4)
            inv = Float32(1.0) / den
            dst = mOut.iterator.toint() + ((Int64(b) * n_heads + Int64(h)) * HEAD_DIM + Int64(d4 * 4)) * 2
            ptx.st_global_v2_b32(dst, ptx.f32x2_to_bf16x2(o[0] * inv, o[1] * inv),
                                 ptx.f32x2_to_bf16x2(o[2] * inv, o[3] * inv))


# ----------------------------------------------------------------------------------------------
# host side

_WORKSPACE: dict[tuple, tuple] = {}


def pick_splits(batch: int, heads: int, entries: int, sms: int = 132, chunk: int = CHUNK) -> int:
    """Splits per (request, head block): at most one wave of CTAs (one CTA per SM), no empty split;
    no split at all once the requests alone fill the SMs (no partials, no combine)."""
    n_chunks = max(1, -(-entries // chunk))
    ctas = batch * (heads // HEADS_PER_CTA)
    splits = max(1, min(n_chunks, sms // ctas))
    cps = -(-n_chunks // splits)
    return -(-n_chunks // cps)


def decode_attention(q, kv_window, window_len, kv_compressed, indices, sink, scale: float, *,
                     out=None, splits: int | None = None, wgmma: bool = False, **tiling):
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
        wgmma: use the warpgroup-MMA split kernel (``sm90_decode_attention_wgmma``); ``tiling``: the
            kernel's options (``pv_heads``; with ``wgmma``: ``chunk``, ``stages``).

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
    if wgmma:
        from .sm90_decode_attention_wgmma import Sm90DecodeAttentionWgmma
        kernel = Sm90DecodeAttentionWgmma(mode=mode, scale=scale, **tiling)
    else:
        kernel = Sm90DecodeAttention(mode=mode, scale=scale, **tiling)
    chunk = getattr(kernel, "chunk", CHUNK)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = pick_splits(b, h, w + k, sms, chunk)
    _expect(1 <= splits <= MAX_SPLITS, f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    wkey = (q.device, b, h, splits)
    if wkey not in _WORKSPACE:
        o_part = torch.empty((b, h, splits, d) if splits > 1 else (1, 1, 1, 4), dtype=torch.float32, device=q.device)
        _WORKSPACE[wkey] = (o_part, torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device))
    o_part, ml = _WORKSPACE[wkey]
    _launch(kernel, [q, kv_window, window_len, kvc, idx, sink, out, o_part, ml])
    if splits > 1:
        _launch(Sm90DecodeAttentionCombine(groups=4 if splits >= 8 else 1), [o_part, ml, sink, out])
    return out
