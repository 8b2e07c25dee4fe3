"""SM90 (sm_90a) kernels for the MoE router after its linear (``ReferenceBackend.route``): scores, the experts, the
renormalised weights, in one launch.

The reference takes about ten launches per layer (softplus, sqrt, the bias add, ``topk``'s two kernels, the gather,
the sum, the division and the scaling; hash layers an index and the duplicate mask's ``eq``, ``tril``, ``any`` and
``masked_fill`` instead of the top-k). Here one warp routes one token, ``WARPS`` tokens a CTA:

* layout: the logits f32 [T, E] row-major (E at most ``MAX_EXPERTS``); lane ``l`` holds experts ``l + 32 j``
  (``j < ceil(E / 32)``, loads coalesced across the warp); slot ``i`` of the token's ``k`` is lane ``i``'s, which writes
  ``ids[t, i]`` (int64, as the reference) and ``weights[t, i]`` (float32) of the outputs [T, k];
* scores (float32): ``sqrtsoftplus`` is the correctly rounded square root of torch's softplus (``x`` above 20, else
  ``log1p(exp(x))``, libdevice's accurate ``expf`` and ``log1pf``, the functions nvcc compiles torch's kernel with);
  ``sigmoid`` ``1 / (1 + exp(-x))``; ``softmax`` ``exp(x - max) / sum`` over the row (the max and the sum are
  butterflies across the warp, so every lane holds the same two floats);
* top-k (:class:`Sm90RouterTopk`): each of the ``k`` rounds takes the largest key of the warp (a lane's own maximum,
  then five butterfly shuffles) and clears it where it lives. A key is the int64 ``ordered bits of (score + bias)``
  above ``0xFFFFFFFF - e`` (``indexer_keys.ordered_key``'s layout), so the order is descending with ties to the
  **lower expert index**, whatever the lane, and slot ``i`` holds the ``i``-th best. The bias only selects: the
  weight is the unbiased score, shuffled from the lane that holds it. ``-0.0`` counts as ``+0.0`` (torch's ties);
* hash (:class:`Sm90RouterHash`): the experts of row ``token_ids[t]`` of ``tid2eid`` (int32 or int64), each score
  computed from the one logit it needs; a repeated expert gets weight 0 at its later slots but is counted in the sum
  before that (the reference's order: the sum of the gathered scores, then the mask);
* weights: ``score / (sum + 1e-20) * scaling``, the sum over the token's slots in slot order (torch's reduction
  may add the same ``k`` floats in another order: an ulp or so of the sum).

No host sync and fixed-size outputs: the launch is captured in a decode step's CUDA graph. Out-of-range
``tid2eid`` entries or token ids are not checked (the checkpoint's validation and the embedding guarantee them);
NaN scores sort by their sign bit, not as torch's largest.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .indexer_keys import LOW_WORD

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
MAX_EXPERTS = 512           # 16 logits a lane (V4-Flash 256, V4-Pro 384)
MAX_TOP_K = 32              # one lane a slot (V4: 6)
WARPS = 4                   # tokens a CTA: a warp each
SOFTPLUS_THRESHOLD = 20.0   # torch's softplus default: x above it is returned as it is
NO_KEY = -(1 << 63)         # below every expert's key: lanes past E, experts already picked
INDEX_DTYPES = (torch.int32, torch.int64)   # tid2eid as the kernel reads it (checkpoints store either)


@dataclass(frozen=True)
class RouterConfig:
    """What a router kernel is specialised on.

    Attributes:
        experts: E, the routed experts (the logits' width), 1 to ``MAX_EXPERTS``.
        top_k: k, the experts a token is routed to (``num_experts_per_tok``), 1 to ``min(E, MAX_TOP_K)``; a hash
            layer's ``tid2eid`` rows are k wide.
        func: the scoring function, one of ``SCORING_FUNCS``.
        scaling: ``routed_scaling_factor``, the weights' sum (duplicates of a hash row aside).
        bias: top-k layers: a selection bias [E] is added to the scores before the top-k (V4's score-routed layers
            have one); hash layers take none.
    """

    experts: int
    top_k: int
    func: str = "sqrtsoftplus"
    scaling: float = 1.0
    bias: bool = False


def can_implement(experts: int, top_k: int, func: str) -> bool:
    """Whether the kernels route E = ``experts`` (any E up to ``MAX_EXPERTS``, 16 logits a lane) to ``top_k`` of them
    (a lane a slot, at most ``MAX_TOP_K``) by ``func`` (every scoring function of the reference)."""
    return 1 <= experts <= MAX_EXPERTS and 1 <= top_k <= min(experts, MAX_TOP_K) and func in SCORING_FUNCS


def _ordered(x: Float32) -> Int32:
    """float32 -> int32 in the floats' order (``indexer_keys._mono``); ``x + 0.0`` makes ``-0.0`` equal to ``+0.0``."""
    bits = ptx.f32_bits(x + Float32(0.0))
    return bits ^ ((bits >> 31) & Int32(0x7FFFFFFF))


class _Sm90Router:
    """What the top-k and the hash kernels share: the configuration, the scores, the weights and their stores."""

    def __init__(self, config: RouterConfig):
        if not can_implement(config.experts, config.top_k, config.func):
            raise ValueError(f"the router kernels take 1 to {MAX_EXPERTS} experts, 1 to min(E, {MAX_TOP_K}) of them "
                             f"and a scoring function of {SCORING_FUNCS}, got {config}")
        self.config = config
        self.threads = 32 * WARPS
        self.per_lane = (config.experts + 31) // 32

    def key(self) -> tuple:
        return (self.config,)

    @cute.jit
    def score(self, x: Float32) -> Float32:
        """The score of one logit (``sqrtsoftplus`` or ``sigmoid``; ``softmax`` is :meth:`softmax_score`)."""
        if const_expr(self.config.func == "sigmoid"):
            return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))
        softplus = cute.math.log1p(cute.math.exp(x))
        if x > Float32(SOFTPLUS_THRESHOLD):
            softplus = x
        return cute.math.sqrt(softplus)

    @cute.jit
    def load_row(self, mLogits: cute.Tensor, t: Int32, lane: Int32) -> cute.Tensor:
        """The lane's logits of token ``t``: ``x[j]`` is expert ``lane + 32 j`` (0 past E)."""
        x = cute.make_rmem_tensor((self.per_lane,), Float32)
        for j in cutlass.range_constexpr(self.per_lane):
            x[j] = Float32(0.0)
            if lane + 32 * j < self.config.experts:
                x[j] = mLogits[t, lane + 32 * j]
        return x

    @cute.jit
    def softmax_stats(self, x: cute.Tensor, lane: Int32) -> tuple:
        """(max, sum of ``exp(x - max)``) over the row, the same two floats in every lane."""
        m = Float32(-float("inf"))
        for j in cutlass.range_constexpr(self.per_lane):
            if lane + 32 * j < self.config.experts:
                m = cute.arch.fmax(m, x[j])
        m = ptx.lane_max(m)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(self.per_lane):
            if lane + 32 * j < self.config.experts:
                total = total + cute.math.exp(x[j] - m)
        total = ptx.lane_sum(total)
        return m, total

    def softmax_score(self, x: Float32, m: Float32, total: Float32) -> Float32:
        return cute.math.exp(x - m) / total

    @cute.jit
    def store(self, mIds: cute.Tensor, mW: cute.Tensor, t: Int32, lane: Int32, expert: Int32, s: Float32,
              total: Float32, repeated: Int32):
        """Lane ``i < k`` writes slot ``i``: its expert and ``s / (total + 1e-20) * scaling`` (0 where ``repeated``)."""
        if lane < self.config.top_k:
            w = s / (total + Float32(1e-20)) * Float32(self.config.scaling)
            if repeated != 0:
                w = Float32(0.0)
            mIds[t, lane] = Int64(expert)
            mW[t, lane] = w


class Sm90RouterTopk(_Sm90Router):
    """Score-routed layers: the top ``k`` of ``scores + bias`` and their renormalised scores, a warp a token.

    Operands: ``logits`` f32 [T, E], ``bias`` f32 [E] (not read without ``config.bias``: any f32 [E] stands in),
    ``ids`` int64 [T, k], ``weights`` f32 [T, k]; every row contiguous.
    """

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, stream):
        self.kernel(mLogits, mBias, mIds, mW).launch(grid=[(mLogits.shape[0] + WARPS - 1) // WARPS, 1, 1],
                                                     block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        t = bidx * WARPS + tidx // 32
        E, J = self.config.experts, self.per_lane
        if t < mLogits.shape[0]:   # a whole warp in or out: its shuffles see all 32 lanes
            x = self.load_row(mLogits, t, lane)
            s = cute.make_rmem_tensor((J,), Float32)
            if const_expr(self.config.func == "softmax"):
                m, total = self.softmax_stats(x, lane)
                for j in cutlass.range_constexpr(J):
                    s[j] = self.softmax_score(x[j], m, total)
            else:
                for j in cutlass.range_constexpr(J):
                    s[j] = self.score(x[j])
            keys = cute.make_rmem_tensor((J,), Int64)
            for j in cutlass.range_constexpr(J):
                e = lane + 32 * j
                keys[j] = Int64(NO_KEY)
                if e < E:
                    choice = s[j]
                    if const_expr(self.config.bias):
                        choice = choice + mBias[e]
                    keys[j] = (Int64(_ordered(choice)) << 32) | (Int64(LOW_WORD) - Int64(e))
            mine_e = Int32(0)
            mine_s = Float32(0.0)
            total = Float32(0.0)
            for i in cutlass.range_constexpr(self.config.top_k):
                best = keys[0]
                for j in cutlass.range_constexpr(1, J):
                    best = cute.math.max(best, keys[j])
                for b in cutlass.range_constexpr(5):
                    best = cute.math.max(best, cute.arch.shuffle_sync_bfly(best, 1 << b))
                e = Int32(Int64(LOW_WORD) - (best & Int64(LOW_WORD)))
                picked = Float32(0.0)
                for j in cutlass.range_constexpr(J):   # keys are distinct: one lane, one register holds it
                    if keys[j] == best:
                        picked = s[j]
                        keys[j] = Int64(NO_KEY)
                picked = cute.arch.shuffle_sync(picked, e % 32)
                total = total + picked
                if lane == i:
                    mine_e = e
                    mine_s = picked
            self.store(mIds, mW, t, lane, mine_e, mine_s, total, Int32(0))


class Sm90RouterHash(_Sm90Router):
    """Hash layers: the experts of row ``token_ids[t]`` of ``tid2eid`` and their renormalised scores (a repeated
    expert's later slots weigh 0), a warp a token; every lane gathers the row's ``k`` experts and logits.

    Operands: ``logits`` f32 [T, E], ``tid2eid`` int32 or int64 [V, k], ``token_ids`` int32 or int64 [T] (the host
    passes int64), ``ids`` int64 [T, k], ``weights`` f32 [T, k]; every row contiguous.
    """

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mTid2eid: cute.Tensor, mTokens: cute.Tensor, mIds: cute.Tensor,
                 mW: cute.Tensor, stream):
        self.kernel(mLogits, mTid2eid, mTokens, mIds, mW).launch(grid=[(mLogits.shape[0] + WARPS - 1) // WARPS, 1, 1],
                                                                 block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mTid2eid: cute.Tensor, mTokens: cute.Tensor, mIds: cute.Tensor,
               mW: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        t = bidx * WARPS + tidx // 32
        k = self.config.top_k
        if t < mLogits.shape[0]:
            m = Float32(0.0)
            total = Float32(1.0)
            if const_expr(self.config.func == "softmax"):   # the row's max and sum: every logit, as top-k reads them
                m, total = self.softmax_stats(self.load_row(mLogits, t, lane), lane)
            row = Int32(mTokens[t])
            ids = cute.make_rmem_tensor((k,), Int32)
            s = cute.make_rmem_tensor((k,), Float32)
            for i in cutlass.range_constexpr(k):
                ids[i] = Int32(mTid2eid[row, i])
            for i in cutlass.range_constexpr(k):
                x = mLogits[t, ids[i]]
                if const_expr(self.config.func == "softmax"):
                    s[i] = self.softmax_score(x, m, total)
                else:
                    s[i] = self.score(x)
            sum_s = s[0]
            for i in cutlass.range_constexpr(1, k):
                sum_s = sum_s + s[i]
            mine_e = Int32(0)
            mine_s = Float32(0.0)
            repeated = Int32(0)
            for i in cutlass.range_constexpr(k):
                if lane == i:
                    mine_e = ids[i]
                    mine_s = s[i]
                    for j in cutlass.range_constexpr(i):
                        if ids[j] == ids[i]:
                            repeated = Int32(1)
            self.store(mIds, mW, t, lane, mine_e, mine_s, sum_s, repeated)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned: the alignment the warm-up compiled for (the compile key holds it), so a
    view at an odd offset costs a copy, not a compile inside a forward."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def sm90_route(logits: torch.Tensor, func: str, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
               token_ids: torch.Tensor, k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceBackend.route`` in one launch: ``logits`` f32 [T, E] (CUDA) -> (ids int64 [T, k], weights f32
    [T, k]). Hash layers (``tid2eid`` int32 or int64 [V, k] given): the experts of ``tid2eid[token_ids]`` (``token_ids``
    [T], read as int64); otherwise the top ``k`` of the scores + ``bias`` (f32 [E] or None), slot order descending,
    ties to the lower expert. Raises ``KernelArgumentError`` (a ``ValueError``) for shapes the kernels do not take
    (:func:`can_implement`)."""
    _expect(logits.is_cuda and logits.dim() == 2, f"logits must be CUDA [T, E], got {tuple(logits.shape)} on "
            f"{logits.device}")
    t, e = logits.shape
    _expect(can_implement(e, k, func), f"the router kernels take E <= {MAX_EXPERTS}, 1 <= k <= min(E, {MAX_TOP_K}) "
            f"and func in {SCORING_FUNCS}, got E={e}, k={k}, func={func!r}")
    hashed = tid2eid is not None
    if hashed:
        _expect(tid2eid.dim() == 2 and tid2eid.shape[1] == k and tid2eid.dtype in INDEX_DTYPES
                and tuple(token_ids.shape) == (t,) and not token_ids.is_floating_point(),
                f"tid2eid must be int32/int64 [V, k={k}] and token_ids integers [T={t}], got tid2eid "
                f"{tuple(tid2eid.shape)} {tid2eid.dtype}, token_ids {tuple(token_ids.shape)} {token_ids.dtype}")
    elif bias is not None:
        _expect(tuple(bias.shape) == (e,), f"bias must be [E={e}], got {tuple(bias.shape)}")
    config = RouterConfig(e, k, func, float(scaling), bias=not hashed and bias is not None)
    x = _aligned(logits.float())
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    if t:
        if hashed:
            # token ids as int64 (the model's own; the warm-up compiled for them): a copy only of other dtypes
            _launch(Sm90RouterHash(config), [x, _aligned(tid2eid), _aligned(token_ids.long()), ids, weights])
        else:
            b = _aligned(bias.float()) if config.bias else x[0]   # x[0]: an f32 [E] stand-in, not read
            _launch(Sm90RouterTopk(config), [x, b, ids, weights])
    return ids, weights


def warmup(config: RouterConfig, device, *, hashed: bool = False, tid2eid_dtype: torch.dtype = torch.int64) -> int:
    """Compile the kernel :func:`sm90_route` launches for ``config`` on ``device``: the top-k one, or with ``hashed``
    the hash one for a ``tid2eid`` of ``tid2eid_dtype`` (token ids int64, as the model passes them); returns 1."""
    e, k = config.experts, config.top_k
    f32 = dict(dtype=torch.float32, device=device)
    out = [torch.empty(1, k, dtype=torch.int64, device=device), torch.empty(1, k, **f32)]
    if hashed:
        tid2eid = torch.empty(2, k, dtype=tid2eid_dtype, device=device)
        _compile(Sm90RouterHash(config), [torch.empty(1, e, **f32), tid2eid,
                                          torch.empty(1, dtype=torch.int64, device=device), *out])
    else:
        _compile(Sm90RouterTopk(config), [torch.empty(1, e, **f32), torch.empty(e, **f32), *out])
    return 1
