"""The permute of activations into the ``"staged"`` K order (``k_order``) on the GPU, before the WGMMA L1.

:func:`k_order.to_order` as a torch copy through a 6-axis permuted view took 89 us for V4-Pro's x at T = 4096
(117 MB moved) on an H200 after an L2 flush, this kernel 51 us (a plain copy of x 32 us; two to eight quarters a
thread, or 128-thread CTAs, measured the same), the whole time before L1 (the routing runs beside it). A thread moves one
quarter of a 128-element block: with the block split as k = 32 c + 8 w + 4 e + 2 u + hi, thread (block, w) loads the
four 16-byte runs (c, w) (words 16 c + 4 w .. + 3), and stores the staged chunks 4 w .. 4 w + 3, 64 contiguous
bytes: chunk 4 w + 2 u + hi holds, for c = 0..3, the half ``hi`` of the words (c, w, u) and (c, w, u + 2), one
``prmt`` each (:func:`sm90_moe_gemm.lane_words`). Rows are contiguous and K a multiple of 128, so the blocks of all
rows are walked as one flat range.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from . import sm90_ptx as ptx
from .sm90_moe_gemm import lane_words

THREADS = 256


class Sm90StagedOrder:
    """``out`` [T, K] bf16 = ``to_order(x, "staged")`` for contiguous ``x`` [T, K] bf16, K a multiple of 128."""

    def key(self) -> tuple:
        return ()

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, stream):
        quarters = mX.shape[0] * (mX.shape[1] // 32)
        self.kernel(mX, mOut, quarters).launch(grid=[(quarters + THREADS - 1) // THREADS, 1, 1],
                                               block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, quarters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        q = bidx * THREADS + tidx
        if q < quarters:
            src = mX.iterator.toint() + Int64(q // 4) * 256 + Int64(q % 4 * 16)
            runs = [ptx.ld_global_v4(src + Int64(64 * c)) for c in range(4)]
            dst = mOut.iterator.toint() + Int64(q // 4) * 256 + Int64(q % 4 * 64)
            for u in cutlass.range_constexpr(2):
                pairs = [lane_words(runs[c][u], runs[c][u + 2]) for c in range(4)]
                for hi in cutlass.range_constexpr(2):
                    ptx.st_global_v4_b32(dst + Int64(16 * (2 * u + hi)), *(pairs[c][hi] for c in range(4)))
