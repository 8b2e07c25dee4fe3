"""Compile (warm-up) and first-call times of the SM90 MoE layer, in a fresh process on the GPU.

For V4-Flash and V4-Pro expert shapes: time ``Sm90Nvfp4Moe.warmup()`` (every plan a call with
T <= 4096 can pick), then two eager calls at T = 1 and T = 4096 (the first one also loads the modules).

    python bench/moe_warmup.py
"""

from __future__ import annotations

import time

import torch

from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.kernels.sm90_config import MoeShape
from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe

MODELS = {"V4-Flash": (4096, 2048, 256, 6), "V4-Pro": (7168, 3072, 384, 6)}


def timed_call(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(name: str, h: int, i: int, e: int, k: int) -> str:
    layer = Sm90Nvfp4Moe(MoeShape(h, i, e, k, 10.0), max_tokens=4096)
    t0 = time.perf_counter()
    n = layer.warmup()
    compile_s = time.perf_counter() - t0
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False)
    calls = []
    for t in (1, 4096):
        x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32)
        wts = torch.rand(t, k, device="cuda", generator=gen)
        first = timed_call(lambda: layer(x, ids, wts, **w))
        second = timed_call(lambda: layer(x, ids, wts, **w))
        calls.append(f"T={t}: first {first * 1e3:.2f} ms, second {second * 1e3:.2f} ms")
    return f"{name}: warm-up compiled {n} plans in {compile_s:.1f} s; " + "; ".join(calls)


def main() -> None:
    for name, shape in MODELS.items():
        print(measure(name, *shape), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
