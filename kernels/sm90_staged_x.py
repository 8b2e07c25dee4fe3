"""SM90 kernel that writes BF16 activation rows in the ``"staged"`` K order (``k_order``) the WGMMA MoE kernels read.

``k_order.to_order(x, "staged")`` is the reference: a torch copy through a 7-axis permuted view, which moves
2-byte elements and ran at about 1.2 TB/s on an H200 (V4-Flash T = 4096: 55 us for 32 MiB; docs/benchmarks.md).
Here each thread owns one 128-element block (256 bytes) of the flat [T, K] array (K a multiple of 128, so
blocks never straddle rows): 16 16-byte loads, one ``prmt`` per 32-bit output word, 16 16-byte stores.

Staged word ``16 w + 8 u + 4 hi + c`` holds the ``hi`` halves of logical words ``16 c + 4 w + u`` and
``16 c + 4 w + 2 + u`` (logical k = 32 c + 8 w + 4 e + 2 u + hi, stored at 32 w + 16 u + 8 hi + 2 c + e).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from . import sm90_ptx as ptx

THREADS = 256
_BLOCK_BYTES = 256  # 128 BF16 elements


class Sm90StagedCopy:
    """``out`` = ``x`` in the "staged" K order; both BF16, contiguous, the same shape [..., K], K % 128 == 0."""

    def key(self) -> tuple:
        return ("staged_copy",)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, stream):
        blocks = cute.size(mX.shape) // 128
        self.kernel(mX, mOut, blocks).launch(grid=[(blocks + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1],
                                             stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        b = bx * THREADS + tidx
        if b < blocks:
            src = mX.iterator.toint() + Int64(b) * _BLOCK_BYTES
            dst = mOut.iterator.toint() + Int64(b) * _BLOCK_BYTES
            words = [v for q in range(16) for v in ptx.ld_global_v4(src + q * 16)]
            for q in cutlass.range_constexpr(16):
                out = [ptx.prmt(*_sources(words, 4 * q + i)) for i in range(4)]
                ptx.st_global_v4_b32(dst + q * 16, *out)


def _sources(words: list, s: int) -> tuple:
    """The ``prmt`` operands of staged word ``s = 16 w + 8 u + 4 hi + c``: the ``hi`` halves of logical words
    ``16 c + 4 w + u`` and ``16 c + 4 w + 2 + u``."""
    w, u, hi, c = s // 16, (s // 8) % 2, (s // 4) % 2, s % 4
    return words[16 * c + 4 * w + u], words[16 * c + 4 * w + 2 + u], 0x7632 if hi else 0x5410
