"""SM90 (sm_90a) kernel for a decode step's compressor update (``ReferenceBackend.compress_step``): one launch for
every slot of one compressor, where the reference takes about 20 torch ops (a launch each on the GPU; 3 compressors a
layer of ``flash-layer``, about 60 launches a step).

Layout (``runtime/state.py``): a token's projections ``kv``, ``gate`` f32 [B, C] (unit column stride, any row
stride: they may be column slices of one wider product) go to slot ``s = pos % ratio`` of ``pending_kv`` /
``pending_gate`` f32 [B, ratio, C]; the window is pooled into entry ``w = pos // ratio`` of ``store`` BF16
[B, max_context // ratio + 1, d]. HCA: C = d, the window's ``ratio`` slots. CSA (``overlap``): C = 2d, the entry
pools ``2 * ratio`` slots, the previous window's first half ("Ca": ``prev_kv`` / ``prev_gate`` f32 [B, ratio, d],
the gate with ``ape`` already added, -inf before the first window closes) and this window's second half ("Cb",
channels ``d + c``); where the window closes (``s == ratio - 1``) this window's Ca half (kv, and gate + ape) moves
into ``prev``. ``ape`` f32 [ratio, C], the RMSNorm weight f32 [d], ``positions`` int64 [B] (read on the device: no
host sync, capturable in a CUDA graph), ``inv_freq`` f32 [rd / 2].

One CTA per slot, one thread per entry channel ``c`` (d threads): the thread owns channel ``c`` (and ``d + c`` with
the overlap) of every row it touches, so it writes the token into pending, pools, and moves the Ca half without a
barrier: every pending or prev value it reads is one it wrote itself or one an earlier launch wrote, and the new
token's values come from its registers. The one barrier is the RMSNorm's sum of squares (warp shuffles, then one
float per warp through shared memory, summed in the same order by every thread). RoPE pairs ``(2i, 2i + 1)`` of the
last ``rd`` channels are neighbouring lanes: the partner's value is one shuffle (xor 1) away.

Numerics, in float32 as the reference: the pooling is an online softmax over the slots (the first slot of this
window first: it is finite, so a -inf gate of an empty ``prev`` weighs 0 without a NaN), ``exp`` as ``ex2.approx``
of ``x * log2(e)``; the sum of squares over d, ``rsqrt.approx``; cos and sin of ``float32(w * ratio) * inv_freq``
rounded as torch rounds it, reduced in float64 (``sm90_ptx.rope_cos_sin``: accurate at positions of millions,
where ``sin.approx`` is not); the entry rounded to BF16 to nearest even. Against the reference: pending and prev
bit for bit (copies and one float add), the entry within one BF16 ulp (float32 rounding differences that land on a
rounding boundary). The entry is written where the window does not close too (the reference does: only a closed
window's row is read); a row past the store (a position beyond ``max_context``) is not written.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import CompressStepConfig
from .sm90_ptx import LOG2E

MAX_DIM = 1024     # one thread per entry channel: the most threads of a CTA
SLOT_UNROLL = 8    # slots of the window loop unrolled (HCA pools 128: loads in flight ahead of the softmax chain)


def _exp(x: Float32) -> Float32:
    return ptx.ex2(x * Float32(LOG2E))


def _pick(own: cutlass.Boolean, reg: Float32, loaded: Float32) -> Float32:
    """The new token's value (``reg``) in its own slot, else the slot's value as loaded."""
    return Float32(cutlass.select_(own, reg, loaded))


def _online(m: Float32, den: Float32, acc: Float32, g: Float32, v: Float32) -> tuple[Float32, Float32, Float32]:
    """One slot (gate ``g``, value ``v``) into a running softmax-weighted sum: max ``m`` (finite), denominator
    ``den``, numerator ``acc``; a -inf gate adds 0."""
    m_new = cute.arch.fmax(m, g)
    scale = _exp(m - m_new)
    p = _exp(g - m_new)
    return m_new, den * scale + p, acc * scale + p * v


class Sm90CompressStep:
    """A decode step's compressor update for every slot (module docstring), one compiled
    :class:`~nvfp4_megamoe.kernels.sm90_config.CompressStepConfig`.

    Launched as ``fn(kv, gate, pending_kv, pending_gate, prev_kv, prev_gate, store, ape, norm, positions, inv_freq,
    stream)`` with the module docstring's operands; without the overlap ``prev_kv`` / ``prev_gate`` are any f32
    rank-3 tensors, not read.
    """

    def __init__(self, config: CompressStepConfig):
        _expect(self.can_implement(config), f"compressor step {config}: needs ratio >= 1, d a multiple of 32 up to "
                f"{MAX_DIM}, an even rope_dim up to d and eps >= 0")
        self.config = config
        self.ratio, self.dim, self.overlap, self.rope_dim = config.ratio, config.dim, config.overlap, config.rope_dim
        self.eps = float(config.eps)
        self.threads = config.dim

    @staticmethod
    def can_implement(config: CompressStepConfig) -> bool:
        """Whether one CTA of d threads (whole warps, at most ``MAX_DIM``) takes the shape, and RoPE pairs are whole
        lane pairs (an even ``rope_dim``, so the rotated channels start at an even channel)."""
        return (config.ratio >= 1 and config.dim % 32 == 0 and 32 <= config.dim <= MAX_DIM
                and config.rope_dim % 2 == 0 and 0 <= config.rope_dim <= config.dim and config.eps >= 0)

    def key(self) -> tuple:
        return (self.config,)

    @cute.jit
    def __call__(self, mKv: cute.Tensor, mGate: cute.Tensor, mPendKv: cute.Tensor, mPendGate: cute.Tensor,
                 mPrevKv: cute.Tensor, mPrevGate: cute.Tensor, mStore: cute.Tensor, mApe: cute.Tensor,
                 mNorm: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor, stream):
        self.kernel(mKv, mGate, mPendKv, mPendGate, mPrevKv, mPrevGate, mStore, mApe, mNorm, mPos, mFreq).launch(
            grid=[mKv.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKv: cute.Tensor, mGate: cute.Tensor, mPendKv: cute.Tensor, mPendGate: cute.Tensor,
               mPrevKv: cute.Tensor, mPrevGate: cute.Tensor, mStore: cute.Tensor, mApe: cute.Tensor,
               mNorm: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor):
        c, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        ratio, d, rd = self.ratio, self.dim, self.rope_dim
        smem = cutlass.memory.SmemAllocator()
        s_warp = smem.allocate_array(Float32, d // 32, byte_alignment=16).toint()
        pos = mPos[b]
        slot = Int32(pos % ratio)
        row = pos // ratio
        cb = c + d * int(self.overlap)   # the channel pooled from this window (CSA: its Cb half)

        # 1. the token into its slot of the open window (Ca too with the overlap: it moves to prev at the close)
        kv_b = mKv[b, cb]
        gate_b = mGate[b, cb]
        mPendKv[b, slot, cb] = kv_b
        mPendGate[b, slot, cb] = gate_b
        kv_a = Float32(0.0)
        gate_a = Float32(0.0)
        if const_expr(self.overlap):
            kv_a = mKv[b, c]
            gate_a = mGate[b, c]
            mPendKv[b, slot, c] = kv_a
            mPendGate[b, slot, c] = gate_a

        # 2. the pooled channel: softmax over the slots of gate + ape, online. Slot 0 of this window starts it: a
        #    finite gate, so the running max is finite before prev's gates (-inf before the first close) come in.
        #    Every slot is loaded, the token's own too (what this thread stored above, unused): loads without a
        #    branch, so that the unrolled slots' loads are all in flight before the softmax chain needs them.
        m = _pick(slot == 0, gate_b, mPendGate[b, 0, cb]) + mApe[0, cb]
        den = Float32(1.0)
        acc = _pick(slot == 0, kv_b, mPendKv[b, 0, cb])
        for j in cutlass.range(1, ratio, unroll=SLOT_UNROLL):
            g = _pick(slot == j, gate_b, mPendGate[b, j, cb])
            m, den, acc = _online(m, den, acc, g + mApe[j, cb], _pick(slot == j, kv_b, mPendKv[b, j, cb]))
        if const_expr(self.overlap):
            for j in cutlass.range(ratio, unroll=SLOT_UNROLL):   # prev's gates hold ape already
                m, den, acc = _online(m, den, acc, mPrevGate[b, j, c], mPrevKv[b, j, c])
        pooled = acc / den

        # 3. the window closes: its Ca half (the new token's from registers) becomes prev, after prev was read above
        #    (the same thread's loads and stores of the same addresses: program order)
        if const_expr(self.overlap):
            if slot == ratio - 1:
                for k in cutlass.range(ratio - 1, unroll=SLOT_UNROLL):
                    mPrevKv[b, k, c] = mPendKv[b, k, c]
                    mPrevGate[b, k, c] = mPendGate[b, k, c] + mApe[k, c]
                mPrevKv[b, ratio - 1, c] = kv_a
                mPrevGate[b, ratio - 1, c] = gate_a + mApe[ratio - 1, c]

        # 4. RMSNorm: the sum of squares over the d channels (a butterfly per warp, the warps' sums through shared
        #    memory, added in one order by every thread, so that every channel is scaled by the same float)
        ss = pooled * pooled
        for sh in cutlass.range_constexpr(5):
            ss = ss + cute.arch.shuffle_sync_bfly(ss, 1 << sh)
        if c % 32 == 0:
            ptx.st_shared_f32(s_warp + (c // 32) * 4, ss)
        cute.arch.sync_threads()
        total = ptx.ld_shared_f32(s_warp)
        for w in cutlass.range_constexpr(1, d // 32):
            total = total + ptx.ld_shared_f32(s_warp + w * 4)
        y = pooled * cute.math.rsqrt(total / Float32(d) + Float32(self.eps)) * mNorm[c]

        # 5. RoPE of the last rd channels at the entry's position w * ratio: pair (2i, 2i + 1) is the lanes (c, c ^ 1)
        #    (rd and d even); every lane shuffles, the rotated warps use it
        out = y
        if const_expr(rd > 0):
            partner = cute.arch.shuffle_sync_bfly(y, 1)
            if c >= d - rd:
                cos, sin = ptx.rope_cos_sin(row * ratio, mFreq[(c - (d - rd)) // 2])
                if c % 2 == 0:
                    out = y * cos - partner * sin      # a cos - b sin
                else:
                    out = partner * sin + y * cos      # a sin + b cos

        # 6. the entry, BF16 (round to nearest even), where the store has its row
        if row < Int64(mStore.shape[1]):
            mStore[b, Int32(row), c] = out.to(BFloat16)


def sm90_compress_step(kv: torch.Tensor, gate: torch.Tensor, pending_kv: torch.Tensor, pending_gate: torch.Tensor,
                       prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None, store: torch.Tensor,
                       ape: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                       ratio: int, eps: float) -> None:
    """``ReferenceBackend.compress_step`` of one compressor on the GPU, in place, one launch (module docstring).

    ``kv``, ``gate`` f32 [B, C] (unit column stride), ``pending_kv`` / ``pending_gate`` f32 [B, ratio, C], ``prev_kv``
    / ``prev_gate`` f32 [B, ratio, d] (CSA; None: HCA), ``store`` BF16 [B, rows, d], ``ape`` f32 [ratio, C],
    ``norm_weight`` f32 [d], ``positions`` int64 [B] (each slot's tokens before this one), ``inv_freq`` f32 [rd / 2];
    C = 2d with ``prev``, else d. Raises ``KernelArgumentError`` (a ``ValueError``) on any other operand."""
    overlap = prev_kv is not None
    _expect(store.dim() == 3 and store.dtype == torch.bfloat16 and store.is_cuda,
            f"store must be CUDA BF16 [B, rows, d], got {store.dtype} {tuple(store.shape)}")
    b, d = store.shape[0], store.shape[-1]
    c = 2 * d if overlap else d
    config = CompressStepConfig(ratio=ratio, dim=d, overlap=overlap, rope_dim=2 * inv_freq.numel(), eps=float(eps))
    _expect(Sm90CompressStep.can_implement(config), f"compressor step {config}: needs ratio >= 1, d a multiple of "
            f"32 up to {MAX_DIM}, an even rope_dim up to d and eps >= 0")
    f32 = {"kv": (kv, (b, c)), "gate": (gate, (b, c)), "pending_kv": (pending_kv, (b, ratio, c)),
           "pending_gate": (pending_gate, (b, ratio, c)), "ape": (ape, (ratio, c)), "norm_weight": (norm_weight, (d,)),
           "inv_freq": (inv_freq, (config.rope_dim // 2,))}
    if overlap:
        _expect(prev_gate is not None, "prev_kv and prev_gate come together (CSA) or not at all (HCA)")
        f32.update(prev_kv=(prev_kv, (b, ratio, d)), prev_gate=(prev_gate, (b, ratio, d)))
    else:
        _expect(prev_gate is None, "prev_kv and prev_gate come together (CSA) or not at all (HCA)")
    for name, (t, shape) in f32.items():
        _expect(t.dtype == torch.float32 and tuple(t.shape) == shape and t.is_cuda and t.stride(-1) == 1,
                f"{name} must be CUDA float32 {list(shape)} with unit column stride, got {t.dtype} "
                f"{tuple(t.shape)} stride {t.stride()} on {t.device}")
    _expect(store.stride(-1) == 1, f"store must have a unit column stride, got {store.stride()}")
    _expect(positions.dtype == torch.int64 and tuple(positions.shape) == (b,) and positions.is_cuda,
            f"positions must be CUDA int64 [{b}], got {positions.dtype} {tuple(positions.shape)}")
    if b == 0:
        return
    # HCA: pending stands in for prev (same dtype and rank, never read), so that one signature serves both
    prev = (prev_kv, prev_gate) if overlap else (pending_kv, pending_gate)
    _launch(Sm90CompressStep(config), [kv, gate, pending_kv, pending_gate, *prev, store, ape, norm_weight, positions,
                                       inv_freq])


def stand_in_operands(config: CompressStepConfig, device: torch.device | str) -> list[torch.Tensor]:
    """Operands of one slot of a compressor of this configuration, as the runtime passes them (dtypes, ranks,
    16-byte aligned): what a compile is specialised on."""
    f32 = dict(dtype=torch.float32, device=device)
    ratio, d, c = config.ratio, config.dim, config.width
    pending = [torch.empty(1, ratio, c, **f32), torch.empty(1, ratio, c, **f32)]
    prev = [torch.empty(1, ratio, d, **f32), torch.empty(1, ratio, d, **f32)] if config.overlap else pending
    return [torch.empty(1, c, **f32), torch.empty(1, c, **f32), *pending, *prev,
            torch.empty(1, 2, d, dtype=torch.bfloat16, device=device), torch.empty(ratio, c, **f32),
            torch.empty(d, **f32), torch.empty(1, dtype=torch.int64, device=device),
            torch.empty(max(1, config.rope_dim // 2), **f32)]


def warmup(configs, device: torch.device | str) -> int:
    """Compile :func:`sm90_compress_step`'s kernel for each of ``configs`` (CompressStepConfig: a model's
    compressors, its indexers' too); returns how many."""
    n = 0
    for config in dict.fromkeys(configs):
        _compile(Sm90CompressStep(config), stand_in_operands(config, device))
        n += 1
    return n
