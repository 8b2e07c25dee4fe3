"""SM90 (sm_90a) kernel for the mHC mixing weights of each token (``mhc_reference.hc_weights``).

Per token the weights are a few dozen numbers (``(2 + hc) * hc`` mixes in, ``hc`` pre, ``hc`` post and
an ``hc x hc`` doubly-stochastic comb out), but the reference reaches them through about 150 small torch
ops per ``hc_pre`` (sigmoids, a softmax, then ``iters - 1`` rounds of row and column sums and divisions), each
a launch on the GPU. Here one thread computes one token's weights entirely in registers, so the whole
chain is one launch. Same formulas in float32; ``exp`` is ``ex2.approx`` of ``x * log2(e)`` (a few ulp
from torch's), and each row or column is multiplied by the reciprocal of its sum: one thread runs the whole chain,
and dividing took an IEEE division (``div.rn.f32``, a branchy sequence that does not overlap the next) per
element, 640 a token at V4's 20 Sinkhorn rounds, against 168 reciprocals.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32

from . import sm90_ptx as ptx
from .sm90_ptx import LOG2E
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch

THREADS = 128
MAX_HC = 8                             # streams per token the kernel unrolls (V4: 4)


def _exp(x: Float32) -> Float32:
    return ptx.ex2(x * Float32(LOG2E))


def _sigmoid(x: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + _exp(-x))


def _sum(values: list) -> Float32:
    """Left to right, as the unrolled code adds them."""
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


class Sm90HcWeights:
    """``hc_weights`` for one (hc, iters, hc_eps); one thread per token.

    Operands: ``mixes`` f32 [N, (2+hc)*hc], ``base`` f32 [(2+hc)*hc], ``scale`` f32 [3], ``pre`` f32
    [N, hc], ``post`` f32 [N, hc], ``comb`` f32 [N, hc*hc] (row-major hc x hc), all contiguous.
    """

    @staticmethod
    def can_implement(hc: int) -> bool:
        """Whether the kernel unrolls ``hc`` streams per token."""
        return 1 <= hc <= MAX_HC

    def __init__(self, *, hc: int, iters: int, hc_eps: float):
        if not self.can_implement(hc) or iters < 1:
            raise ValueError(f"hc must be in [1, {MAX_HC}] and iters >= 1, got hc={hc}, iters={iters}")
        self.hc, self.iters, self.eps = hc, iters, float(hc_eps)

    def key(self) -> tuple:
        return (self.hc, self.iters, self.eps)

    @cute.jit
    def __call__(self, mMix: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor, mPre: cute.Tensor,
                 mPost: cute.Tensor, mComb: cute.Tensor, stream):
        self.kernel(mMix, mBase, mScale, mPre, mPost, mComb).launch(
            grid=[(mMix.shape[0] + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mMix: cute.Tensor, mBase: cute.Tensor, mScale: cute.Tensor, mPre: cute.Tensor,
               mPost: cute.Tensor, mComb: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        t = bx * THREADS + tidx
        if t < mMix.shape[0]:
            self.token(mMix, mBase, mScale, mPre, mPost, mComb, t)

    def token(self, mMix, mBase, mScale, mPre, mPost, mComb, t) -> None:
        hc, eps = self.hc, Float32(self.eps)
        s0, s1, s2 = mScale[0], mScale[1], mScale[2]
        for i in range(hc):
            mPre[t, i] = _sigmoid(mMix[t, i] * s0 + mBase[i]) + eps
            mPost[t, i] = Float32(2.0) * _sigmoid(mMix[t, hc + i] * s1 + mBase[hc + i])
        comb = []
        for i in range(hc):  # softmax of each row of logits, + eps
            row = [mMix[t, 2 * hc + i * hc + j] * s2 + mBase[2 * hc + i * hc + j] for j in range(hc)]
            mx = row[0]
            for j in range(1, hc):
                mx = cute.arch.fmax(mx, row[j])
            e = [_exp(v - mx) for v in row]
            inv = Float32(1.0) / _sum(e)
            comb.append([v * inv + eps for v in e])
        comb = self.normalise_columns(comb)
        for _ in range(self.iters - 1):
            comb = self.normalise_rows(comb)
            comb = self.normalise_columns(comb)
        for i in range(hc):
            for j in range(hc):
                mComb[t, i * hc + j] = comb[i][j]

    def normalise_rows(self, c: list) -> list:
        eps = Float32(self.eps)
        out = []
        for row in c:
            inv = Float32(1.0) / (_sum(row) + eps)
            out.append([v * inv for v in row])
        return out

    def normalise_columns(self, c: list) -> list:
        eps = Float32(self.eps)
        hc = self.hc
        invs = [Float32(1.0) / (_sum([row[j] for row in c]) + eps) for j in range(hc)]
        return [[c[i][j] * invs[j] for j in range(hc)] for i in range(hc)]


def sm90_hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc: int, iters: int,
                    hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_reference.hc_weights`` on the GPU: mixes f32 [..., (2+hc)*hc] -> (pre [..., hc], post
    [..., hc], comb [..., hc, hc]) in one launch."""
    lead, m = mixes.shape[:-1], mixes.shape[-1]
    _expect(m == (2 + hc) * hc and mixes.is_cuda, f"mixes must be CUDA [..., (2+hc)*hc = {(2 + hc) * hc}], got {tuple(mixes.shape)}")
    flat = mixes.float().reshape(-1, m).contiguous()
    n = flat.shape[0]
    pre = torch.empty(n, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc * hc, dtype=torch.float32, device=mixes.device)
    if n:
        # the reference runs the first column normalisation whatever ``iters``: 0 rounds of Sinkhorn after it == 1
        _launch(Sm90HcWeights(hc=hc, iters=max(iters, 1), hc_eps=hc_eps),
                [flat, base.float().contiguous(), scale.float().contiguous(), pre, post, comb])
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def warmup(hc: int, iters: int, hc_eps: float, device) -> int:
    """Compile the kernel :func:`sm90_hc_weights` launches for these settings; returns 1."""
    m = (2 + hc) * hc
    f32 = dict(dtype=torch.float32, device=device)
    _compile(Sm90HcWeights(hc=hc, iters=max(iters, 1), hc_eps=hc_eps),
             [torch.empty(1, m, **f32), torch.empty(m, **f32), torch.empty(3, **f32), torch.empty(1, hc, **f32),
              torch.empty(1, hc, **f32), torch.empty(1, hc * hc, **f32)])
    return 1

