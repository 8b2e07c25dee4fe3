"""CPU stand-in operands for compiling the SM90 kernels without a GPU (``CUTE_DSL_ARCH=sm_90a``): the kernels
specialise on dtypes, ranks and alignments only, so small zero tensors of the right kinds will do."""

from __future__ import annotations

import torch

from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes


def decode_attention_args(b: int = 2, h: int = 128, w: int = 128, n: int = 40, k: int = 16, s: int = 3
                          ) -> list[torch.Tensor]:
    """q, kv_window, window_len, kv_compressed, indices, sink, out, o_part, ml of ``Sm90DecodeAttention``
    (``Sm90DecodeAttentionCombine`` takes o_part, ml, sink, out)."""
    bf = dict(dtype=torch.bfloat16)
    return [torch.zeros(b, h, 512, **bf), torch.zeros(b, w, 512, **bf), torch.zeros(b, dtype=torch.int32),
            torch.zeros(b, n, 512, **bf), torch.zeros(b, k, dtype=torch.int32), torch.zeros(h),
            torch.zeros(b, h, 512, **bf), torch.zeros(b, h, s, 512), torch.zeros(b, h, s, 2)]


def prefill_attention_args(r: int = 4, s: int = 2, h: int = 128, rows: int = 130, n: int = 40, k: int = 16,
                           splits: int = 3) -> list[torch.Tensor]:
    """q, rows, window_start, window_len, kv_compressed, indices, sink, out, o_part, ml of ``Sm90PrefillAttention``
    (R = ``r`` requests of ``s`` sequences; HCA takes counts [R, 1] where the indices are)."""
    bf, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    return [torch.zeros(r, h, 512, **bf), torch.zeros(s, rows, 512, **bf), torch.zeros(r, **i32),
            torch.zeros(r, **i32), torch.zeros(s, n, 512, **bf), torch.zeros(r, k, **i32), torch.zeros(h),
            torch.zeros(r, h, 512, **bf), torch.zeros(r, h, splits, 512), torch.zeros(r, h, splits, 2)]


def moe_gemm_args(h: int, i: int, e: int = 2, t: int = 3, top_k: int = 6
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The operands of the routing kernel, L1 and L2 of an MoE layer (H, I) with ``e`` experts and ``t`` tokens."""
    p = t * top_k
    i32 = dict(dtype=torch.int32)
    ids, wts = torch.zeros(p, dtype=torch.int64), torch.zeros(p)
    tok, rank, tiles, ntiles = torch.zeros(p, **i32), torch.zeros(p, **i32), torch.zeros(9, 3, **i32), torch.zeros(1, **i32)
    w13 = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    s13 = torch.zeros(e, swizzled_nbytes(2 * i, h // 16), dtype=torch.uint8)
    alpha_pairs = torch.zeros(2 * e)  # L1 takes the [E, 2] (gate, up) pairs flattened
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    hbuf = torch.zeros(p, i, dtype=torch.bfloat16)
    w2 = torch.zeros(e, h, i // 2, dtype=torch.uint8)
    s2 = torch.zeros(e, swizzled_nbytes(h, i // 16), dtype=torch.uint8)
    return ([ids, wts, tok, wts, tiles, ntiles, rank],
            [w13, s13, alpha_pairs, x, tok, wts, tiles, ntiles, hbuf, torch.zeros(t, h)],
            [w2, s2, torch.zeros(e), hbuf, tok, wts, tiles, ntiles, torch.zeros(t, h), torch.zeros(t, h)])


def hc_pre_args(hc: int, h: int = 64, n: int = 5) -> list[torch.Tensor]:
    """x, mm, base, scale, out, pre, post, comb, weight of ``Sm90HcPre`` for ``n`` tokens of ``hc`` streams of
    ``h``."""
    m = (2 + hc) * hc
    return [torch.zeros(n, hc * h), torch.zeros(n, m), torch.zeros(m), torch.zeros(3), torch.zeros(n, h),
            torch.zeros(n, hc), torch.zeros(n, hc), torch.zeros(n, hc * hc), torch.zeros(h)]


def hc_post_args(hc: int, h: int = 64, n: int = 5, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """out, x, post, comb, y of ``Sm90HcPost`` for ``n`` tokens of ``hc`` streams of ``h`` (``out`` in ``dtype``)."""
    return [torch.zeros(n, h, dtype=dtype), torch.zeros(n, hc * h), torch.zeros(n, hc), torch.zeros(n, hc * hc),
            torch.zeros(n, hc * h)]


# (N, K, groups) of V4-Flash's and V4-Pro's FP8 linears: wq_a, wq_b, wkv, wo_a, wo_b, shared w1/w3, w2, indexer wq_b
FP8_LINEAR_SHAPES = [(1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (1024, 4096, 8), (4096, 8192, 1),
                     (2048, 4096, 1), (4096, 2048, 1), (8192, 1024, 1), (1536, 7168, 1), (65536, 1536, 1),
                     (1024, 8192, 16), (7168, 16384, 1), (3072, 7168, 1), (7168, 3072, 1)]


def fp8_gemm_args(scale_f32: bool = False, x_f32: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(x, xq, sx) of ``Sm90Fp8ActQuant`` and (xq, sx, w, sw, out) of ``Sm90Fp8Gemm``."""
    x = torch.zeros(3, 256, dtype=torch.float32 if x_f32 else torch.bfloat16)
    xq, sx = torch.zeros(3, 256, dtype=torch.uint8), torch.zeros(3, 2)
    sw = torch.zeros(2, 2, dtype=torch.float32 if scale_f32 else torch.uint8)
    return [x, xq, sx], [xq, sx, torch.zeros(256, 256, dtype=torch.uint8), sw, torch.zeros(3, 256)]


def fp8_linear_args(scale_f32: bool = False, out_bf16: bool = False, x_f32: bool = False) -> list[torch.Tensor]:
    """w, scale, x, out of ``Sm90Fp8Linear``."""
    scale = torch.zeros(2, 2, dtype=torch.float32 if scale_f32 else torch.uint8)
    out = torch.zeros(3, 256, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    x = torch.zeros(3, 256, dtype=torch.float32 if x_f32 else torch.bfloat16)
    return [torch.zeros(256, 256, dtype=torch.uint8), scale, x, out]


def random_fp8_weight(n: int, k: int, groups: int, scale_f32: bool, gen: torch.Generator,
                      subnormal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weight bytes [G * N, K] (no NaN code; ``subnormal``: only subnormal magnitudes) and 128 x 128 block
    scales, E8M0 (2**-17 .. 2**-3) or float32, drawn from ``gen`` on its device."""
    dev, rows = gen.device, groups * n
    mag = torch.randint(0, 0x08 if subnormal else 0x7F, (rows, k), device=dev, generator=gen)  # no NaN code
    w = (mag | (torch.randint(0, 2, (rows, k), device=dev, generator=gen) << 7)).to(torch.uint8)
    blocks = (-(-rows // 128), k // 128)
    if scale_f32:
        return w, torch.rand(blocks, device=dev, generator=gen) * 2 ** -9 + 2 ** -11
    return w, torch.randint(110, 125, blocks, device=dev, generator=gen).to(torch.uint8).view(torch.float8_e8m0fnu)
