"""FP8 x FP8 dense linear on Hopper's FP8 tensor cores (``wgmma`` e4m3), for prefill-sized calls.

``out[t, n] = sum_kb sa[t, kb] * sb[n // 128, kb] * (xq[t, kb] . wq[n, kb])``: the activations quantised to E4M3
per 1 x 128 block with a power-of-two scale ``sa`` (:func:`quantize_activations`, as the official inference
quantises the inputs of its FP8 linears), the weights as released (E4M3, 128 x 128 block scales ``sb``, E8M0 or
float32). The dot product of each 128-deep k-block runs on the tensor cores at FP8 rate into a float32 partial
sum, which is scaled and added to the accumulators in registers (the partial sums never leave the thread).

CTA: 128 tokens x 128 weight rows (one block row of weight scales, so ``sb`` is one number per k-block), two
warpgroups of 64 tokens each (``wgmma`` m64 n128 k32, both operands K-major in shared memory, 128-byte swizzled:
a k-block of FP8 is one 128-byte row). All 256 threads stage the tiles with ``cp.async`` (rows past T are zero
filled) into a ring of ``stages`` k-blocks, ``stages - 1`` ahead; one barrier per k-block publishes the landed
block and frees the slot the previous one used. Grid: (N / 128, ceil(T / 128), G).

Operands: ``xq`` uint8 [T, G * K], ``sa`` float32 [T, G * K / 128], ``w`` uint8 [G * N, K], ``sb`` uint8 (E8M0)
or float32 [G * N / 128, K / 128], ``out`` float32 [T, G * N]. Configuration: ``Fp8WgmmaConfig``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
import torch
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import expect as _expect, launch as _launch
from .sm90_config import K_TILE, Fp8WgmmaConfig

THREADS = 256
TILE = 128                     # tokens and weight rows of a CTA; bytes of a k-block's FP8 row
STAGE_BYTES = 2 * TILE * TILE  # a k-block of x and of W
FP8_MAX = 448.0


def fp8_wgmma_violations(config: Fp8WgmmaConfig) -> list[str]:
    """What in ``config`` the kernel does not take (empty: it takes it)."""
    c, bad = config, []
    if c.n <= 0 or c.n % TILE:
        bad.append(f"N={c.n} must be a positive multiple of {TILE}")
    if c.k <= 0 or c.k % K_TILE:
        bad.append(f"K={c.k} must be a positive multiple of {K_TILE}")
    if c.groups < 1:
        bad.append(f"groups must be >= 1, got {c.groups}")
    if not 2 <= c.stages <= 6:
        bad.append(f"stages must be 2..6 (32 KB each), got {c.stages}")
    return bad


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (C a multiple of 128) -> (E4M3 bytes uint8 [T, C], float32 scales [T, C / 128]): each 1 x 128 block
    divided by the power of two at or above its largest magnitude / 448 (exact division), then rounded to E4M3."""
    t, cols = x.shape
    blocks = x.float().view(t, cols // K_TILE, K_TILE)
    amax = blocks.abs().amax(-1).clamp_min(2.0 ** -120)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn)
    return q.view(t, cols).view(torch.uint8), scale


class Sm90Fp8Wgmma:
    """One compiled configuration (module docstring). Launched as ``fn(xq, sa, w, sb, out, stream)``."""

    def __init__(self, config: Fp8WgmmaConfig):
        bad = fp8_wgmma_violations(config)
        _expect(not bad, f"FP8 WGMMA linear {config}: " + "; ".join(bad))
        self.config = config
        self.n, self.k, self.groups, self.stages = config.n, config.k, config.groups, config.stages
        self.k_blocks = config.k // K_TILE

    @staticmethod
    def can_implement(config: Fp8WgmmaConfig) -> bool:
        return not fp8_wgmma_violations(config)

    def key(self) -> tuple:
        return (self.config,)

    @property
    def smem_bytes(self) -> int:
        return self.stages * STAGE_BYTES + 1024   # + alignment of the swizzle atoms

    @cute.jit
    def __call__(self, mXq: cute.Tensor, mSa: cute.Tensor, mW: cute.Tensor, mSb: cute.Tensor, mOut: cute.Tensor,
                 stream):
        m_tiles = (mXq.shape[0] + TILE - 1) // TILE
        self.kernel(mXq, mSa, mW, mSb, mOut).launch(grid=[self.n // TILE, m_tiles, self.groups],
                                                    block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, mXq: cute.Tensor, mSa: cute.Tensor, mW: cute.Tensor, mSb: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bn, bm, group = cute.arch.block_idx()
        T = mXq.shape[0]
        wg = tidx // 128
        warp = tidx % 128 // 32
        lane = tidx % 32
        t0 = bm * TILE
        n0 = group * self.n + bn * TILE       # first weight row (of the stacked [G * N, K])

        smem = cutlass.memory.SmemAllocator()
        sraw = smem.allocate_array(cutlass.Int8, self.smem_bytes, byte_alignment=16).toint()
        sbase = (Int32(sraw) + 1023) & Int32(-1024)

        for st in cutlass.range_constexpr(self.stages - 1):
            if st < self.k_blocks:
                self.load_block(mXq, mW, sbase, st, st, t0, n0, group, T, tidx)
            cute.arch.cp_async_commit_group()

        acc = cute.make_rmem_tensor((64,), Float32)
        acc.fill(0.0)
        # this thread's two token rows of its warpgroup's m64 tile (the accumulators' rows r and r + 8)
        r0 = t0 + wg * 64 + warp * 16 + lane // 4
        r_lo, r_hi = r0, r0 + 8
        if r_lo > T - 1:
            r_lo = T - 1                      # rows past T: their partial sums are 0 and never stored
        if r_hi > T - 1:
            r_hi = T - 1
        sb_row = n0 // TILE

        for kb in cutlass.range(0, self.k_blocks, unroll=1):
            slot = kb % self.stages
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()               # block kb landed everywhere; the slot of kb - 1 is free
            nxt = kb + self.stages - 1
            if nxt < self.k_blocks:
                self.load_block(mXq, mW, sbase, nxt % self.stages, nxt, t0, n0, group, T, tidx)
            cute.arch.cp_async_commit_group()
            # the k-block's scales, loaded before the MMAs so their latency overlaps them
            col = group * self.k_blocks + kb
            s_lo = mSa[r_lo, col]
            s_hi = mSa[r_hi, col]
            if const_expr(self.config.scale_f32):
                sb = Float32(mSb[sb_row, kb])
            else:
                e = Int32(mSb[sb_row, kb])
                bits = e << 23
                if e == 0:
                    bits = Int32(1 << 22)     # E8M0 0 is 2**-127, a float32 subnormal
                sb = ptx.f32_of_bits(bits)
            warpgroup.fence()
            part = self.k_block_product(sbase + slot * STAGE_BYTES, wg)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            part = ptx.fence_operands(part)
            f_lo = s_lo * sb
            f_hi = s_hi * sb
            for j in cutlass.range_constexpr(16):
                acc[4 * j] = acc[4 * j] + part[4 * j] * f_lo
                acc[4 * j + 1] = acc[4 * j + 1] + part[4 * j + 1] * f_lo
                acc[4 * j + 2] = acc[4 * j + 2] + part[4 * j + 2] * f_hi
                acc[4 * j + 3] = acc[4 * j + 3] + part[4 * j + 3] * f_hi
        cute.arch.cp_async_wait_group(0)

        # accumulator 4 j + i: token r0 (i < 2) or r0 + 8, weight row n0 + 8 j + 2 (lane % 4) + i % 2
        out_base = mOut.iterator.toint()
        row_elems = self.n * self.groups
        c2 = (lane % 4) * 2
        for h in cutlass.range_constexpr(2):
            r = r0 + 8 * h
            if r < T:
                row = out_base + (Int64(r) * row_elems + Int64(n0 + c2)) * 4
                for j in cutlass.range_constexpr(16):
                    ptx.st_global_v2_f32(row + j * 32, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1])

    def k_block_product(self, stage: Int32, wg: Int32) -> list:
        """Issue this warpgroup's 64 tokens x 128 rows product of one k-block: 4 ``wgmma`` k32, both operands in
        shared memory; returns the float32 accumulators (pending until the group is waited for)."""
        part = [Float32(0.0)] * 64
        for ks in range(4):
            da = ptx.smem_desc_sw128(stage + wg * (64 * TILE) + ks * 32)
            db = ptx.smem_desc_sw128(stage + TILE * TILE + ks * 32)
            part = ptx.wgmma_e4m3_ss(part, da, db, accumulate=ks > 0)
        return part

    @cute.jit
    def load_block(self, mXq: cute.Tensor, mW: cute.Tensor, sbase: Int32, slot: Int32, kb: Int32, t0: Int32,
                   n0: Int32, group: Int32, T: Int32, tidx: Int32) -> None:
        """Stage k-block ``kb`` of the CTA's 128 x rows and 128 W rows into ``slot``: 16-byte pieces, piece ``seg`` of
        row ``r`` at ``seg ^ (r % 8)`` (128-byte swizzle), x rows past T zero filled."""
        stage = sbase + slot * STAGE_BYTES
        x_row_bytes = self.k * self.groups
        for i in cutlass.range_constexpr(4):
            idx = tidx + THREADS * i
            r = idx // 8
            seg = idx % 8
            dst = (r * TILE) + ((seg ^ (r % 8)) << 4)
            t = t0 + r
            nbytes = Int32(16)
            if t > T - 1:
                t = T - 1
                nbytes = Int32(0)
            src = mXq.iterator.toint() + Int64(t) * x_row_bytes + Int64(group * self.k + kb * TILE + seg * 16)
            ptx.cp_async_16(stage + dst, src, nbytes)
            wsrc = mW.iterator.toint() + Int64(n0 + r) * self.k + Int64(kb * TILE + seg * 16)
            ptx.cp_async_16(stage + TILE * TILE + dst, wsrc, Int32(16))


def sm90_fp8_wgmma_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1,
                          stages: int = 4) -> torch.Tensor:
    """``x`` [T, G * K] (float32 or BF16; quantised here per 1 x 128 block) against FP8 ``weight`` [G * N, K] with
    block scales ``scale`` (E8M0 or float32) -> float32 [T, G * N] (module docstring)."""
    _expect(groups >= 1 and weight.dim() == 2 and weight.shape[0] % groups == 0,
            f"weight rows {tuple(weight.shape)} must split into {groups} groups")
    n, k = weight.shape[0] // groups, weight.shape[1]
    _expect(x.dim() == 2 and x.shape[1] == groups * k and x.shape[0] >= 1,
            f"x must be [T >= 1, G*K={groups * k}], got {tuple(x.shape)}")
    config = Fp8WgmmaConfig(n=n, k=k, groups=groups, stages=stages, scale_f32=scale.dtype == torch.float32)
    xq, sa = quantize_activations(x)
    out = torch.empty(x.shape[0], groups * n, dtype=torch.float32, device=x.device)
    sb = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    _launch(Sm90Fp8Wgmma(config), [xq, sa.contiguous(), weight.view(torch.uint8), sb.contiguous(), out])
    return out
