"""PyTorch reference for the routed-expert MoE layer on format-1 NVFP4 weights (CPU or GPU).

Contract (DeepSeek-V4 routed experts, ``inference/model.py``), for every token t and every slot j
of its top-k, with ``e = topk_ids[t, j]`` and ``w = topk_weights[t, j]``:

    gate, up = deinterleave(x[t] @ W13[e].T)          # fp32; W13 rows interleaved by 8, gate first
    up   = clamp(up, -L, L);  gate = clamp(gate, max=L) # L = swiglu_limit (no clamp when None)
    h    = silu(gate) * up * w                          # the routing weight multiplies h before w2
    out[t] += h @ W2[e].T

``W13[e]`` / ``W2[e]`` are the dequantised format-1 tensors (``e2m1 x e4m3 x alpha``, scales in the
128x4 swizzle; see ``docs/format.md``). ``w13_alpha`` is format 1's ``[E, 2]`` pair (gate rows
take ``alpha[e, 0]``, up rows ``alpha[e, 1]``); an ``[E]`` alpha is shared by both halves. Only the experts that some token selects are decoded, one
at a time, so memory stays at one expert's fp32 weights. A repeated expert id in one row counts
once per occurrence. The result is float32 ``[T, H]`` whatever the dtype of ``x``; the arithmetic
is float32 (pass float64-castable inputs through :func:`moe_reference_dense` to check it).

This is the CPU path of the runtime and the oracle of the CuTeDSL kernels: keep the signature.
"""

from __future__ import annotations

import torch

from .nvfp4_reference import decode_gate_up, decode_weight
from .row_tiles import untile_rows


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` (no clamp when ``swiglu_limit`` is None)."""
    if swiglu_limit is not None:
        up = up.clamp(-swiglu_limit, swiglu_limit)
        gate = gate.clamp(max=swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def _check(x, topk_ids, topk_weights, w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be [T={t}, k]")
    if w13.dim() != 3 or w13.shape[2] * 2 != h or w13.dtype != torch.uint8:
        raise ValueError(f"w13 must be uint8 [E, 2I, H/2={h // 2}], got {w13.dtype} {tuple(w13.shape)}")
    e, two_i, _ = w13.shape
    if w2.dim() != 3 or w2.shape[0] != e or w2.shape[1] != h or w2.shape[2] * 4 != two_i or w2.dtype != torch.uint8:
        raise ValueError(f"w2 must be uint8 [E={e}, H={h}, I/2={two_i // 4}], got {w2.dtype} {tuple(w2.shape)}")
    if w13_scale.shape[0] != e or w2_scale.shape[0] != e or w2_alpha.shape != (e,) or \
            w13_alpha.shape not in ((e,), (e, 2)):
        raise ValueError(f"scales must be [E={e}, bytes], w13_alpha [E, 2] (or [E]) and w2_alpha [E]; got "
                         f"{tuple(w13_alpha.shape)} and {tuple(w2_alpha.shape)}")


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor, w13_alpha: torch.Tensor,
                  w2: torch.Tensor, w2_scale: torch.Tensor, w2_alpha: torch.Tensor,
                  swiglu_limit: float | None, weight_tiles: bool = False) -> torch.Tensor:
    """Routed-expert MoE on format-1 NVFP4 weights, float32 ``[T, H]`` (contract in the module docstring).

    Args:
        x: activations ``[T, H]`` (bf16 or float).
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        topk_weights: ``[T, k]`` routing weights (already renormalised and scaled).
        w13, w13_scale, w13_alpha: ``uint8 [E, 2I, H/2]``, ``uint8 [E, swz(2I, H/16)]``, ``float32 [E, 2]``
            (gate, up; or ``[E]`` shared).
        w2, w2_scale, w2_alpha: ``uint8 [E, H, I/2]``, ``uint8 [E, swz(H, I/16)]``, ``float32 [E]``.
        swiglu_limit: the clamp ``L`` (``config.swiglu_limit``), or None for no clamp.
        weight_tiles: ``w13`` and ``w2`` are in Hopper row tiles (``row_tiles``, ``--target sm90``); each expert
            used is un-tiled when it is decoded, so no row-major copy of all experts is made.

    Raises:
        ValueError: on shapes or dtypes that do not match the contract.
    """
    _check(x, topk_ids, topk_weights, w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha)
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        tokens = token_of[sel]
        w13_e, w2_e = (untile_rows(w13[e]), untile_rows(w2[e])) if weight_tiles else (w13[e], w2[e])
        gate_w, up_w = decode_gate_up(w13_e, w13_scale[e], w13_alpha[e])
        xs = xf[tokens]
        h = swiglu_clamped(xs @ gate_w.T, xs @ up_w.T, swiglu_limit) * flat_w[sel, None]
        out.index_add_(0, tokens, h @ decode_weight(w2_e, w2_scale[e], w2_alpha[e]).T)
    return out


def moe_reference_dense(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                        swiglu_limit: float | None) -> torch.Tensor:
    """The same layer on plain dense weights (``w1``, ``w3`` [E, I, H], ``w2`` [E, H, I]) in their dtype.

    A straightforward loop over (token, slot) pairs, used to check :func:`moe_reference` in float64.
    """
    out = torch.zeros(x.shape, dtype=w1.dtype, device=x.device)
    xd = x.to(w1.dtype)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = swiglu_clamped(w1[e] @ xd[t], w3[e] @ xd[t], swiglu_limit) * topk_weights[t, j].to(w1.dtype)
            out[t] += w2[e] @ h
    return out


def random_moe_weights(experts: int, hidden: int, intermediate: int, *, generator: torch.Generator | None = None,
                       device: torch.device | str = "cpu", subnormal_fraction: float = 0.02,
                       distinct_halves: bool = True) -> dict[str, torch.Tensor]:
    """Random format-1 expert weights (test and benchmark fixture), never zeros.

    Every E2M1 code occurs (-0 and 0.5 included); block scales are E4M3 bytes in [0.25, 3] plus a
    ``subnormal_fraction`` of subnormal bytes (2**-9 .. 7 * 2**-9); alphas are sized so that
    x ~ N(0, 1) gives gate/up of a few units (the SwiGLU clamp at 10 is reached now and then) and
    outputs of order one; ``w13_alpha`` is the format's [E, 2] (gate, up) pair, two different
    values unless ``distinct_halves`` is False (for anchors that take one scale per expert).
    Returns the nine tensors of :func:`moe_reference` by name.
    """
    from .swizzle import swizzle_block_scales

    dev = torch.device(device)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=generator)

    def scales(rows, cols):
        normal = torch.randint(0x28, 0x45, (experts, rows, cols), dtype=torch.uint8, device=dev, generator=generator)
        sub = torch.randint(1, 8, (experts, rows, cols), dtype=torch.uint8, device=dev, generator=generator)
        pick = torch.rand((experts, rows, cols), device=dev, generator=generator) < subnormal_fraction
        s = torch.where(pick, sub, normal)
        return torch.stack([swizzle_block_scales(s[e]) for e in range(experts)])

    def alphas(k):
        base = 3.0 / (3.5 * k ** 0.5)
        return base * (0.5 + torch.rand(experts, device=dev, generator=generator))

    return {
        "w13": codes(experts, 2 * intermediate, hidden // 2),
        "w13_scale": scales(2 * intermediate, hidden // 16),
        "w13_alpha": torch.stack([a := alphas(hidden), alphas(hidden) if distinct_halves else a], dim=1),
        "w2": codes(experts, hidden, intermediate // 2),
        "w2_scale": scales(hidden, intermediate // 16),
        "w2_alpha": alphas(intermediate) / 3.0,
    }
