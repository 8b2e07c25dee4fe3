"""Where the time of a batch-1 decode-attention step goes: fixed costs against tiny kernels.

Every case is one CUDA-graph replay after a 512 MiB buffer rewrite (cold L2, ``gpu_timing.time_into``
as in ``attention_bench.py``), median of 25, written as ``<case>_us`` (``<case>_error`` if it cannot run):

* ``tiny1/2/4``: 1, 2, 4 one-element torch kernels (the floor of a graph of that many launches);
* ``copy1MB``: a 1 MiB torch device copy;
* ``h{64,128}_win{16,64,128}_...``: window-only decode attention, one request, a ring of 16/64/128
  full slots, one split (one CTA per head block, no combine) or 2 splits (combine kernel or a 2-CTA
  cluster), chunk 64 (default) or 16;
* ``h{64,128}_csa_...``: the batch-1 CSA step of ``attention_bench.py`` (window 128 + top-k 512 / 1024
  of 2048 entries) with the default split and other splits, clusters and chunks;
* ``h{64,128}_hca4k_...``: HCA at 4K context (window 128 + 32 entries);
* ``moe_flash_t1``: one V4-Flash MoE layer at T = 1, for scale.

    python bench/latency_probe.py   # writes bench/results/latency_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import ColdTimer, time_into  # noqa: E402

SCALE = 512 ** -0.5


def main() -> None:
    from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
    from nvfp4_megamoe.kernels.sm90_decode_attention import decode_attention
    from nvfp4_megamoe.kernels.sm90_moe import Sm90NvFp4MoE

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "latency_probe.json"))
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    res: dict[str, float | str] = {}
    timer = ColdTimer()

    def time_case(name: str, fn) -> None:
        time_into(res, name, fn, timer, args.reps)
        print(name, res.get(f"{name}_us", res.get(f"{name}_error")), flush=True)

    x = torch.zeros(4, dtype=torch.int32, device="cuda")
    time_case("tiny1", lambda: x.add_(1))
    time_case("tiny2", lambda: (x.add_(1), x.add_(1)))
    time_case("tiny4", lambda: [x.add_(1) for _ in range(4)])
    src = torch.randn(1 << 18, device="cuda")
    dst = torch.empty_like(src)
    time_case("copy1MB", lambda: dst.copy_(src))

    gen = torch.Generator(device="cuda").manual_seed(0)
    for h in (64, 128):
        q = torch.randn(1, h, 512, device="cuda", generator=gen).bfloat16()
        sink = torch.randn(h, device="cuda", generator=gen)
        out = torch.empty(1, h, 512, device="cuda", dtype=torch.bfloat16)
        for w in (16, 64, 128):
            kvw = torch.randn(1, w, 512, device="cuda", generator=gen).bfloat16()
            wl = torch.full((1,), w, dtype=torch.int32, device="cuda")
            for kw in ({"splits": 1}, {"splits": 1, "chunk": 16, "stages": 4}, {"splits": 2}, {"cluster": 2}):
                if w == 16 and kw.get("chunk") != 16:
                    continue
                time_case(f"h{h}_win{w}_{kw}",
                          lambda kw=kw, kvw=kvw, wl=wl: decode_attention(q, kvw, wl, None, None, sink, SCALE, out=out, **kw))
        kvw = torch.randn(1, 128, 512, device="cuda", generator=gen).bfloat16()
        wl = torch.full((1,), 128, dtype=torch.int32, device="cuda")
        kvc = torch.randn(1, 2048, 512, device="cuda", generator=gen).bfloat16()
        k = 512 if h == 64 else 1024
        idx = torch.argsort(torch.rand(1, 2048, device="cuda", generator=gen), dim=1)[:, :k].int().contiguous()
        for kw in ({}, {"splits": 5}, {"cluster": 4}, {"cluster": 8}, {"cluster": 16}, {"chunk": 32, "stages": 4},
                   {"chunk": 32, "stages": 4, "splits": 20}, {"chunk": 16, "stages": 4, "splits": 40}):
            time_case(f"h{h}_csa_{kw}", lambda kw=kw: decode_attention(q, kvw, wl, kvc, idx, sink, SCALE, out=out, **kw))
        kvh = torch.randn(1, 32, 512, device="cuda", generator=gen).bfloat16()
        for kw in ({}, {"cluster": 1}, {"splits": 1}):
            time_case(f"h{h}_hca4k_{kw}", lambda kw=kw: decode_attention(q, kvw, wl, kvh, None, sink, SCALE, out=out, **kw))

    h, i, e, k = 4096, 2048, 256, 6
    w = random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False)
    layer = Sm90NvFp4MoE(hidden=h, intermediate=i, experts=e, top_k=k, swiglu_limit=10.0, max_tokens=4)
    xx = torch.randn(1, h, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(1, e, device="cuda", generator=gen).topk(k, dim=1).indices
    wts = torch.rand(1, k, device="cuda", generator=gen)
    o = torch.empty(1, h, device="cuda")
    time_case("moe_flash_t1", lambda: layer(xx, ids, wts, **w, out=o))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cold": res}, f, indent=1)


if __name__ == "__main__":
    main()
