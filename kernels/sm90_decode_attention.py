"""SM90 (sm_90a) decode attention of DeepSeek-V4: SWA ring + gathered compressed entries + sink, one softmax.

Contract: ``decode_attention_reference`` (``kernels/decode_attention_reference.py``); the host entry
point is :func:`decode_attention`. MQA: one 512-dim BF16 vector per entry is both K and V for all
heads, so the **heads are the MMA M dimension** (64 per CTA: one ``wgmma`` m64 tile) and every KV byte
is read from HBM once per 64 heads (the second head block of a 128-head model reads it again, mostly
from L2).

Work split (flash-decoding). A request's entries form one virtual list: window slots ``0..W-1``
then ``indices[b, 0..K-1]`` (or ``0..N-1`` for HCA), cut into chunks of ``chunk`` entries. The grid is
``(splits, H / 64, B)``; split ``s`` walks chunks ``[s*C//S, (s+1)*C//S)`` (C chunks, S splits: sizes
differ by at most one). With one split the CTA normalises (sink included) and writes BF16 ``out``;
otherwise it writes its unnormalised float32 ``O`` and ``(m, l)`` and a second kernel
(:class:`Sm90DecodeAttentionCombine`) merges the splits and adds the sink. The combine is launched with
programmatic dependent launch: it is resident and waiting (``griddepcontrol.wait``) while the split
kernel runs.

Split kernel (:class:`Sm90DecodeAttention`): two warpgroups (256 threads), one CTA per SM. Shared
memory, every tile 128-byte swizzled (16-byte column ``j`` of row ``r`` at ``j ^ (r % 8)``) and cut into
8 column blocks of 64 dims (one swizzle atom wide): Q [64 heads x 512] once, a ring of ``stages`` KV
chunks [chunk x 512], the S exchange buffer and the mask bias. One KV buffer serves both products:
read K-major it is B of ``S = Q K^T`` (N = entries), read MN-major (``tnsp_b``) it is B of ``O += P V``
(N = dims), so every KV byte lands in shared memory once. Per chunk:

* ``S``: warpgroup ``w`` multiplies dims ``256 w ..+256`` (16 ``wgmma`` m64 x chunk x k16, both operands
  from shared memory), so the product is done once per CTA; the halves are summed through shared
  memory (thread ``t`` of both warpgroups holds the same (head, entry) elements and the sum is
  commutative, so both hold bit-identical ``S`` and run the same softmax with no further exchange).
* softmax in registers (log2 units, running max, ``-inf`` bias on invalid entries). The running max
  starts at -1e30 rather than -inf, so fully masked chunks or splits need no branch.
* ``O += P V``: warpgroup ``w`` owns dims ``256 w ..+256`` (128 float32 accumulators per thread); ``P`` is
  the A operand straight from registers (the accumulator fragment of ``S`` is the A fragment of the
  next ``wgmma``): ``chunk / 16`` ``wgmma`` m64 n256 k16.

Loads: all 256 threads gather rows with ``cp.async`` (zero fill, no HBM read, for invalid entries:
slot >= window_len, index -1) ``stages - 1`` chunks ahead, each CSA row's entry index read one chunk
before that (4-8 % faster CSA from B = 32, ``docs/design/decode_attention.md``); a barrier per chunk publishes the landed
chunk (after a proxy fence: ``wgmma`` reads shared memory through the async proxy) and frees the slot
the previous chunk used.

Small splits, one cluster (``sm90_heuristics.pick_cluster``): when a head block has at most 4 splits in a
small grid, its splits run as one thread-block cluster and merge their O through distributed shared memory
(:meth:`Sm90DecodeAttention.cluster_merge`), so no partial goes through HBM and the combine kernel is
not launched. ``sm90_heuristics.pick_splits`` keeps the split kernel to at most one wave (one CTA per SM) and
does not split once the requests alone fill the SMs. The pipeline is chunks of 64 entries in a ring of 2;
the variants measured and not kept are in ``docs/design/decode_attention.md``.

Prefill (:class:`Sm90PrefillAttention`, host :func:`sm90_prefill_attention`, contract
``prefill_attention_reference``): every query token of a chunk attends to its own key set (its window, its top-k or
its visible HCA entries), so T tokens of a sequence are T requests of the same kernel, reading their sequence's
rows and entries in place (no keys copied per request): a request's window is a span of its sequence's rows and its
list is that span then its entries. One compile-time flag (``shared``) selects the addressing; the decode form's
code is the same as without it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .sm90_ptx import LOG2E
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import ATTENTION_CHUNK, ATTENTION_HEADS_PER_CTA
from .sm90_heuristics import pick_cluster, pick_splits

HEAD_DIM = 512
HEADS_PER_CTA = ATTENTION_HEADS_PER_CTA  # one wgmma m64 tile of heads
ROW = HEAD_DIM * 2                     # bytes per KV / Q row
THREADS = 256
ATOM = 128                             # bytes of one swizzled row (64 BF16 dims)
BLOCKS = ROW // ATOM                   # 8 column blocks per 512-dim row
Q_BLOCK = HEADS_PER_CTA * ATOM         # 8 KB
CHUNK = ATTENTION_CHUNK                # KV entries per pipeline step
STAGES = 2                             # KV chunks in the ring (one in flight while one is computed)
NEG_BIG = -1.0e30
MODES = ("window", "indexed", "dense")
CLUSTERS = (1, 2, 4)                   # CTAs of a cluster that merges a head block's splits
O_ROW = HEAD_DIM * 4                   # bytes of one head's float32 O row in the cluster exchange
GRANULES = HEADS_PER_CTA * HEAD_DIM // 4   # 16-byte float32 granules of a CTA's O tile


def smem_bytes(chunk: int, stages: int) -> int:
    """Dynamic shared memory of a configuration (Q, ring, S exchange, bias, alignment slack)."""
    return BLOCKS * Q_BLOCK + stages * chunk * ROW + 2 * HEADS_PER_CTA * chunk * 4 + stages * chunk * 4 + 1024


class Sm90DecodeAttention:
    """One compiled configuration of the split kernel.

    Args:
        mode: ``"window"`` (no compressed entries), ``"indexed"`` (CSA: ``indices`` [B, K], -1 pads)
            or ``"dense"`` (HCA: all N entries of ``kv_compressed``).
        scale: logit scale (512**-0.5 in V4), folded into the kernel with log2(e).
        cluster: 1, or the splits of a head block as one cluster that merges them in distributed shared
            memory (:meth:`cluster_merge`; the grid's x is ``cluster``, ``ml`` has S = 1, ``o_part`` is not
            touched).

    Operands (all contiguous): ``q`` bf16 [B, H, 512], ``kv_window`` bf16 [B, W, 512], ``window_len``
    int32 [B], ``kv_compressed`` bf16 [B, N, 512], ``indices`` int32 [B, K], ``sink`` f32 [H],
    ``out`` bf16 [B, H, 512], ``o_part`` f32 [B, H, S, 512], ``ml`` f32 [B, H, S, 2] (S = splits,
    the grid's x without a cluster; with S = 1 ``o_part`` is not touched). In ``"window"`` mode the compressed operands
    are placeholders (any tensors of those dtypes and ranks).
    """

    shared = False   # decode: every request its own ring and entries (the prefill form: Sm90PrefillAttention)

    @staticmethod
    def can_implement(heads: int, head_dim: int) -> bool:
        """Whether the kernel takes a model's attention: 512-dim heads, a multiple of 64 of them."""
        return head_dim == HEAD_DIM and heads > 0 and heads % HEADS_PER_CTA == 0

    def __init__(self, *, mode: str, scale: float, cluster: int = 1):
        chunk, stages = CHUNK, STAGES
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if cluster not in CLUSTERS:
            raise ValueError(f"cluster must be one of {CLUSTERS}, got {cluster}")
        self.mode = mode
        self.cluster = cluster
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
        self.off_ml = self.off_x                           # after the loop (cluster): (m, l) per head ..
        self.off_w = self.off_x + HEADS_PER_CTA * 8        # .. and the merge weights of this CTA's heads
        self.tpr = THREADS // chunk                        # loader threads per KV row
        self.upt = 64 // self.tpr                          # 16-byte pieces per loader thread

    def key(self) -> tuple:
        return (self.mode, self.scale, self.chunk, self.stages, self.cluster)  # chunk, stages: fixed (compile key)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWlen: cute.Tensor, mKvc: cute.Tensor,
                 mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
                 mML: cute.Tensor, stream):
        self.launch_on(self.kernel(mQ, mKvw, mWlen, mKvc, mIdx, mSink, mOut, mOpart, mML), mQ, mML, stream)

    def launch_on(self, kernel, mQ: cute.Tensor, mML: cute.Tensor, stream) -> None:
        """Launch ``kernel`` on the grid (splits, H / 64, requests), as one cluster of the splits where it has one."""
        grid = [mML.shape[2] * self.cluster, mQ.shape[1] // HEADS_PER_CTA, mQ.shape[0]]
        if const_expr(self.cluster > 1):
            kernel.launch(grid=grid, block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1], stream=stream)
        else:
            kernel.launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWlen: cute.Tensor, mKvc: cute.Tensor,
               mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
               mML: cute.Tensor):
        self.attend(mQ, mKvw, mWlen, mWlen, mKvc, mIdx, mSink, mOut, mOpart, mML)  # no window starts: a ring each

    @cute.jit
    def attend(self, mQ: cute.Tensor, mKvw: cute.Tensor, mWstart: cute.Tensor, mWlen: cute.Tensor,
               mKvc: cute.Tensor, mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
               mML: cute.Tensor):
        """The split kernel's body, request ``b`` the grid's z (``mWstart`` is read in the prefill form only)."""
        tidx, _, _ = cute.arch.thread_idx()
        split, hb, b = cute.arch.block_idx()
        cute.arch.griddepcontrol_launch_dependents()  # the combine (PDL) may take its SM slots now; it waits for this grid
        C = self.chunk
        n_splits = mML.shape[2] * self.cluster
        n_heads = mQ.shape[1]
        wg = tidx // 128
        t = tidx % 128
        c = tidx % 4

        W = mKvw.shape[1]
        K = Int32(0)
        N = Int32(1)
        if const_expr(self.mode == "indexed"):
            K = mIdx.shape[1]
            N = mKvc.shape[1]
        if const_expr(self.mode == "dense"):
            K = mKvc.shape[1]
            N = mKvc.shape[1]
        seq = b                       # whose rows and entries: the request's own (decode)
        wstart = Int32(0)
        if const_expr(self.shared):
            # prefill: request b reads the rows and entries of its sequence, its window is its own span of them and
            # its list holds exactly that window (no ring slots to skip), then its entries
            seq = b // (mQ.shape[0] // mKvw.shape[0])
            wstart = mWstart[b]
            W = cutlass.max(mWlen[b], Int32(0))
            if const_expr(self.mode == "dense"):
                K = cutlass.min(cutlass.max(mIdx[b, 0], Int32(0)), N)   # HCA: entries [0, count)
        n_chunks = (W + K + C - 1) // C
        c_begin = split * n_chunks // n_splits          # balanced: split sizes differ by at most one chunk
        n_mine = (split + 1) * n_chunks // n_splits - c_begin

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
                self.load_chunk(mKvw, mKvc, sbase, b, wlen, W, N, c_begin + st, Int32(st), r, sub,
                                self.fetch_index(mIdx, b, W, K, c_begin + st, r), seq, wstart)
            cute.arch.cp_async_commit_group()
        # CSA: the entry index of this thread's row in the next chunk to load, read one iteration ahead
        # so that its latency is not on the chunk's path (load, then gather)
        idx_next = self.fetch_index(mIdx, b, W, K, c_begin + self.stages - 1, r)

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
            kv = sbase + self.off_kv + slot * self.kv_bytes
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()                       # chunk `it` landed everywhere; chunk it - 1's slot is free
            nxt = it + self.stages - 1
            if nxt < n_mine:
                self.load_chunk(mKvw, mKvc, sbase, b, wlen, W, N, c_begin + nxt, nxt % self.stages, r, sub,
                                idx_next, seq, wstart)
            idx_next = self.fetch_index(mIdx, b, W, K, c_begin + nxt + 1, r)
            cute.arch.cp_async_commit_group()
            warpgroup.fence()
            s = self.s_half(sbase, kv, wg)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            s = self.sum_halves(ptx.fence_operands(s), x_mine, x_other)
            pa = self.softmax(s, o, m_run, l_run, sbase + self.off_bias + slot * (C * 4), c)
            ov = self.p_v(o, pa, kv, wg)
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

        if const_expr(self.cluster > 1):
            self.cluster_merge(o, m_run, l0, l1, sbase, mSink, mOut, b, hb, split, tidx)
        else:
            self.store(o, m_run, l0, l1, mSink, mOut, mOpart, mML, b, hb, split, n_splits, tidx)

    @cute.jit
    def store(self, o: cute.Tensor, m_run: cute.Tensor, l0: Float32, l1: Float32, mSink: cute.Tensor,
              mOut: cute.Tensor, mOpart: cute.Tensor, mML: cute.Tensor, b: Int32, hb: Int32, split: Int32,
              n_splits: Int32, tidx: Int32):
        """No cluster: the normalised BF16 output (one split), else this split's float32 O and (m, l)."""
        n_heads = mOut.shape[1]
        wg = tidx // 128
        t = tidx % 128
        g = (tidx % 32) // 4
        c = tidx % 4
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
    def cluster_merge(self, o: cute.Tensor, m_run: cute.Tensor, l0: Float32, l1: Float32, sbase: Int32,
                      mSink: cute.Tensor, mOut: cute.Tensor, b: Int32, hb: Int32, split: Int32, tidx: Int32):
        """Merge the splits of a head block through distributed shared memory: no partials in HBM, no
        combine kernel (the cluster is all the splits).

        Each CTA puts its unnormalised float32 O [64 heads x 512] over its Q and KV buffers (free once the
        loop is done; 16-byte granules XOR-swizzled by head, so the stores and the reads are free of bank
        conflicts) and its (m, l) per head; after a cluster barrier CTA ``r`` merges heads
        ``[r * 64 / C, (r + 1) * 64 / C)`` from all ``C`` CTAs' tiles, normalises (sink included) and
        writes BF16 ``out``. A second cluster barrier keeps every CTA's shared memory alive until its
        peers have read it."""
        CL = self.cluster
        n_heads = mOut.shape[1]
        wg = tidx // 128
        t = tidx % 128
        g = (tidx % 32) // 4
        c = tidx % 4
        cute.arch.barrier()  # both warpgroups are past their last wgmma: the Q and KV buffers are free
        for hh in cutlass.range_constexpr(2):
            row = (t // 32) * 16 + g + 8 * hh
            for j in cutlass.range_constexpr(32):
                q = wg * 64 + 2 * j + c // 2
                ptx.st_shared_v2_f32(sbase + row * O_ROW + ((q ^ (row % 8)) << 4) + (c % 2) * 8,
                                     o[4 * j + 2 * hh], o[4 * j + 2 * hh + 1])
            if wg == 0:
                if c == 0:
                    ptx.st_shared_v2_f32(sbase + self.off_ml + row * 8, m_run[hh], l0 if hh == 0 else l1)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

        rank = split
        rows = HEADS_PER_CTA // CL
        if tidx < rows:  # the merge weights of one head: 2^(m_s - M) / denominator, M = max(sink, m_s)
            row = rank * rows + tidx
            head = hb * HEADS_PER_CTA + row
            ml = [ptx.ld_cluster_v2_f32(ptx.mapa(sbase + self.off_ml + row * 8, Int32(r))) for r in range(CL)]
            sk = mSink[head] * Float32(LOG2E)
            big = sk
            for r in cutlass.range_constexpr(CL):
                big = cute.arch.fmax(big, ml[r][0])
            f = [ptx.ex2(ml[r][0] - big) for r in range(CL)]
            den = ptx.ex2(sk - big)
            for r in cutlass.range_constexpr(CL):
                den = den + f[r] * ml[r][1]
            inv = Float32(1.0) / den
            for r in cutlass.range_constexpr(CL):
                ptx.st_shared_f32(sbase + self.off_w + (tidx * CL + r) * 4, f[r] * inv)
        cute.arch.barrier()

        # every remote load is issued before the first store (a store would order the next granule's loads
        # after it): 32 16-byte loads per thread whatever the cluster size
        per = GRANULES // CL
        n_k = per // THREADS
        loads = []
        for k in cutlass.range_constexpr(n_k):
            gi = rank * per + k * THREADS + tidx
            row = gi // (HEAD_DIM // 4)
            q = gi % (HEAD_DIM // 4)
            local = sbase + row * O_ROW + ((q ^ (row % 8)) << 4)
            wrow = sbase + self.off_w + (row - rank * rows) * (CL * 4)
            loads.append([(ptx.ld_shared_f32(wrow + r * 4), ptx.ld_cluster_v4_f32(ptx.mapa(local, Int32(r))))
                          for r in range(CL)])
        for k in cutlass.range_constexpr(n_k):
            gi = rank * per + k * THREADS + tidx
            row = gi // (HEAD_DIM // 4)
            q = gi % (HEAD_DIM // 4)
            acc = [Float32(0.0)] * 4
            for w, v in loads[k]:
                acc = [acc[i] + w * v[i] for i in range(4)]
            hrow = Int64(b) * n_heads + Int64(hb * HEADS_PER_CTA + row)
            ptx.st_global_v2_b32(mOut.iterator.toint() + (hrow * HEAD_DIM + Int64(q * 4)) * 2,
                                 ptx.f32x2_to_bf16x2(acc[0], acc[1]), ptx.f32x2_to_bf16x2(acc[2], acc[3]))
        cute.arch.cluster_arrive_relaxed()  # every remote value is consumed: only "done reading" is signalled
        cute.arch.cluster_wait()

    def p_v(self, o: cute.Tensor, pa: cute.Tensor, kv: Int32, wg: Int32) -> list:
        """Issue O += P V over dims 256 wg ..+256 (V read MN-major from the KV buffer); returns the accumulators."""
        ov = [o[i] for i in range(128)]
        warpgroup.fence()
        for ks in range(self.chunk // 16):
            db = ptx.smem_desc_sw128(kv + (wg * 4) * self.kv_block + ks * 16 * ATOM, lbo=self.kv_block)
            ov = ptx.wgmma_bf16_rs(ov, pa[4 * ks], pa[4 * ks + 1], pa[4 * ks + 2], pa[4 * ks + 3], db, tnsp_b=True)
        return ov

    def s_half(self, sbase: Int32, kv: Int32, wg: Int32) -> list:
        """Issue this warpgroup's half of S = Q K^T (dims 256 wg ..+256): 16 k16 steps, both operands in shared."""
        s = [Float32(0.0)] * (self.chunk // 2)
        for ks in range(16):
            blk = wg * 4 + ks // 4
            da = ptx.smem_desc_sw128(sbase + blk * Q_BLOCK + (ks % 4) * 32)
            db = ptx.smem_desc_sw128(kv + blk * self.kv_block + (ks % 4) * 32)
            s = ptx.wgmma_bf16_ss(s, da, db, accumulate=ks > 0)
        return s

    def sum_halves(self, s: list, x_mine: Int32, x_other: Int32) -> list:
        """The full S: this warpgroup's half + the partner thread's (same elements), through shared memory."""
        for q in range(len(s) // 4):
            ptx.st_shared_v4_f32(x_mine + q * 2048, s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3])
        cute.arch.barrier()
        full = []
        for q in range(len(s) // 4):
            v = ptx.ld_shared_v4_f32(x_other + q * 2048)
            full += [s[4 * q + e] + v[e] for e in range(4)]
        return full

    def softmax(self, s: list, o: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, bias: Int32,
                c: Int32) -> cute.Tensor:
        """Online softmax step in log2 units: bias, running max, row sums, O rescaled; returns P as the
        bf16 A fragments of P V (the accumulator fragment of S is the A fragment of the next wgmma)."""
        C = self.chunk
        mx0 = Float32(-math.inf)
        mx1 = Float32(-math.inf)
        for j in range(C // 8):
            bv0, bv1 = ptx.ld_shared_f32x2(bias + (8 * j + 2 * c) * 4)
            s[4 * j] = s[4 * j] * Float32(self.sl2) + bv0
            s[4 * j + 1] = s[4 * j + 1] * Float32(self.sl2) + bv1
            s[4 * j + 2] = s[4 * j + 2] * Float32(self.sl2) + bv0
            s[4 * j + 3] = s[4 * j + 3] * Float32(self.sl2) + bv1
            mx0 = cute.arch.fmax(mx0, cute.arch.fmax(s[4 * j], s[4 * j + 1]))
            mx1 = cute.arch.fmax(mx1, cute.arch.fmax(s[4 * j + 2], s[4 * j + 3]))
        for sh in range(2):
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
        pa = cute.make_rmem_tensor((C // 4,), Int32)
        for j in range(C // 8):
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
        for j in range(32):
            o[4 * j] = o[4 * j] * alpha0
            o[4 * j + 1] = o[4 * j + 1] * alpha0
            o[4 * j + 2] = o[4 * j + 2] * alpha1
            o[4 * j + 3] = o[4 * j + 3] * alpha1
        return pa

    @cute.jit
    def fetch_index(self, mIdx: cute.Tensor, b: Int32, W: Int32, K: Int32, chunk: Int32, r: Int32) -> Int32:
        """The compressed entry row r of ``chunk`` reads ("indexed": ``indices``, else its position past the
        window); -1 where the row is a window slot or past the list."""
        e = chunk * self.chunk + r
        idx = Int32(-1)
        if const_expr(self.mode != "window"):
            if e >= W:
                if e < W + K:
                    idx = e - W
                    if const_expr(self.mode == "indexed"):
                        idx = mIdx[b, e - W]
        return idx

    @cute.jit
    def load_chunk(self, mKvw: cute.Tensor, mKvc: cute.Tensor, sbase: Int32, b: Int32,
                   wlen: Int32, W: Int32, N: Int32, chunk: Int32, slot: Int32,
                   r: Int32, sub: Int32, idx: Int32, seq: Int32, wstart: Int32):
        """Thread (r, sub) gathers ``upt`` of the 64 16-byte pieces of row r of the chunk (``idx``: its
        :meth:`fetch_index`), and its mask bias. Prefill: window entry e is row ``wstart + e`` of sequence ``seq``'s
        rows (zero-filled outside them), entries are ``seq``'s."""
        e = chunk * self.chunk + r
        src = mKvw.iterator.toint()
        nbytes = Int32(0)
        if e < W:
            if const_expr(self.shared):
                row = wstart + e
                if row >= 0:
                    if row < mKvw.shape[1]:
                        nbytes = Int32(16)
                        src = src + (Int64(seq) * mKvw.shape[1] + Int64(row)) * ROW
            else:
                if e < wlen:
                    nbytes = Int32(16)
                    src = src + (Int64(b) * W + Int64(e)) * ROW
        else:
            if const_expr(self.mode != "window"):
                if idx >= 0:
                    if idx < N:
                        nbytes = Int32(16)
                        src = mKvc.iterator.toint() + (Int64(seq) * N + Int64(idx)) * ROW
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


class Sm90PrefillAttention(Sm90DecodeAttention):
    """The split kernel with T query tokens of a sequence as T requests sharing that sequence's key rows
    (contract: ``prefill_attention_reference``), one compiled configuration (``mode``, ``scale``, ``cluster`` as
    :class:`Sm90DecodeAttention`'s).

    Operands (all contiguous): ``q`` bf16 [R, H, 512] (request r of sequence ``r // (R / S)``), ``rows`` bf16
    [S, L, 512], ``window_start`` and ``window_len`` int32 [R] (request r's window: rows ``[start, start + len)`` of
    its sequence; rows outside ``[0, L)`` read as masked), ``kv_compressed`` bf16 [S, N, 512], ``picked`` int32:
    ``"indexed"`` the indices [R, K] into its sequence's entries (-1 pads), ``"dense"`` the count [R, 1] (request r
    sees entries ``[0, count)``), ``sink``, ``out``, ``o_part``, ``ml`` as the decode form's ([R, ...]). A request's
    list is its window's ``window_len`` entries then its K (or count) entries, so a short window or a small count
    costs no chunk of masked entries.
    """

    shared = True

    def key(self) -> tuple:
        return (*super().key(), "prefill")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mRows: cute.Tensor, mWstart: cute.Tensor, mWlen: cute.Tensor,
                 mKvc: cute.Tensor, mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
                 mML: cute.Tensor, stream):
        self.launch_on(self.kernel(mQ, mRows, mWstart, mWlen, mKvc, mIdx, mSink, mOut, mOpart, mML), mQ, mML,
                       stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mRows: cute.Tensor, mWstart: cute.Tensor, mWlen: cute.Tensor,
               mKvc: cute.Tensor, mIdx: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mOpart: cute.Tensor,
               mML: cute.Tensor):
        self.attend(mQ, mRows, mWstart, mWlen, mKvc, mIdx, mSink, mOut, mOpart, mML)


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


def sm90_decode_attention(q, kv_window, window_len, kv_compressed, indices, sink, scale: float, *,
                          out=None, splits: int | None = None, cluster: int | None = None):
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
        cluster: the splits of a head block as one cluster of CTAs that merge through distributed
            shared memory (``CLUSTERS``, then ``splits == cluster``, or 1: each split's partial goes
            through HBM to the combine kernel). Default: ``sm90_heuristics.pick_cluster`` when ``splits``
            is not given, else 1. ``cluster`` alone sets the split count to it.

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
    return _run_splits(Sm90DecodeAttention, mode, scale, q, [kv_window, window_len, kvc, idx], sink, w + k, out,
                       splits, cluster)


def _run_splits(kind: type, mode: str, scale: float, q, keys: list, sink, entries: int, out, splits: int | None,
                cluster: int | None):
    """Launch ``kind``'s split kernel on ``q``, its key operands ``keys`` and ``sink`` (the splits and cluster as
    :func:`sm90_decode_attention` documents them, picked for lists of up to ``entries`` entries), then the combine
    kernel where partials go through HBM; returns ``out`` (allocated when None)."""
    import torch
    b, h, d = q.shape
    if out is None:
        out = torch.empty(b, h, d, dtype=torch.bfloat16, device=q.device)
    _expect(out.dtype == torch.bfloat16 and tuple(out.shape) == (b, h, d) and out.is_contiguous(),
            "out must be contiguous bf16 [B, H, 512]")
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if splits is None:
        splits = pick_splits(b, h, entries, sms)
        if cluster is None:
            cluster = pick_cluster(b, h, entries, sms)
        if cluster is not None and cluster > 1:
            splits = cluster
    cluster = 1 if cluster is None else cluster
    _expect(1 <= splits <= MAX_SPLITS, f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    _expect(cluster == 1 or splits == cluster, f"a cluster holds all the splits: splits={splits}, cluster={cluster}")
    kernel = kind(mode=mode, scale=scale, cluster=cluster)
    parts = splits // cluster          # partials through HBM to the combine kernel (1: none)
    wkey = (q.device, b, h, parts)
    if wkey not in _WORKSPACE:
        o_part = torch.empty((b, h, parts, d) if parts > 1 else (1, 1, 1, 4), dtype=torch.float32, device=q.device)
        _WORKSPACE[wkey] = (o_part, torch.empty(b, h, parts, 2, dtype=torch.float32, device=q.device))
    o_part, ml = _WORKSPACE[wkey]
    _launch(kernel, [q, *keys, sink, out, o_part, ml])
    if parts > 1:
        _launch(Sm90DecodeAttentionCombine(groups=4 if parts >= 8 else 1), [o_part, ml, sink, out])
    return out


MAX_REQUESTS = 65535   # the grid's z (CUDA's limit): requests of one call


def sm90_prefill_attention(q, rows, window_start, window_len, kv_compressed, indices, sink, scale: float, *,
                           count=None, max_window: int | None = None, out=None, splits: int | None = None,
                           cluster: int | None = 1):
    """T query tokens of each of S sequences as R = S * T requests of the decode kernel that share their sequence's
    keys (:class:`Sm90PrefillAttention`) on Hopper (sm_90a); returns BF16 ``out`` [R, H, 512].

    Args (contract and semantics: ``prefill_attention_reference``; everything contiguous, on one GPU):
        q: bf16 [R, H, 512], rotated, H a multiple of 64; request r belongs to sequence ``r // (R / S)``.
        rows: bf16 [S, L, 512], each sequence's window keys (its past window rows, then the chunk's rows).
        window_start, window_len: int32 [R]: request r attends to rows ``[window_start[r], window_start[r] +
            window_len[r])`` of its sequence (its own row included; rows outside ``[0, L)`` count as masked).
        kv_compressed: bf16 [S, N, 512] or None (window-only layer).
        indices: int32 [R, K] into its sequence's ``kv_compressed`` (-1 = padding, anywhere; CSA top-k), or None.
        count: int32 [R] (HCA, with ``indices`` None): request r sees entries ``[0, count[r])`` (clamped to [0, N]);
            None with ``kv_compressed`` and no ``indices``: all N entries.
        sink: float32 [H]. scale: the logit scale (512**-0.5).
        max_window: the most entries a window holds (the model's sliding window), for the split choice only (None:
            L). out, splits, cluster: as :func:`sm90_decode_attention`'s, but ``cluster`` is 1 unless given: a
            prompt's requests fill the SMs from 67 tokens on, where no cluster is picked, and a shorter prompt's
            partials go through the combine kernel, so the load compiles one prefill kernel a mode, not one a
            cluster.

    R is at most ``MAX_REQUESTS``; S must divide R. No host sync; CUDA-graph capturable after one warm-up call (an
    HCA call without ``count`` allocates its all-N counts at each call). The output is not inverse-RoPE'd.
    """
    import torch
    r, h, d = q.shape
    _expect(d == HEAD_DIM and h % HEADS_PER_CTA == 0 and q.dtype == torch.bfloat16,
            f"q must be bf16 [R, H (multiple of {HEADS_PER_CTA}), {HEAD_DIM}], got {q.dtype} {tuple(q.shape)}")
    _expect(0 < r <= MAX_REQUESTS, f"the prefill kernel takes 1 to {MAX_REQUESTS} requests, got {r}")
    _expect(rows.dtype == torch.bfloat16 and rows.dim() == 3 and rows.shape[2] == d and rows.shape[0] > 0
            and r % rows.shape[0] == 0, f"rows must be bf16 [S, L, {d}] with S dividing R={r}, got {rows.dtype} "
            f"{tuple(rows.shape)}")
    s = rows.shape[0]
    for name, t in (("window_start", window_start), ("window_len", window_len)):
        _expect(t.dtype == torch.int32 and tuple(t.shape) == (r,), f"{name} must be int32 [R={r}]")
    _expect(sink.dtype == torch.float32 and tuple(sink.shape) == (h,), f"sink must be float32 [H={h}]")
    k = 0
    if kv_compressed is None:
        _expect(indices is None and count is None, "indices and count need kv_compressed")
        mode, kvc, picked = "window", rows, window_len.view(r, 1)
    else:
        _expect(kv_compressed.dtype == torch.bfloat16 and kv_compressed.dim() == 3 and kv_compressed.shape[0] == s
                and kv_compressed.shape[2] == d, f"kv_compressed must be bf16 [S={s}, N, {d}]")
        kvc, n = kv_compressed, kv_compressed.shape[1]
        if indices is not None:
            _expect(count is None, "give indices (CSA) or count (HCA), not both")
            _expect(indices.dtype == torch.int32 and indices.dim() == 2 and indices.shape[0] == r,
                    f"indices must be int32 [R={r}, K], got {indices.dtype} {tuple(indices.shape)}")
            mode, picked, k = "indexed", indices, indices.shape[1]
        else:
            if count is None:
                count = torch.full((r,), n, dtype=torch.int32, device=q.device)
            _expect(count.dtype == torch.int32 and tuple(count.shape) == (r,), f"count must be int32 [R={r}]")
            mode, picked, k = "dense", count.view(r, 1), n
    for name, t in (("q", q), ("rows", rows), ("window_start", window_start), ("window_len", window_len),
                    ("kv_compressed", kvc), ("indices or count", picked)):
        _expect(t.is_cuda and t.is_contiguous(), f"{name} must be a contiguous CUDA tensor")
    window = rows.shape[1] if max_window is None else min(max_window, rows.shape[1])
    return _run_splits(Sm90PrefillAttention, mode, scale, q, [rows, window_start, window_len, kvc, picked], sink,
                       window + k, out, splits, cluster)


def warmup(modes: tuple[str, ...], heads: int, scale: float, device, *, prefill: tuple[str, ...] = ()) -> int:
    """Compile the split kernel in ``modes`` with every cluster, and both combine kernels (what
    :func:`sm90_decode_attention` can launch for a model with ``heads`` heads and logit ``scale``), and the prefill
    form's in the ``prefill`` modes (what :func:`sm90_prefill_attention` can); returns how many kernels."""
    import torch
    bf = dict(dtype=torch.bfloat16, device=device)
    b, w, n, s = 1, 2, 2, 2  # sizes are dynamic: the kernels specialise on dtypes and ranks
    q, kv, out = torch.empty(b, heads, HEAD_DIM, **bf), torch.empty(b, w, HEAD_DIM, **bf), torch.empty(b, heads, HEAD_DIM, **bf)
    wlen = torch.empty(b, dtype=torch.int32, device=device)
    kvc, idx = torch.empty(b, n, HEAD_DIM, **bf), torch.empty(b, n, dtype=torch.int32, device=device)
    sink = torch.empty(heads, dtype=torch.float32, device=device)
    o_part = torch.empty(b, heads, s, HEAD_DIM, dtype=torch.float32, device=device)
    ml = torch.empty(b, heads, s, 2, dtype=torch.float32, device=device)
    count = 0
    operands = {"window": (kv, wlen.view(b, 1)), "dense": (kvc, wlen.view(b, 1)), "indexed": (kvc, idx)}
    for mode in modes:
        for cluster in CLUSTERS:
            _compile(Sm90DecodeAttention(mode=mode, scale=scale, cluster=cluster),
                     [q, kv, wlen, *operands[mode], sink, out, o_part, ml])
            count += 1
    for mode in prefill:   # window starts beside the lengths; HCA's counts [R, 1] have the indices' dtype and rank
        _compile(Sm90PrefillAttention(mode=mode, scale=scale, cluster=1),   # the prefill host's one cluster
                 [q, kv, wlen, wlen, *operands[mode], sink, out, o_part, ml])
        count += 1
    for groups in (1, 4):
        _compile(Sm90DecodeAttentionCombine(groups), [o_part, ml, sink, out])
        count += 1
    return count

