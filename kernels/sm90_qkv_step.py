"""SM90 (sm_90a) kernel for a decode step's query and key before attention (``ReferenceBackend.step_qkv``): one
launch for every slot, where the reference takes about seven (two RMSNorms, two complex multiplies for RoPE, two
BF16 casts and the ring's scatter) per layer.

Layout (B slots, one token each, H heads, D = head_dim): the query ``q_raw`` f32 [B, H, D] (the ``wq_b`` product
viewed per head) and the key ``kv_raw`` f32 [B, D] (unit column stride, any row and head strides: the key may be a
column slice of a wider product); the key's RMSNorm weight f32 [D]; the SWA ring BF16 [B, W, D] (``runtime/state.py``,
row ``pos % W``); ``positions`` int64 [B] (each slot's tokens before this one, read on the device: no host sync,
capturable in a CUDA graph); ``inv_freq`` f32 [rd / 2]. Out: the query BF16 [B, H, D] (what the decode attention
kernel reads), and the key written BF16 into ``ring[b, positions[b] % W]``; no other ring row is touched.

One CTA per row of D channels (B * H query rows, then B key rows), one thread per RoPE pair (channels 2t, 2t + 1):
D / 2 threads. A row is the unit of the normalisation, so a CTA's one barrier is its own sum of squares; a CTA a slot
would walk H + 1 rows one after the other (65 rows on one SM at B = 1, the decode case where the launch count
matters), where a CTA a row spreads them over the SMs. A thread owning both channels of a pair rotates it in its
registers (no shuffle), and every row is rotated the same way, so the query and key rows differ only in where they
are read and written and in the key's weight.

Numerics, in float32 as the reference: the sum of squares over D in a fixed order (each thread its pair, a butterfly
per warp, the warps' sums through shared memory added in one order by every thread, so every channel of a row is
scaled by the same float), ``rsqrt.approx`` of ``sum / D + eps``, the product by the weight after the scaling (the
key only, as ``rms_norm``); RoPE of the last ``rd`` channels at ``float32(pos) * inv_freq`` rounded as torch rounds
it, cos and sin reduced in float64 (``sm90_ptx.rope_cos_sin``: accurate at positions of millions), ``a cos - b sin,
a sin + b cos`` as the complex multiply of ``rotate_``; the outputs rounded to BF16 to nearest even. Against the
reference rounded to BF16: within one BF16 ulp (float32 rounding differences that land on a rounding boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch

MAX_DIM = 2048   # one thread per channel pair: the most threads of a CTA


@dataclass(frozen=True)
class QkvStepConfig:
    """What a decode step's query-and-key kernel is specialised on (the heads, slots and ring length are not: they
    are read from the operands' shapes).

    Attributes:
        dim: D, the head dimension (the query's per-head width and the key's; V4: 512); D / 2 threads a CTA.
        rope_dim: the last ``rope_dim`` channels of each row are rotated (V4: 64).
        eps: the RMSNorm's epsilon (``rms_norm_eps``).
    """

    dim: int
    rope_dim: int
    eps: float


class Sm90QkvStep:
    """A decode step's query and key for every slot (module docstring), one compiled :class:`QkvStepConfig`.

    Launched as ``fn(q_raw, kv_raw, norm, ring, positions, inv_freq, q_out, stream)`` with the module docstring's
    operands.
    """

    def __init__(self, config: QkvStepConfig):
        _expect(self.can_implement(config), f"query-and-key step {config}: needs D a multiple of 64 up to {MAX_DIM}, "
                f"an even rope_dim up to D and eps >= 0")
        self.config = config
        self.dim, self.rope_dim, self.eps = config.dim, config.rope_dim, float(config.eps)
        self.threads = config.dim // 2

    @staticmethod
    def can_implement(config: QkvStepConfig) -> bool:
        """Whether one CTA of D / 2 threads (whole warps, at most 1024) takes a row, and RoPE pairs are whole thread
        pairs (an even ``rope_dim``, so the rotated channels start at an even channel)."""
        return (config.dim % 64 == 0 and 64 <= config.dim <= MAX_DIM and config.rope_dim % 2 == 0
                and 0 <= config.rope_dim <= config.dim and config.eps >= 0)

    def key(self) -> tuple:
        return (self.config,)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKv: cute.Tensor, mNorm: cute.Tensor, mRing: cute.Tensor, mPos: cute.Tensor,
                 mFreq: cute.Tensor, mOut: cute.Tensor, stream):
        rows = mQ.shape[0] * mQ.shape[1] + mKv.shape[0]
        self.kernel(mQ, mKv, mNorm, mRing, mPos, mFreq, mOut).launch(
            grid=[rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKv: cute.Tensor, mNorm: cute.Tensor, mRing: cute.Tensor, mPos: cute.Tensor,
               mFreq: cute.Tensor, mOut: cute.Tensor):
        t, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        d, rd = self.dim, self.rope_dim
        smem = cutlass.memory.SmemAllocator()
        s_warp = smem.allocate_array(Float32, self.threads // 32, byte_alignment=16).toint()
        heads = mQ.shape[1]
        n_q = mQ.shape[0] * heads
        c = 2 * t

        # 1. the row: query row r (slot b, head h) below B * H, else slot b's key
        b = r - n_q
        h = Int32(0)
        x0 = Float32(0.0)
        x1 = Float32(0.0)
        if r < n_q:
            b = r // heads
            h = r - b * heads
            x0 = mQ[b, h, c]
            x1 = mQ[b, h, c + 1]
        else:
            x0 = mKv[b, c]
            x1 = mKv[b, c + 1]
        pos = mPos[b]

        # 2. RMSNorm: the sum of squares over the D channels (a butterfly per warp, the warps' sums through shared
        #    memory, added in one order by every thread, so that every channel is scaled by the same float)
        ss = ptx.lane_sum(x0 * x0 + x1 * x1)
        if t % 32 == 0:
            ptx.st_shared_f32(s_warp + (t // 32) * 4, ss)
        cute.arch.sync_threads()
        total = ptx.shared_sum_f32(s_warp, self.threads // 32)
        scale = cute.math.rsqrt(total / Float32(d) + Float32(self.eps))
        y0 = x0 * scale
        y1 = x1 * scale
        if r >= n_q:   # the key's weight, after the scaling (the reference's two roundings)
            y0 = y0 * mNorm[c]
            y1 = y1 * mNorm[c + 1]

        # 3. RoPE of the last rd channels: this thread's pair (c, c + 1) is pair t - (d - rd) / 2 of the rotated ones
        o0 = y0
        o1 = y1
        if const_expr(rd > 0):
            first = (d - rd) // 2
            if t >= first:
                cos, sin = ptx.rope_cos_sin(pos, mFreq[t - first])
                o0 = y0 * cos - y1 * sin      # a cos - b sin
                o1 = y0 * sin + y1 * cos      # a sin + b cos

        # 4. BF16 (round to nearest even): the query's row of the output, the key's ring row pos % W
        if r < n_q:
            mOut[b, h, c] = o0.to(BFloat16)
            mOut[b, h, c + 1] = o1.to(BFloat16)
        else:
            slot = Int32(pos % Int64(mRing.shape[1]))
            mRing[b, slot, c] = o0.to(BFloat16)
            mRing[b, slot, c + 1] = o1.to(BFloat16)


def can_implement(dim: int, rope_dim: int, eps: float) -> bool:
    """:meth:`Sm90QkvStep.can_implement` of the configuration these make."""
    return Sm90QkvStep.can_implement(QkvStepConfig(dim, rope_dim, float(eps)))


def sm90_qkv_step(q_raw: torch.Tensor, kv_raw: torch.Tensor, norm_weight: torch.Tensor, ring: torch.Tensor,
                  positions: torch.Tensor, inv_freq: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``ReferenceBackend.step_qkv`` on the GPU, one launch (module docstring): returns the query BF16 [B, H, D]
    (``out`` when given) and writes the key into ``ring``.

    ``q_raw`` f32 [B, H, D], ``kv_raw`` f32 [B, D] (unit column stride), ``norm_weight`` f32 [D], ``ring`` BF16
    [B, W, D] (unit column stride), ``positions`` int64 [B], ``inv_freq`` f32 [rd / 2], ``out`` BF16 [B, H, D] (unit
    column stride). Raises ``KernelArgumentError`` (a ``ValueError``) on any other operand."""
    _expect(q_raw.dim() == 3, f"q_raw must be [B, H, D], got {tuple(q_raw.shape)}")
    b, heads, d = q_raw.shape
    config = QkvStepConfig(dim=d, rope_dim=2 * inv_freq.numel(), eps=float(eps))
    _expect(Sm90QkvStep.can_implement(config), f"query-and-key step {config}: needs D a multiple of 64 up to "
            f"{MAX_DIM}, an even rope_dim up to D and eps >= 0")
    f32 = {"q_raw": (q_raw, (b, heads, d)), "kv_raw": (kv_raw, (b, d)), "norm_weight": (norm_weight, (d,)),
           "inv_freq": (inv_freq, (config.rope_dim // 2,))}
    for name, (x, shape) in f32.items():
        _expect(x.dtype == torch.float32 and tuple(x.shape) == shape and x.is_cuda and x.stride(-1) == 1,
                f"{name} must be CUDA float32 {list(shape)} with unit column stride, got {x.dtype} "
                f"{tuple(x.shape)} stride {x.stride()} on {x.device}")
    _expect(ring.dtype == torch.bfloat16 and ring.dim() == 3 and ring.shape[0] == b and ring.shape[1] >= 1
            and ring.shape[2] == d and ring.is_cuda and ring.stride(-1) == 1,
            f"ring must be CUDA BF16 [{b}, W, {d}] with unit column stride, got {ring.dtype} {tuple(ring.shape)} "
            f"stride {ring.stride()} on {ring.device}")
    _expect(positions.dtype == torch.int64 and tuple(positions.shape) == (b,) and positions.is_cuda,
            f"positions must be CUDA int64 [{b}], got {positions.dtype} {tuple(positions.shape)}")
    if out is None:
        out = torch.empty(b, heads, d, dtype=torch.bfloat16, device=q_raw.device)
    _expect(out.dtype == torch.bfloat16 and tuple(out.shape) == (b, heads, d) and out.is_cuda and out.stride(-1) == 1,
            f"out must be CUDA BF16 [{b}, {heads}, {d}] with unit column stride, got {out.dtype} {tuple(out.shape)}")
    if b == 0:
        return out
    _launch(Sm90QkvStep(config), [q_raw, kv_raw, norm_weight, ring, positions, inv_freq, out])
    return out


def stand_in_operands(config: QkvStepConfig, device: torch.device | str) -> list[torch.Tensor]:
    """Operands of one slot of one head, as the runtime passes them (dtypes, ranks, 16-byte aligned): what a compile
    is specialised on."""
    f32 = dict(dtype=torch.float32, device=device)
    d = config.dim
    return [torch.empty(1, 1, d, **f32), torch.empty(1, d, **f32), torch.empty(d, **f32),
            torch.empty(1, 2, d, dtype=torch.bfloat16, device=device), torch.empty(1, dtype=torch.int64, device=device),
            torch.empty(max(1, config.rope_dim // 2), **f32), torch.empty(1, 1, d, dtype=torch.bfloat16, device=device)]


def warmup(configs, device: torch.device | str) -> int:
    """Compile :func:`sm90_qkv_step`'s kernel for each of ``configs`` (QkvStepConfig: a model's head dimension with
    each of its RoPE widths); returns how many."""
    n = 0
    for config in dict.fromkeys(configs):
        _compile(Sm90QkvStep(config), stand_in_operands(config, device))
        n += 1
    return n
