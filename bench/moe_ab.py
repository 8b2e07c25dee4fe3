"""A/B of configurations of the project's MoE layer in interleaved rounds, with a per-kernel timeline, on the GPU.

Where ``moe_bench.py`` times each implementation once after the other, this times the variants in rounds (round r:
20 cold replays of each variant in turn), because at prefill sizes the H200 runs at its power cap and its clock,
and so every timing, drifts within a run by more than the differences sought (``docs/design/moe_kernels.md``, "What
bounds the layer"). Then it profiles a few cold replays of each variant (``torch.profiler``) for the graph launch
gap, each kernel's time and the gaps between kernels. Weights are random format 1 in Hopper row tiles (``--target
sm90``), routing uniform random top-k, as in ``moe_bench.py``.

    python bench/moe_ab.py '{"base": {}, "no_pdl": {"both": {"pdl": false, "max_ctas": 0}}}' V4-Flash 1 5
    # VARIANTS (JSON: name -> spec of ``moe_bench.variant_layer``; weights in row tiles unless the spec says
    # "weight_tiles": false), MODELS, TOKENS (comma-separated), ROUNDS; writes $OUT/probe_<models>_<tokens>.json
    # (or ./ without OUT)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

from gpu_timing import ColdTimer, capture, measure_copy
from moe_bench import MODELS, routed_inputs, variant_layer

from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights

REPS = 20  # cold replays per variant and round


def capture_variants(variants: dict, model: str, w: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                     max_tokens: int) -> tuple[dict, dict, dict]:
    """Per variant (name -> ``moe_bench.variant_layer`` spec, on row-tiled weights ``w``) of ``model``: its layer, the
    CUDA graph of one call on (``x``, ``ids``, ``wts``), and that call's output (NaN until the graph runs). The caller
    keeps the layers referenced while the graphs replay: the graphs use their workspaces."""
    h = MODELS[model][0]
    layers, graphs, outs = {}, {}, {}
    for name, spec in variants.items():
        layer = layers[name] = variant_layer(model, {"weight_tiles": True, **spec}, max_tokens)
        out = outs[name] = torch.full((x.shape[0], h), float("nan"), device="cuda")
        graphs[name] = capture(lambda layer=layer, out=out: layer(x, ids, wts, **w, out=out))
    return layers, graphs, outs


def timeline(graph: torch.cuda.CUDAGraph, timer: ColdTimer, replays: int) -> tuple[list[str], list[float]]:
    """Kernel names and the median over ``replays`` cold replays (after a first) of [launch gap (flush end to the
    first kernel), kernel, gap, kernel, ..., span (flush end to the last kernel's end)] in us."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays + 1):
            timer.flush.fill_(1)
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    replay_kernels: list[tuple[float, list]] = []  # (flush end, [(name, start, end)]) per replay
    for ev in events:
        if "FillFunctor" in ev.name:  # the flush opens a replay
            replay_kernels.append((ev.time_range.end, []))
        elif replay_kernels:
            replay_kernels[-1][1].append((ev.name, ev.time_range.start, ev.time_range.end))
    rows = []
    for flush_end, kernels in replay_kernels[1:]:
        row = [kernels[0][1] - flush_end]
        for j, (_, start, end) in enumerate(kernels):
            row += [end - start] + ([kernels[j + 1][1] - end] if j + 1 < len(kernels) else [])
        rows.append(row + [kernels[-1][2] - flush_end])
    return [name for name, _, _ in replay_kernels[-1][1]], [statistics.median(c) for c in zip(*rows)]


def main() -> None:
    variants = json.loads(sys.argv[1])
    models = sys.argv[2].split(",") if len(sys.argv) > 2 else ["V4-Flash"]
    tokens = [int(t) for t in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    copy = measure_copy()
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    timer = ColdTimer()
    results: dict = {"copy": copy}
    for model in models:
        h, i, e, k = MODELS[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = tile_expert_weights(random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False))
        per_expert = sum(w[n][0].numel() for n in ("w13", "w13_scale", "w2", "w2_scale"))
        for t in tokens:
            x, ids, wts = routed_inputs(t, h, e, k, gen)
            floor = int(torch.unique(ids).numel()) * per_expert / copy * 1e6  # the bytes floor only
            layers, graphs, outs = capture_variants(variants, model, w, x, ids, wts, max(tokens))  # noqa: F841 (kept)
            first = next(iter(outs.values()))
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(rounds):
                for name, graph in graphs.items():
                    times[name].append(timer.time(graph, REPS))
            for name, graph in graphs.items():
                med = statistics.median(times[name])
                err = float((outs[name] - first).norm() / first.norm())
                # a kernel that computes garbage can run fast: its timing is flagged, not silently reported
                finite = bool(torch.isfinite(outs[name]).all())
                names, tl = timeline(graph, timer, 10 if t <= 64 else 4)
                print(f"{model} T={t} {name:14s} {med:9.1f} us (bytes floor {floor / med:.1%})  rounds "
                      f"{[round(v, 1) for v in times[name]]}  relerr vs {next(iter(variants))} {err:.1e}"
                      + ("" if finite else "  NON-FINITE OUTPUT: not a valid timing") + "\n"
                      f"  timeline: launch {tl[0]:.1f} | "
                      + " | ".join(f"{nm[:24]} {tl[1 + 2 * j]:.1f}" + (f" gap {tl[2 + 2 * j]:.1f}" if j + 1 < len(names)
                                                                       else "") for j, nm in enumerate(names))
                      + f" | span {tl[-1]:.1f} us", flush=True)
                results[f"{model}/{t}/{name}"] = {"us": med, "rounds": times[name], "floor_us": floor,
                                                  "timeline_us": tl, "kernels": names, "finite": finite}
    path = Path(os.environ.get("OUT", "."), f"probe_{'_'.join(models)}_{'_'.join(map(str, tokens))}.json")
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
