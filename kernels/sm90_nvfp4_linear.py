"""Dense NVFP4 linear on Hopper (sm_90a): ``x @ W.T * alpha``, or G such linears of one launch (``groups``: a
grouped projection such as ``wo_a``, each group its own slice of x's row).

W4A16 like the MoE: ``x`` BF16, the weights decoded in registers, fp32 accumulation. Which kernel runs is
:func:`~nvfp4_megamoe.kernels.sm90_heuristics.linear_config`'s pick: the mma.sync GEMM in mode ``"store"`` for
few tokens (token tile and K split: a few tokens against a small W would otherwise leave most SMs idle), the WGMMA
GEMM from the 32-token tile on (64 on W of fewer than 2048 rows; float32 out), which reads x in the ``"staged"`` K
order, so x is first permuted into a workspace (``Sm90StagedOrder``). :func:`can_implement` says which W [N, K] it
tiles.
"""

from __future__ import annotations

import functools

import torch

from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import GemmConfig
from .sm90_gemm_family import Gemm, gemm_kernel
from .sm90_heuristics import linear_config, linear_token_counts
from .sm90_k_order import Sm90StagedOrder
from .sm90_moe_gemm import Sm90Nvfp4MmaGemm
from .sm90_moe_wgmma import Sm90Nvfp4WgmmaGemm
from .swizzle import swizzled_nbytes

_PERMUTE = Sm90StagedOrder()  # x into the "staged" K order, before a WGMMA call


def can_implement(n: int, k: int, groups: int = 1) -> bool:
    """Whether the kernel tiles ``groups`` W [N, K] (N a multiple of 64 rows, 128 with groups; K of 128)."""
    config = linear_config(n, k, 1, groups=groups)
    return n > 0 and Sm90Nvfp4MmaGemm.can_implement(config.problem, config.tiling)


def linear_op(n: int, k: int, tokens: int, out_bf16: bool = False, groups: int = 1) -> Gemm:
    """The kernel :func:`sm90_nvfp4_linear` launches for ``tokens`` rows of x [., G, K] against G W [N, K]."""
    return _kernel(linear_config(n, k, tokens, out_bf16, groups))


@functools.lru_cache(maxsize=None)
def _kernel(config: GemmConfig) -> Gemm:
    # one kernel object per configuration: a call (every dense linear of a decode step) does not check it again
    return gemm_kernel(config)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def _operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, alpha: torch.Tensor,
              out: torch.Tensor) -> list[torch.Tensor]:
    # the routing operands are unused in "store" mode, 1-element stand-ins (made once per device, not a zero-fill
    # launch per call) fill their places
    unused = _UNUSED.get(x.device)
    if unused is None:
        unused = _UNUSED[x.device] = torch.zeros(1, 3, dtype=torch.int32, device=x.device)
    return [weight.unsqueeze(0), weight_scale.reshape(1, -1), alpha.reshape(1), x,
            unused[0, :1], alpha.reshape(1), unused, unused[0, :1], out, out]


def warmup(n: int, k: int, device: torch.device | str, out_dtype: torch.dtype = torch.float32, groups: int = 1) -> int:
    """Compile every configuration :func:`sm90_nvfp4_linear` can pick for ``groups`` W [N, K] (so no call compiles).
    Returns how many. The kernels' ValueError for shapes they do not tile (see :func:`can_implement`)."""
    dev = torch.device(device)
    w = torch.empty(groups * n, k // 2, dtype=torch.uint8, device=dev)
    sc = torch.empty(groups * swizzled_nbytes(n, k // 16), dtype=torch.uint8, device=dev)
    alpha = torch.empty(1, dtype=torch.float32, device=dev)
    x = torch.empty(1, groups * k, dtype=torch.bfloat16, device=dev)
    out = torch.empty(1, groups * n, dtype=out_dtype, device=dev)
    ops = {linear_op(n, k, t, out_dtype == torch.bfloat16, groups) for t in linear_token_counts()}
    for op in ops:
        _compile(op, _operands(x, w, sc, alpha, out))
    if any(isinstance(op, Sm90Nvfp4WgmmaGemm) for op in ops):
        _compile(_PERMUTE, [x, torch.empty_like(x)])
    return len(ops)


def sm90_nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, alpha: torch.Tensor,
                      out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                      groups: int = 1) -> torch.Tensor:
    """Dense NVFP4 linear ``x @ W.T * alpha``, or ``groups`` of them: ``out[t, g] = x[t, g] @ W[g].T * alpha``.

    ``x`` bf16 [T, G * K] (T >= 1); ``weight`` uint8 [G * N, K/2] (group g: rows g N .. (g + 1) N); ``weight_scale``
    uint8 [swz(G * N, K/16)]; ``alpha`` float32 [] or [1] (a CUDA tensor, so no host sync). Returns ``out_dtype``
    (bf16 or f32) [T, G * N].
    """
    _expect(groups >= 1 and weight.shape[0] % groups == 0, f"weight rows {weight.shape[0]} must split into {groups} groups")
    n, half_k = weight.shape[0] // groups, weight.shape[1]
    k = 2 * half_k
    _expect(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == groups * k and x.shape[0] >= 1
            and x.is_contiguous(), f"x must be contiguous bf16 [T >= 1, G*K={groups * k}], got {x.dtype} {tuple(x.shape)}")
    _expect(weight_scale.numel() == groups * swizzled_nbytes(n, k // 16), "weight_scale must hold swz(G*N, K/16) bytes")
    _expect(alpha.dtype == torch.float32 and alpha.numel() == 1 and alpha.is_cuda, "alpha must be a float32 CUDA scalar")
    if out is None:
        out = torch.empty(x.shape[0], groups * n, dtype=out_dtype, device=x.device)
    _expect(tuple(out.shape) == (x.shape[0], groups * n) and out.dtype in (torch.bfloat16, torch.float32)
            and out.is_contiguous(), f"out must be contiguous bf16/f32 [T, G*N={groups * n}], got {out.dtype} "
                                     f"{tuple(out.shape)}")
    op = linear_op(n, k, x.shape[0], out.dtype == torch.bfloat16, groups)
    if isinstance(op, Sm90Nvfp4WgmmaGemm):
        staged = torch.empty_like(x)
        _launch(_PERMUTE, [x, staged])
        x = staged
    if op.k_splits > 1:
        out.zero_()  # the K shares add into it
    _launch(op, _operands(x, weight, weight_scale, alpha, out))
    return out
