"""GPU routing glue of the SM90 MoE: bucket (token, slot) pairs by expert and cut work tiles.

One CTA (1024 threads), one launch, no host sync, fixed-size outputs (CUDA-graph capturable):

* inputs: ``topk_ids`` [P] (int32 or int64; P = T * k, row-major over [T, k]) and
  ``topk_weights`` [P] float32;
* ``token_of`` int32 [P]: for sorted position q, the token of the q-th pair in expert order
  (experts ascending; inside an expert, arrival order of a shared-memory atomic, so not fixed);
* ``weight_of`` float32 [P]: that pair's routing weight;
* ``tiles`` int32 [max_tiles, 3]: (expert, begin, end) slices of the sorted pairs of at most
  ``tile_tokens`` each, experts ascending; ``num_tiles`` int32 [1] how many are valid;
* ``rank`` int32 [P]: workspace.

``max_tiles`` must be at least ``P // tile_tokens + min(E, P)`` (:func:`max_tiles_for`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 1024
BATCH = 8  # pairs a thread loads before it uses the first
MAX_EXPERTS = 32 * 64  # experts a CTA counts (64 per lane of a warp)


def max_tiles_for(pairs: int, experts: int, tile_tokens: int) -> int:
    """Upper bound on the number of work tiles: sum over experts of ceil(n_e / tile_tokens)."""
    return pairs // tile_tokens + min(experts, pairs)


class Sm90MoeRouting:
    """Counting sort of the routed pairs by expert, and the tile list the grouped GEMMs walk."""

    def __init__(self, *, experts: int, top_k: int, tile_tokens: int):
        if not 1 <= experts <= MAX_EXPERTS:
            raise ValueError(f"1 to {MAX_EXPERTS} experts, got {experts}")
        self.experts, self.top_k, self.bn = experts, top_k, tile_tokens
        self.seg = (experts + 31) // 32

    def key(self) -> tuple:
        return (self.experts, self.top_k, self.bn)

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mW: cute.Tensor, mTok: cute.Tensor, mWOut: cute.Tensor,
                 mTiles: cute.Tensor, mNumTiles: cute.Tensor, mRank: cute.Tensor, stream):
        self.kernel(mIds, mW, mTok, mWOut, mTiles, mNumTiles, mRank).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mW: cute.Tensor, mTok: cute.Tensor, mWOut: cute.Tensor,
               mTiles: cute.Tensor, mNumTiles: cute.Tensor, mRank: cute.Tensor):
        cute.arch.griddepcontrol_launch_dependents()  # L1 (launched with PDL) may start; it waits for this grid
        E, bn = self.experts, self.bn
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        n_pairs = mIds.shape[0]
        smem = cutlass.memory.SmemAllocator()
        s_cnt = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        s_off = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        s_toff = smem.allocate_tensor(Int32, cute.make_layout(E), 16)

        for e in cutlass.range(tidx, E, THREADS, unroll=1):
            s_cnt[e] = Int32(0)
        cute.arch.sync_threads()
        # BATCH pairs a thread: their loads first, then the atomics (V4-Pro T = 4096 after an L2 flush, on an H200: 64 ->
        # 58 us with 8, 62 with 16)
        for p0 in cutlass.range(tidx, n_pairs, THREADS * BATCH, unroll=1):
            ids = cute.make_rmem_tensor((BATCH,), Int32)
            for b in cutlass.range_constexpr(BATCH):
                if p0 + b * THREADS < n_pairs:
                    ids[b] = Int32(mIds[p0 + b * THREADS])
            for b in cutlass.range_constexpr(BATCH):
                p = p0 + b * THREADS
                if p < n_pairs:
                    mRank[p] = cute.arch.atomic_add((s_cnt.iterator + ids[b]).llvm_ptr, Int32(1))
        cute.arch.sync_threads()

        if warp == 0:
            # exclusive scans of counts and tile counts: a serial segment per lane, then a warp scan
            lo = lane * self.seg
            hi = lo + self.seg
            if hi > E:
                hi = E
            tot = Int32(0)
            ttot = Int32(0)
            for e in cutlass.range(lo, hi, unroll=1):
                n = s_cnt[e]
                tot += n
                ttot += (n + bn - 1) // bn
            inc = tot
            tinc = ttot
            for d in cutlass.range_constexpr(5):
                v = cute.arch.shuffle_sync_up(inc, 1 << d)
                tv = cute.arch.shuffle_sync_up(tinc, 1 << d)
                if lane >= (1 << d):
                    inc += v
                    tinc += tv
            run = inc - tot
            trun = tinc - ttot
            for e in cutlass.range(lo, hi, unroll=1):
                n = s_cnt[e]
                s_off[e] = run
                s_toff[e] = trun
                run += n
                trun += (n + bn - 1) // bn
            if lane == 31:
                mNumTiles[0] = tinc
        cute.arch.sync_threads()

        for e in cutlass.range(tidx, E, THREADS, unroll=1):
            n = s_cnt[e]
            base = s_off[e]
            t0 = s_toff[e]
            for j in cutlass.range(0, (n + bn - 1) // bn, unroll=1):
                b = base + j * bn
                stop = b + bn
                if stop > base + n:
                    stop = base + n
                mTiles[t0 + j, 0] = e
                mTiles[t0 + j, 1] = b
                mTiles[t0 + j, 2] = stop
        for p0 in cutlass.range(tidx, n_pairs, THREADS * BATCH, unroll=1):
            ids = cute.make_rmem_tensor((BATCH,), Int32)
            ranks = cute.make_rmem_tensor((BATCH,), Int32)
            wts = cute.make_rmem_tensor((BATCH,), Float32)
            for b in cutlass.range_constexpr(BATCH):
                p = p0 + b * THREADS
                if p < n_pairs:
                    ids[b] = Int32(mIds[p])
                    ranks[b] = mRank[p]
                    wts[b] = mW[p]
            for b in cutlass.range_constexpr(BATCH):
                p = p0 + b * THREADS
                if p < n_pairs:
                    q = s_off[ids[b]] + ranks[b]
                    mTok[q] = p // self.top_k
                    mWOut[q] = wts[b]
