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

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .sm90_ptx import LOG2E
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch

HC_SIZES = (1, 2, 4)                   # streams per token: a power of two whose comb fits one warp (V4: 4)
PRE_THREADS = 1024                     # Sm90HcPre: threads of a token's CTA (V4-Flash: one 16-byte load a stream)
NORM_CHUNKS = 2                        # Sm90HcPre with the norm: 16-byte pieces of the collapse a thread holds ...
NORM_MAX_HIDDEN = NORM_CHUNKS * PRE_THREADS * 4   # ... so H up to 8192 (V4-Flash 4096, V4-Pro 7168)


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


def sm90_hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
                hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_reference.hc_pre`` on the GPU: streams x [..., hc, H] -> (sublayer input [..., H], post [..., hc], comb
    [..., hc, hc]), all float32: the product by ``fn`` (cuBLAS), then one launch. With ``norm_weight`` [H] the
    sublayer input comes RMS-normalised (eps ``norm_eps``) and scaled by it, in the same launch."""
    *lead, hc, h = x.shape
    m = (2 + hc) * hc
    _expect(x.is_cuda and tuple(fn.shape) == (m, hc * h), f"x must be CUDA [..., hc, H] and fn [(2+hc)*hc = {m}, "
            f"hc*H], got x {tuple(x.shape)}, fn {tuple(fn.shape)}")
    norm = norm_weight is not None
    _expect(Sm90HcPre.can_implement(hc, h, norm), f"x must have {HC_SIZES} streams of a width divisible by 4 (at "
            f"most {NORM_MAX_HIDDEN} with the norm), got {tuple(x.shape)}")
    if norm:
        _expect(tuple(norm_weight.shape) == (h,), f"norm_weight must be [{h}], got {tuple(norm_weight.shape)}")
    flat = x.float().reshape(-1, hc * h).contiguous()   # a copy only of the embedding's broadcast streams
    if flat.data_ptr() % 16:                             # a view at an odd offset: the kernel loads 16 bytes
        flat = flat.clone()
    n = flat.shape[0]
    mm = flat @ fn.float().T
    out = torch.empty(n, h, dtype=torch.float32, device=x.device)
    pre = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc * hc, dtype=torch.float32, device=x.device)
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
