"""Host side of the SM90 NVFP4 MoE layer: routing glue + L1 (SwiGLU) + L2 (routed scatter-add).

Flow of one call (on the current CUDA stream, which a prefill call's side stream forks from and joins again; no
host sync, no allocation per call: the workspaces are sized once for ``max_tokens``, so the call is CUDA-graph
capturable):

1. ``Sm90MoeRouting``: pairs (token, slot) sorted by expert -> ``token_of``, ``weight_of``, tiles (not launched by a
   direct call: each routed pair is a tile of its own, ``GemmProblem.direct_top_k``);
2. the L1 GEMM (``"swiglu"``) over ``w13``: ``h`` [pairs, I] BF16 in sorted order, each row in the K order step 3
   reads (its CTAs also zero ``out``, so no memset launch);
3. the L2 GEMM (``"scatter"``) over ``w2``: ``out[t] += w * (h @ W2.T)``.

What a call of T tokens runs is a :class:`~nvfp4_megamoe.kernels.sm90_config.MoePlan` from
:func:`~nvfp4_megamoe.kernels.sm90_heuristics.moe_plan`: the mma.sync GEMMs (``sm90_moe_gemm``) in decode and at mid
T, the WGMMA GEMMs (``sm90_moe_wgmma``) in prefill, which read activations in the ``"staged"`` K order, so ``x`` is
first permuted into a workspace (``Sm90StagedOrder``) while step 1 runs on a side stream.

Weights are format 1 as written by ``convert`` (``docs/format.md``), ``w13`` and ``w2`` row-major or, from a
``--target sm90`` conversion, in Hopper row tiles (``MoeShape.weight_tiles``). Compiled kernels are cached by their
configuration (in-process, and on disk unless ``NVFP4_MEGAMOE_KERNEL_CACHE=0``, see ``cute_host``);
:meth:`Sm90Nvfp4Moe.warmup` compiles every plan a call can pick, so that no call compiles.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import MoePlan, MoeShape
from .sm90_gemm_family import Gemm, gemm_can_implement, gemm_kernel
from .sm90_heuristics import TILE_TOKEN_CHOICES, moe_plan
from .sm90_k_order import Sm90StagedOrder
from .sm90_moe_routing import MAX_EXPERTS, Sm90MoeRouting, max_tiles_for
from .swizzle import swizzled_nbytes

Planner = Callable[[MoeShape, int, int], MoePlan]


class Sm90Nvfp4Moe:
    """Routed experts of one MoE layer shape on Hopper (sm_90a).

    Args:
        shape: the layer (:class:`~nvfp4_megamoe.kernels.sm90_config.MoeShape`).
        max_tokens: the largest T a call may pass (workspaces are sized for it).
        device: CUDA device of the workspaces ("cpu": compile only, for the CI's sm_90a builds).
        planner: ``(shape, tokens, sms) -> MoePlan``, :func:`~nvfp4_megamoe.kernels.sm90_heuristics.moe_plan` unless a
            test or an A/B benchmark passes another.
    """

    @staticmethod
    def can_implement(shape: MoeShape, max_tokens: int, sms: int = 132, planner: Planner = moe_plan) -> bool:
        """Whether the kernels take every plan ``planner`` picks for 1..``max_tokens`` tokens of ``shape``."""
        if not 1 <= shape.experts <= MAX_EXPERTS:
            return False
        plans = {planner(shape, t, sms) for t in range(1, max_tokens + 1)}
        return all(gemm_can_implement(p.l1) and gemm_can_implement(p.l2) for p in plans)

    def __init__(self, shape: MoeShape, max_tokens: int, device: torch.device | str = "cuda",
                 planner: Planner = moe_plan):
        self.shape, self.max_tokens, self.planner = shape, max_tokens, planner
        self.h, self.i, self.e, self.k = shape.hidden, shape.intermediate, shape.experts, shape.top_k
        pairs = max_tokens * self.k
        dev = torch.device(device)
        self.token_of = torch.zeros(pairs, dtype=torch.int32, device=dev)
        self.weight_of = torch.zeros(pairs, dtype=torch.float32, device=dev)
        self.rank = torch.zeros(pairs, dtype=torch.int32, device=dev)
        self.tiles = torch.zeros(max_tiles_for(pairs, self.e, TILE_TOKEN_CHOICES[0]), 3, dtype=torch.int32, device=dev)
        self.num_tiles = torch.zeros(1, dtype=torch.int32, device=dev)
        self.hbuf = torch.empty(pairs, self.i, dtype=torch.bfloat16, device=dev)
        self.xbuf = torch.empty(max_tokens, self.h, dtype=torch.bfloat16, device=dev)  # x in "staged" order
        self.zeros = torch.zeros(max(self.h, self.i) // 2, dtype=torch.int32, device=dev)  # an activation row
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        # the routing's stream, beside the permute of x; high priority, so that its one CTA takes the first SM free
        # instead of queueing behind the permute's
        self.side = torch.cuda.Stream(dev, priority=-1) if dev.type == "cuda" else None
        self.permute = Sm90StagedOrder()  # x into the "staged" K order, for the WGMMA L1
        self._plans: dict[int, MoePlan] = {}
        self._kernels: dict[MoePlan, tuple[Sm90MoeRouting | None, Gemm, Gemm]] = {}

    def plan(self, tokens: int) -> MoePlan:
        """What a call with ``tokens`` tokens runs."""
        plan = self._plans.get(tokens)
        if plan is None:
            plan = self._plans[tokens] = self.planner(self.shape, tokens, self.sms)
        return plan

    def kernels(self, plan: MoePlan) -> tuple[Sm90MoeRouting | None, Gemm, Gemm]:
        """The routing kernel (None for a direct plan), L1 and L2 of a plan."""
        ops = self._kernels.get(plan)
        if ops is None:
            routing = None if plan.direct else Sm90MoeRouting(experts=self.e, top_k=self.k,
                                                              tile_tokens=plan.routing_tile)
            ops = self._kernels[plan] = (routing, gemm_kernel(plan.l1), gemm_kernel(plan.l2))
        return ops

    def warmup(self, ids_dtype: torch.dtype = torch.int32) -> int:
        """Compile every plan a call with 1 <= T <= ``max_tokens`` can pick (routing ids of ``ids_dtype``), so that no
        call compiles (nor any CUDA-graph capture). Returns how many plans there are."""
        # compiles specialise on dtypes and ranks only (shapes are dynamic): tiny stand-ins will do
        dev, p = self.hbuf.device, self.k
        u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
        w, sc = torch.empty(1, 1, 16, **u8), torch.empty(1, 16, **u8)
        x, out = torch.empty(1, 16, dtype=torch.bfloat16, device=dev), torch.empty(1, 16, **f32)
        ids, wts = torch.empty(p, dtype=ids_dtype, device=dev), torch.empty(p, **f32)
        common = [self.token_of[:p], self.weight_of[:p], self.tiles, self.num_tiles]
        plans = {self.plan(n) for n in range(1, self.max_tokens + 1)}
        for plan in plans:
            routing, l1, l2 = self.kernels(plan)
            pairs = [self.zeros, wts, ids.view(p, 1), self.num_tiles] if plan.direct else common
            if routing is not None:
                _compile(routing, [ids, wts, *common, self.rank[:p]])
            _compile(l1, [w, sc, torch.empty(2, **f32), x, *pairs, self.hbuf[:p], out])
            _compile(l2, [w, sc, torch.empty(1, **f32), self.hbuf[:p], *pairs, out, out])
        if any(plan.wgmma for plan in plans):  # one permute kernel serves every WGMMA plan
            _compile(self.permute, [x, self.xbuf[:1]])
        return len(plans)

    def check_weights(self, w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha) -> None:
        e, h, i = self.e, self.h, self.i
        _expect(w13.dtype == torch.uint8 and tuple(w13.shape) == (e, 2 * i, h // 2),
                f"w13 must be uint8 [E={e}, 2I={2 * i}, H/2={h // 2}], got {w13.dtype} {tuple(w13.shape)}")
        _expect(w2.dtype == torch.uint8 and tuple(w2.shape) == (e, h, i // 2),
                f"w2 must be uint8 [E={e}, H={h}, I/2={i // 2}], got {w2.dtype} {tuple(w2.shape)}")
        _expect(tuple(w13_scale.shape) == (e, swizzled_nbytes(2 * i, h // 16)) and w13_scale.dtype == torch.uint8,
                f"w13_scale must be uint8 [E, swz(2I, H/16)], got {w13_scale.dtype} {tuple(w13_scale.shape)}")
        _expect(tuple(w2_scale.shape) == (e, swizzled_nbytes(h, i // 16)) and w2_scale.dtype == torch.uint8,
                f"w2_scale must be uint8 [E, swz(H, I/16)], got {w2_scale.dtype} {tuple(w2_scale.shape)}")
        for name, a, shape in (("w13_alpha", w13_alpha, (e, 2)), ("w2_alpha", w2_alpha, (e,))):
            _expect(a.dtype == torch.float32 and tuple(a.shape) == shape,
                    f"{name} must be float32 {list(shape)}, got {a.dtype} {tuple(a.shape)}")
        for t in (w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha):
            _expect(t.is_cuda and t.is_contiguous(), "weights must be contiguous CUDA tensors")

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w13_scale: torch.Tensor, w13_alpha: torch.Tensor,
                 w2: torch.Tensor, w2_scale: torch.Tensor, w2_alpha: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` float32 [T, H] = the routed MoE of ``x`` (contract of ``moe_reference``)."""
        t = x.shape[0]
        _expect(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == self.h and x.is_contiguous(),
                f"x must be contiguous bf16 [T, H={self.h}], got {x.dtype} {tuple(x.shape)}")
        _expect(1 <= t <= self.max_tokens, f"T={t} outside [1, max_tokens={self.max_tokens}]")
        _expect(tuple(topk_ids.shape) == (t, self.k) and topk_ids.dtype in (torch.int32, torch.int64),
                f"topk_ids must be int32/int64 [T, k={self.k}]")
        _expect(tuple(topk_weights.shape) == (t, self.k) and topk_weights.dtype == torch.float32,
                f"topk_weights must be float32 [T, k={self.k}]")
        if out is None:
            out = torch.empty(t, self.h, dtype=torch.float32, device=x.device)
        _expect(out.dtype == torch.float32 and tuple(out.shape) == (t, self.h) and out.is_contiguous(),
                "out must be contiguous float32 [T, H]")
        pairs = t * self.k
        plan = self.plan(t)
        routing, l1, l2 = self.kernels(plan)
        token_of, hbuf = self.token_of[:pairs], self.hbuf[:pairs]
        if plan.direct:  # one tile per routed pair, in [T, k] order: no sort, no routing launch
            tiles, weight_of = topk_ids.reshape(pairs, 1), topk_weights.reshape(-1)
            token_of = self.zeros  # the pairs are in [T, k] order; block_columns reads zeros here
        else:
            tiles, weight_of = self.tiles[:max_tiles_for(pairs, self.e, plan.routing_tile)], self.weight_of[:pairs]
            routing_args = [topk_ids.reshape(-1), topk_weights.reshape(-1), token_of, weight_of, tiles,
                            self.num_tiles, self.rank[:pairs]]
            if plan.wgmma:
                # the routing (one CTA) runs beside the permute of x, on a side stream: two parallel branches of a
                # CUDA graph, joined before L1
                main = torch.cuda.current_stream(x.device)
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    _launch(routing, routing_args)
                _launch(self.permute, [x, self.xbuf[:t]])
                x = self.xbuf[:t]
                main.wait_stream(self.side)
            else:
                _launch(routing, routing_args)
        _launch(l1, [w13, w13_scale, w13_alpha.reshape(-1), x, token_of, weight_of, tiles, self.num_tiles, hbuf,
                     out])  # zeroes out; alpha pairs flattened to [2E]
        _launch(l2, [w2, w2_scale, w2_alpha, hbuf, token_of, weight_of, tiles, self.num_tiles, out, out])
        return out
