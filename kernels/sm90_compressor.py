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

Why the split: a slot's update reads little (HCA: the window's kv and gate and ``ape``, 768 KB; CSA tens of KB) and
does little with it, so at a small batch its time is latency: one SM pulls about 50-100 GB/s, and a thread that
walks the window's 128 slots is a chain of 128 dependent softmax steps. With one CTA a slot and a thread a channel,
a batch-1 step took about 20 us a compressor. So (``CompressStepConfig``, ``sm90_heuristics.compress_step_config``):

* a slot is a thread-block cluster of ``cluster`` CTAs along the grid's x (the grid's y is the slot), CTA ``r``
  taking entry channels ``[r * dc, (r + 1) * dc)``, ``dc = d / cluster`` whole warps;
* a CTA's ``dc * groups`` threads are ``groups`` groups of ``dc`` (thread ``g * dc + i``: channel ``i``, group
  ``g``, so a warp reads 32 neighbouring channels of a row); group ``g`` pools the window's slots
  ``[g * K, (g + 1) * K)``, ``K = ratio / groups`` (with the overlap, the same slots of ``prev``), loaded together
  in chunks of up to ``SLOT_CHUNK`` before any softmax arithmetic needs them;
* the groups' partial softmax sums (max, denominator, numerator) go through shared memory and group 0 combines
  them in group order;
* the RMSNorm's sum of squares: each CTA adds its channels' squares (a butterfly per warp, the warps' sums in warp
  order), stores that float into every peer's shared memory (``mapa`` + ``st.shared::cluster``), and after a cluster
  barrier every CTA adds the ``cluster`` partials in rank order: every channel of the slot is scaled by the same
  float, the same from launch to launch.

Ownership (why pending and prev need no barrier): thread ``(g, i)`` is the only one that touches rows ``[g * K,
(g + 1) * K)`` of channel ``c = r * dc + i`` (and ``d + c``) of pending and prev: it writes the token into its slot
when the slot is one of its rows, reads those rows to pool (the token's own values from its registers), and where the
window closes moves its Ca rows into prev after reading prev (program order of one thread on the same addresses).
Every other value it reads an earlier launch wrote. Barriers serve the partial sums only: ``bar.sync`` after the
groups' partials and after the warps' sums of squares, and two cluster barriers: an arrive at the start and a wait
before the first remote store (a peer's shared memory exists once the peer has started), then arrive (release) and
wait (acquire) after the stores. No remote access follows the last wait, so a CTA may exit while its peers finish.
RoPE pairs ``(2i, 2i + 1)`` of the last ``rd`` channels are neighbouring lanes of one warp (``dc`` a multiple of
32, ``rd`` even): the partner's value is one shuffle (xor 1) away.

Numerics, in float32 as the reference: the pooling is a softmax over the slots; a chunk takes the max of its gates
(every chunk holds slots of this window: finite gates, so a -inf gate of an empty ``prev`` weighs 0 without a NaN),
``exp`` as ``ex2.approx`` of ``x * log2(e)``, the chunks of a thread merged online, the groups' partials rescaled to
their max; the sum of squares over d, ``rsqrt.approx``; cos and sin of ``float32(w * ratio) * inv_freq`` rounded as
torch rounds it, reduced in float64 (``sm90_ptx.rope_cos_sin``: accurate at positions of millions, where
``sin.approx`` is not); the entry rounded to BF16 to nearest even. Against the reference: pending and prev bit for
bit (copies and one float add), the entry within one BF16 ulp (float32 rounding differences that land on a rounding
boundary). The entry is written where the window does not close too (the reference does: only a closed window's row
is read); a row past the store (a position beyond ``max_context``) is not written.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import CompressStepConfig
from .sm90_heuristics import compress_step_config
from .sm90_ptx import LOG2E

MAX_THREADS = 1024   # threads of a CTA: channels x slot groups
CLUSTERS = (1, 2, 4, 8)   # CTAs of a slot: portable cluster sizes that divide d into whole warps
SLOT_CHUNK = 8       # slots a thread loads at once before their softmax (HCA: a thread's 8 slots in one go)


def _exp(x: Float32) -> Float32:
    return ptx.ex2(x * Float32(LOG2E))


def _pick(own: cutlass.Boolean, reg: Float32, loaded: Float32) -> Float32:
    """The new token's value (``reg``) in its own slot, else the slot's value as loaded."""
    return Float32(cutlass.select_(own, reg, loaded))


def _partial(gates: list, values: list) -> tuple[Float32, Float32, Float32]:
    """A chunk's softmax-weighted sum: max ``m`` of ``gates`` (finite: the chunk holds a slot of this window),
    denominator and numerator relative to it, added in list order; a -inf gate adds 0."""
    m = gates[0]
    for g in gates[1:]:
        m = cute.arch.fmax(m, g)
    p = [_exp(g - m) for g in gates]
    den, acc = p[0], p[0] * values[0]
    for k in range(1, len(gates)):
        den = den + p[k]
        acc = acc + p[k] * values[k]
    return m, den, acc


def _merge(m: Float32, den: Float32, acc: Float32, m2: Float32, den2: Float32, acc2: Float32
           ) -> tuple[Float32, Float32, Float32]:
    """Two partial sums (finite maxima) as one, relative to the larger max."""
    m_new = cute.arch.fmax(m, m2)
    s1, s2 = _exp(m - m_new), _exp(m2 - m_new)
    return m_new, den * s1 + den2 * s2, acc * s1 + acc2 * s2


def _why(config: CompressStepConfig) -> str:
    return (f"compressor step {config}: needs ratio >= 1, a cluster of {CLUSTERS} CTAs each of a multiple of 32 of "
            f"the d channels, slot groups that divide ratio, at most {MAX_THREADS} threads a CTA, an even rope_dim "
            "up to d and eps >= 0")


class Sm90CompressStep:
    """A decode step's compressor update for every slot (module docstring), one compiled
    :class:`~nvfp4_megamoe.kernels.sm90_config.CompressStepConfig`.

    Launched as ``fn(kv, gate, pending_kv, pending_gate, prev_kv, prev_gate, store, ape, norm, positions, inv_freq,
    stream)`` with the module docstring's operands; without the overlap ``prev_kv`` / ``prev_gate`` are any f32
    rank-3 tensors, not read.
    """

    def __init__(self, config: CompressStepConfig):
        _expect(self.can_implement(config), _why(config))
        self.config = config
        self.ratio, self.dim, self.overlap, self.rope_dim = config.ratio, config.dim, config.overlap, config.rope_dim
        self.eps = float(config.eps)
        self.cluster, self.groups, self.channels, self.slots = (config.cluster, config.groups, config.channels,
                                                                config.slots)
        self.chunk = max(k for k in range(1, min(self.slots, SLOT_CHUNK) + 1) if self.slots % k == 0)
        self.threads = self.channels * self.groups

    @staticmethod
    def can_implement(config: CompressStepConfig) -> bool:
        """Whether the cluster splits d into whole warps a CTA (RoPE pairs are then lane pairs of one warp, with an
        even ``rope_dim``), the groups split the window evenly, and a CTA has at most ``MAX_THREADS`` threads."""
        return (config.ratio >= 1 and config.cluster in CLUSTERS and config.dim % config.cluster == 0
                and config.channels % 32 == 0 and config.channels >= 32 and config.groups >= 1
                and config.ratio % config.groups == 0 and config.channels * config.groups <= MAX_THREADS
                and config.rope_dim % 2 == 0 and 0 <= config.rope_dim <= config.dim and config.eps >= 0)

    def key(self) -> tuple:
        return (self.config,)

    @cute.jit
    def __call__(self, mKv: cute.Tensor, mGate: cute.Tensor, mPendKv: cute.Tensor, mPendGate: cute.Tensor,
                 mPrevKv: cute.Tensor, mPrevGate: cute.Tensor, mStore: cute.Tensor, mApe: cute.Tensor,
                 mNorm: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor, stream):
        grid = [self.cluster, mKv.shape[0], 1]   # x: the CTAs of a slot (one cluster), y: the slot
        if const_expr(self.cluster > 1):
            self.kernel(mKv, mGate, mPendKv, mPendGate, mPrevKv, mPrevGate, mStore, mApe, mNorm, mPos, mFreq).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=[self.cluster, 1, 1], stream=stream)
        else:
            self.kernel(mKv, mGate, mPendKv, mPendGate, mPrevKv, mPrevGate, mStore, mApe, mNorm, mPos, mFreq).launch(
                grid=grid, block=[self.threads, 1, 1], stream=stream)

    def chunk_partial(self, mPendKv: cute.Tensor, mPendGate: cute.Tensor, mPrevKv: cute.Tensor,
                      mPrevGate: cute.Tensor, mApe: cute.Tensor, b: Int32, c: Int32, cb: Int32, slot: Int32,
                      kv_b: Float32, gate_b: Float32, j0: Int32) -> tuple[Float32, Float32, Float32]:
        """The softmax partial of slots ``[j0, j0 + chunk)`` of this window (the new token's own slot from its
        registers) and, with the overlap, the same slots of prev (gates with ape already). Every load, its own slot's
        too (what this thread stored in step 1, unused: no branch), is issued before the softmax needs it."""
        gates, values = [], []
        for k in range(self.chunk):
            j = j0 + k
            gates.append(_pick(slot == j, gate_b, mPendGate[b, j, cb]) + mApe[j, cb])
            values.append(_pick(slot == j, kv_b, mPendKv[b, j, cb]))
        if self.overlap:
            for k in range(self.chunk):
                gates.append(mPrevGate[b, j0 + k, c])
                values.append(mPrevKv[b, j0 + k, c])
        return _partial(gates, values)

    @cute.kernel
    def kernel(self, mKv: cute.Tensor, mGate: cute.Tensor, mPendKv: cute.Tensor, mPendGate: cute.Tensor,
               mPrevKv: cute.Tensor, mPrevGate: cute.Tensor, mStore: cute.Tensor, mApe: cute.Tensor,
               mNorm: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        rank, b, _ = cute.arch.block_idx()   # the cluster spans the grid's x: rank in the cluster = block x
        ratio, d, rd, dc = self.ratio, self.dim, self.rope_dim, self.channels
        n_cta, n_grp, n_slot, chunk = self.cluster, self.groups, self.slots, self.chunk
        if const_expr(n_cta > 1):
            cute.arch.cluster_arrive_relaxed()   # started: peers may store into this CTA's shared memory (step 5)
        smem = cutlass.memory.SmemAllocator()
        s_part = smem.allocate_array(Float32, 3 * max(n_grp - 1, 1) * dc, byte_alignment=16).toint()
        s_warp = smem.allocate_array(Float32, dc // 32, byte_alignment=16).toint()
        s_sum = smem.allocate_array(Float32, n_cta, byte_alignment=16).toint()
        grp = tid // dc
        c = rank * dc + tid % dc         # the entry channel
        cb = c + d * int(self.overlap)   # the channel pooled from this window (CSA: its Cb half)
        first = grp * n_slot             # this group's slots: [first, first + n_slot)
        pos = mPos[b]
        slot = Int32(pos % ratio)
        row = pos // ratio

        # 1. the token into its slot of the open window, by the group that owns the slot (Ca too with the overlap:
        #    it moves to prev at the close)
        kv_b = mKv[b, cb]
        gate_b = mGate[b, cb]
        kv_a = Float32(0.0)
        gate_a = Float32(0.0)
        if const_expr(self.overlap):
            kv_a = mKv[b, c]
            gate_a = mGate[b, c]
        if slot // n_slot == grp:
            mPendKv[b, slot, cb] = kv_b
            mPendGate[b, slot, cb] = gate_b
            if const_expr(self.overlap):
                mPendKv[b, slot, c] = kv_a
                mPendGate[b, slot, c] = gate_a

        # 2. this group's slots, chunk by chunk (:meth:`chunk_partial`)
        operands = (mPendKv, mPendGate, mPrevKv, mPrevGate, mApe, b, c, cb, slot, kv_b, gate_b)
        m, den, acc = self.chunk_partial(*operands, first)
        if const_expr(n_slot > chunk):
            for i in cutlass.range(1, n_slot // chunk):
                m2, den2, acc2 = self.chunk_partial(*operands, first + i * chunk)
                m, den, acc = _merge(m, den, acc, m2, den2, acc2)

        # 3. the window closes: this group's rows of the Ca half (the new token's from registers) become prev, after
        #    this thread read them from prev above (program order of one thread on the same addresses)
        if const_expr(self.overlap):
            if slot == ratio - 1:
                for k in cutlass.range(n_slot, unroll=SLOT_CHUNK):
                    j = first + k
                    mPrevKv[b, j, c] = _pick(slot == j, kv_a, mPendKv[b, j, c])
                    mPrevGate[b, j, c] = _pick(slot == j, gate_a, mPendGate[b, j, c]) + mApe[j, c]

        # what the entry needs besides the pooled value, loaded before the barriers (group 0 writes the entry)
        w_norm = mNorm[c]
        cos, sin = Float32(1.0), Float32(0.0)
        if const_expr(rd > 0):
            if grp == 0:
                if c >= d - rd:
                    cos, sin = ptx.rope_cos_sin(row * ratio, mFreq[(c - (d - rd)) // 2])

        # 4. the groups' partials, combined by group 0 in group order, each rescaled once to their common max
        if const_expr(n_grp > 1):
            part = (n_grp - 1) * dc * 4   # bytes of one of the m, den, acc arrays (groups 1..)
            if grp > 0:
                at = s_part + (tid - dc) * 4
                ptx.st_shared_f32(at, m)
                ptx.st_shared_f32(at + part, den)
                ptx.st_shared_f32(at + 2 * part, acc)
            cute.arch.sync_threads()
            if grp == 0:
                big = m
                for h in cutlass.range_constexpr(1, n_grp):
                    big = cute.arch.fmax(big, ptx.ld_shared_f32(s_part + ((h - 1) * dc + tid) * 4))
                scale = _exp(m - big)
                den, acc = den * scale, acc * scale
                for h in cutlass.range_constexpr(1, n_grp):
                    at = s_part + ((h - 1) * dc + tid) * 4
                    scale = _exp(ptx.ld_shared_f32(at) - big)
                    den = den + ptx.ld_shared_f32(at + part) * scale
                    acc = acc + ptx.ld_shared_f32(at + 2 * part) * scale
        pooled = acc / den

        # 5. RMSNorm: the sum of squares over the slot's d channels (a butterfly per warp, the warps' sums through
        #    shared memory in warp order: this CTA's partial; then every CTA's partial into every CTA's s_sum, added
        #    in rank order), so that every channel of the slot is scaled by the same float
        if grp == 0:
            ss = ptx.lane_sum(pooled * pooled)
            if tid % 32 == 0:
                ptx.st_shared_f32(s_warp + (tid // 32) * 4, ss)
        cute.arch.sync_threads()
        total = ptx.shared_sum_f32(s_warp, dc // 32)
        if const_expr(n_cta > 1):
            cute.arch.cluster_wait()       # every peer has started (its arrive at the top): its shared memory is live
            if tid < n_cta:
                ptx.st_cluster_f32(ptx.mapa(s_sum + rank * 4, tid), total)
            cute.arch.cluster_arrive()     # release: this CTA's stores into its peers ...
            cute.arch.cluster_wait()       # ... acquire: every peer's store into this CTA's s_sum
            total = ptx.ld_shared_f32(s_sum)
            for r in cutlass.range_constexpr(1, n_cta):
                total = total + ptx.ld_shared_f32(s_sum + r * 4)

        if grp == 0:
            y = pooled * cute.math.rsqrt(total / Float32(d) + Float32(self.eps)) * w_norm
            # 6. RoPE of the last rd channels at the entry's position w * ratio: pair (2i, 2i + 1) is the lanes
            #    (c, c ^ 1) of one warp (dc a multiple of 32, rd and d even); every lane shuffles, the rotated use it
            out = y
            if const_expr(rd > 0):
                partner = cute.arch.shuffle_sync_bfly(y, 1)
                if c >= d - rd:
                    if c % 2 == 0:
                        out = y * cos - partner * sin      # a cos - b sin
                    else:
                        out = partner * sin + y * cos      # a sin + b cos
            # 7. the entry, BF16 (round to nearest even), where the store has its row
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
    config = compress_step_config(ratio, d, overlap, 2 * inv_freq.numel(), eps)
    _expect(Sm90CompressStep.can_implement(config), _why(config))
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
