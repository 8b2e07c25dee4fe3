"""The mHC ``hc_pre`` before a sublayer on the H200: ``sm90_hc_pre`` (cuBLAS's ``x @ fn.T``, then one CTA a token)
against ``sm90_hc_pre_fused`` (the product in the kernel, a token over a cluster of CTAs: ``Sm90HcPreFused``), at
V4-Flash's and V4-Pro's widths (4 streams, 20 Sinkhorn rounds, the sublayer's RMSNorm), N = 1, 8, 32, 128 tokens.

Each variant is timed two ways, CUDA graphs both (``gpu_timing``):

* ``cold``: one call a replay, the L2 flushed before each (``ColdTimer``): a decode step, where the layer's other
  weights stream through the L2 between two ``hc_pre`` calls, so ``fn`` (1.5 MB for V4-Flash, 2.75 MB for V4-Pro)
  comes from HBM;
* ``warm``: ``--calls`` calls back to back in one graph, the replay's time divided by them (``fn`` in the L2 after
  the first).

The fused kernel is timed with the cluster its heuristic picks (``fused``) and with each other cluster it can run
(``fused_c16``, ``fused_c8``, ...), so one run says whether and up to which N the runtime should call it, and with
which cluster.

    python bench/hc_pre_bench.py   # writes bench/results/hc_pre_bench.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from gpu_timing import ColdTimer, capture

MODELS = {"V4-Flash": 4096, "V4-Pro": 7168}
TOKENS = (1, 8, 32, 128)
HC, ITERS, EPS = 4, 20, 1e-6


def operands(h: int, n: int, gen: torch.Generator) -> tuple:
    m = (2 + HC) * HC
    x = torch.randn(n, HC, h, device="cuda", generator=gen) * 3
    fn = torch.randn(m, HC * h, device="cuda", generator=gen) * (4 / (HC * h) ** 0.5)
    base = torch.randn(m, device="cuda", generator=gen)
    scale = torch.rand(3, device="cuda", generator=gen) + 0.5
    weight = torch.rand(h, device="cuda", generator=gen) + 0.5
    return x, fn, base, scale, weight


def main() -> None:
    from nvfp4_megamoe.kernels.sm90_heuristics import HC_PRE_CLUSTERS, hc_pre_fused_config
    from nvfp4_megamoe.kernels.sm90_mhc import Sm90HcPreFused, sm90_hc_pre, sm90_hc_pre_fused

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls in one graph (warm)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hc_pre_bench.json"))
    args = ap.parse_args()
    timer, rows = ColdTimer(), []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, h in MODELS.items():
        for n in TOKENS:
            x, fn, base, scale, weight = operands(h, n, gen)
            kw = dict(iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm_weight=weight)
            picked = hc_pre_fused_config(HC, h, n, iters=ITERS, hc_eps=EPS, norm_eps=EPS)
            variants = {"today": lambda: sm90_hc_pre(x, fn, base, scale, **kw),
                        "fused": lambda: sm90_hc_pre_fused(x, fn, base, scale, **kw)}
            for c in HC_PRE_CLUSTERS:
                if Sm90HcPreFused.can_implement(replace(picked, cluster=c)):
                    variants[f"fused_c{c}"] = lambda c=c: sm90_hc_pre_fused(x, fn, base, scale, cluster=c, **kw)
            row = dict(model=model, hidden=h, tokens=n, picked_cluster=picked.cluster)
            want = variants["today"]()
            for name, fn_call in variants.items():
                try:
                    got = fn_call()
                    row[f"{name}_max_abs_diff"] = max(float((g - w).abs().max()) for g, w in zip(got, want))
                    g = capture(fn_call)
                    row[f"{name}_cold_us"] = timer.time(g, args.reps)
                    del g
                    g = capture(lambda f=fn_call: [f() for _ in range(args.calls)])
                    row[f"{name}_warm_us"] = timer.time(g, args.reps) / args.calls
                    del g
                except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
                    row[f"{name}_error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
                   "calls": args.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
