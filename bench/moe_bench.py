"""Benchmark one routed MoE layer (L1 + SwiGLU + L2 + reduce, routing given) on the GPU.

For V4-Flash and V4-Pro expert shapes and T tokens (uniform random top-k, distinct experts), each
implementation is captured in a CUDA graph and replayed with a cold L2 (a 512 MiB buffer is
rewritten before every timed replay); the median of ``--reps`` replays is reported, or with ``--rounds R`` the
median of R such medians taken in interleaved rounds (each round times every implementation in turn), so that a
clock that drifts over the run, or the state one contender leaves the GPU in, does not fall on one of them.

Implementations: ``ours`` (kernels/sm90_moe.py); ``torch_bf16`` (torch._grouped_mm on BF16 weights
dequantised once, sort/scatter in torch); ``humming`` and ``quack`` anchors when importable.
``floor`` = max(NVFP4 bytes of the experts touched / measured copy bandwidth, FLOPs / measured BF16
matmul rate), both ceilings measured at start. Writes JSON (and a PNG plot with --plot).

    python bench/moe_bench.py --reps 20 --rounds 3 --impls ours,ours_sm90,humming,quack,torch_bf16 \
        --variants '{"ours_sm90": {"weight_tiles": true}}' --plot bench/results/moe_bench.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import ColdTimer, capture, measure_bf16_matmul, measure_copy  # noqa: E402

from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.kernels.nvfp4_reference import decode_weight
from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights
from nvfp4_megamoe.kernels.sm90_config import MoeShape, replace_tilings
from nvfp4_megamoe.kernels.sm90_heuristics import moe_plan
from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe

MODELS = {"V4-Flash": (4096, 2048, 256, 6), "V4-Pro": (7168, 3072, 384, 6)}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
ANCHORS = ("humming", "quack", "torch_bf16")
LIMIT = 10.0


def routed_inputs(t: int, h: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``x`` bf16 [T, H], uniform random top-k ``ids`` (distinct experts per token) and routing weights [T, k]."""
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
    return x, ids, torch.rand(t, k, device="cuda", generator=gen)


def measure_ceilings() -> dict:
    return {"copy_bytes_per_s": measure_copy(), "bf16_flops_per_s": measure_bf16_matmul()}


def torch_bf16_layer(w13b, w2b, e, k):
    """Reference-speed anchor: sort pairs, two torch._grouped_mm, SwiGLU, weighted index_add."""
    def run(x, ids, wts, out):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // k
        xs = x[tok]
        y = torch._grouped_mm(xs, w13b.transpose(1, 2), offs=offs)
        y = y.view(y.shape[0], -1, 2, 8).float()
        gate, up = y[:, :, 0].reshape(y.shape[0], -1), y[:, :, 1].reshape(y.shape[0], -1)
        hh = torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
        hh = (hh * wts.reshape(-1)[order, None]).to(torch.bfloat16)
        o = torch._grouped_mm(hh, w2b.transpose(1, 2), offs=offs)
        out.zero_()
        out.index_add_(0, tok, o.float())
    return run


def quack_layer(w: dict, h: int, i: int, k: int):
    """QuACK anchor: ``gemm_w4a16(wformat="nvfp4")`` looped over the active experts (plan made on the
    host from the given routing, so the loop is static inside the captured graph), SwiGLU and the
    weighted index_add in torch."""
    from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

    from nvfp4_megamoe.kernels.swizzle import unswizzle_block_scales
    cache: dict[int, tuple] = {}

    def prepared(e: int) -> tuple:
        if e not in cache:
            s13 = unswizzle_block_scales(w["w13_scale"][e], 2 * i, h // 16).contiguous()
            s2 = unswizzle_block_scales(w["w2_scale"][e], h, i // 16).contiguous()
            b13, f13 = prepare_w4_weight(w["w13"][e], s13, "nvfp4")
            b2, f2 = prepare_w4_weight(w["w2"][e], s2, "nvfp4")
            cache[e] = (b13, f13, float(w["w13_alpha"][e, 0]), b2, f2, float(w["w2_alpha"][e]))
        return cache[e]

    def build(x, ids, wts, out):
        flat = ids.reshape(-1)
        plan = []
        for e in torch.unique(flat).tolist():
            sel = (flat == e).nonzero().squeeze(1)
            plan.append((prepared(e), (sel // k).contiguous(), wts.reshape(-1)[sel].contiguous()))

        def run():
            out.zero_()
            for (b13, f13, a13, b2, f2, a2), tok, wsel in plan:
                y = gemm_w4a16(x.index_select(0, tok), b13, f13, tensor_scale=a13, wformat="nvfp4")
                y = y.view(y.shape[0], -1, 2, 8).float()
                gate, up = y[:, :, 0].reshape(y.shape[0], -1), y[:, :, 1].reshape(y.shape[0], -1)
                hh = (torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT) * wsel[:, None])
                o = gemm_w4a16(hh.to(torch.bfloat16).contiguous(), b2, f2, tensor_scale=a2, wformat="nvfp4")
                out.index_add_(0, tok, o.float())
        return run
    return build


def moe_align_block_size_torch(ids: torch.Tensor, experts: int, block: int):
    """vLLM's ``moe_align_block_size`` contract in torch ops, fixed sizes (graph-capturable, no host sync).

    ``sorted_ids`` int32 [P + E*(block-1)]: the flat pair indices (t*k + j) grouped by expert, each
    expert's run padded to a multiple of ``block`` with the sentinel P; ``expert_ids`` int32 [blocks]:
    the expert of each block (blocks past the end repeat the last expert, their ids are all sentinel);
    ``num_tokens_padded`` int32 [1]: the padded length used.
    """
    flat = ids.reshape(-1).long()
    p = flat.numel()
    cap = p + experts * (block - 1)
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    raw_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = pad_start[e_sorted] + torch.arange(p, device=ids.device) - raw_start[e_sorted]
    sorted_ids = torch.full((cap,), p, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(cap // block, device=ids.device) * block
    expert_ids = torch.searchsorted(pad_end, blocks, right=True).clamp_(max=experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


def humming_layer(w: dict, h: int, i: int, e: int, k: int):
    """humming anchor, driven as vLLM's ``HummingIndexedExperts`` does: NVFP4 weights as a
    ``HummingWeightSchema`` (float4e2m1, float8e4m3 group-16 scales, per-expert tensor scale_2),
    ``HummingMethod.prepare_layer_meta`` + ``transform_humming_layer`` per sublayer, the tuning list from
    ``get_heuristics_config`` (indexed GEMM), ``moe_align_block_size`` tables for the block size it picks
    at T*k rows, two ``forward_layer`` calls, SwiGLU and the weighted top-k sum in torch."""
    import json as _json

    from humming import dtypes
    from humming.layer import HummingMethod
    from humming.schema import HummingWeightSchema

    from nvfp4_megamoe.kernels.swizzle import unswizzle_block_scales

    schema = HummingWeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e4m3, weight_scale_group_size=16,
                                 weight_scale_type="group", weight_scale_2_type="tensor")
    layer = torch.nn.Module()
    # stream-K configurations need a lock workspace on the layer (humming's own HummingLayer registers one)
    layer.register_buffer("locks", torch.zeros(1 << 16, dtype=torch.int32, device=w["w13"].device))
    for name, n, kk in (("w13", 2 * i, h), ("w2", h, i)):
        scale = torch.stack([unswizzle_block_scales(w[name + "_scale"][j], n, kk // 16) for j in range(e)])
        for suffix, t in (("weight", w[name].view(torch.int32)), ("weight_scale", scale.view(torch.float8_e4m3fn)),
                          ("weight_scale_2", w[name + "_alpha"].reshape(e, -1)[:, 0].float())):
            setattr(layer, f"{name}_{suffix}", torch.nn.Parameter(t.contiguous(), requires_grad=False))
        HummingMethod.prepare_layer_meta(layer, shape_n=n, shape_k=kk, weight_schema=schema, num_experts=e,
                                         torch_dtype=torch.bfloat16, sublayer_name=name)
        HummingMethod.transform_humming_layer(layer, sublayer_name=name)
    tune = {name: HummingMethod.get_default_tuning_configs(layer, gemm_type="indexed", sublayer_name=name)
            for name in ("w13", "w2")}
    compute = _json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
    tune_str = {name: _json.dumps(v) for name, v in tune.items()}

    def build(x, ids, wts, out):
        t = x.shape[0]
        valid = t * k
        block = next(cfg["block_shape"][0] for lo, hi, cfg in tune["w13"] if lo < valid <= hi)
        gate_up = torch.empty(valid, 2 * i, dtype=torch.bfloat16, device=x.device)
        down = torch.empty(valid, h, dtype=torch.bfloat16, device=x.device)

        def run():
            sorted_ids, expert_ids, ntp = moe_align_block_size_torch(ids, e, block)
            common = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=ntp, valid_shape_m=valid,
                          compute_config=compute)
            HummingMethod.forward_layer(layer, inputs=x, outputs=gate_up, top_k=k, tuning_config=tune_str["w13"],
                                        sublayer_name="w13", **common)
            y = gate_up.view(valid, -1, 2, 8).float()
            gate, up = y[:, :, 0].reshape(valid, -1), y[:, :, 1].reshape(valid, -1)
            act = (torch.nn.functional.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)).to(torch.bfloat16)
            HummingMethod.forward_layer(layer, inputs=act, outputs=down, top_k=1, tuning_config=tune_str["w2"],
                                        sublayer_name="w2", **common)
            out.copy_((down.view(t, k, h).float() * wts[:, :, None]).sum(1))
        return run
    return build



def variant_layer(model: str, spec: dict, max_tokens: int) -> Sm90Nvfp4Moe:
    """The project's layer of ``model``, configured by ``spec``: ``weight_tiles`` (w13 and w2 in Hopper row tiles, converter
    ``--target sm90``), ``wgmma`` (force a path), and ``l1`` / ``l2`` / ``both``: tiling fields replaced in the
    heuristics' plan (``sm90_config.replace_tilings``). ``{}`` is the shipped configuration on row-major weights."""
    spec = dict(spec)
    h, i, e, k = MODELS[model]
    shape = MoeShape(h, i, e, k, LIMIT, weight_tiles=bool(spec.pop("weight_tiles", False)))
    wgmma = spec.pop("wgmma", None)
    changes = {part: spec.pop(part) for part in ("l1", "l2", "both") if part in spec}
    if spec:
        raise SystemExit(f"unknown variant keys {sorted(spec)}: use weight_tiles, wgmma, l1, l2, both, tokens")
    if wgmma is None and not changes:
        return Sm90Nvfp4Moe(shape, max_tokens)
    return Sm90Nvfp4Moe(shape, max_tokens,
                        planner=lambda sh, t, sms: replace_tilings(moe_plan(sh, t, sms, wgmma=wgmma), **changes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of --reps replays per implementation")
    ap.add_argument("--impls", default="ours,torch_bf16")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe_bench.json"))
    ap.add_argument("--plot", default=None)
    ap.add_argument("--variant-max-tokens", type=int, default=1 << 30)
    ap.add_argument("--weight-tiles", action="store_true",
                    help="ours reads w13 and w2 in Hopper row tiles (converter --target sm90)")
    ap.add_argument("--variants", default="{}",
                    help='JSON {"ours_name": spec} of extra configurations of ours (``variant_layer``), e.g. '
                         '{"ours_sm90": {"weight_tiles": true}}')
    args = ap.parse_args()
    base_impls = args.impls.split(",")
    variant_names = set(json.loads(args.variants))
    unknown = [m for m in sorted(set(base_impls) | variant_names)
               if m not in ANCHORS + ("ours",) and not (m in variant_names and m.startswith("ours_"))]
    if unknown:  # would be skipped without a word
        ap.error(f"unknown implementations {unknown}: use {', '.join(ANCHORS)}, ours, or a --variants name "
                 "that starts with 'ours_'")
    tokens = [int(t) for t in args.tokens.split(",")]
    ceil = measure_ceilings()
    print(f"device {torch.cuda.get_device_name()}  copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s  "
          f"bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    timer = ColdTimer()
    results = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "tokens": tokens, "models": {}}
    for model in args.models.split(","):
        impls = list(base_impls)
        h, i, e, k = MODELS[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        # one w13 scale per expert: the anchors (humming, QuACK) take a single global scale per matrix
        w = random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False)
        per_expert = (w["w13"][0].numel() + w["w13_scale"][0].numel() + w["w2"][0].numel() + w["w2_scale"][0].numel())
        layer = variant_layer(model, {"weight_tiles": args.weight_tiles}, max(tokens))
        w_tiled = None  # w13 and w2 in Hopper row tiles, for the layers that read them so
        w13b = w2b = None
        quack = None
        humming = None
        variants = {}
        variant_tokens = {}
        for name, spec in json.loads(args.variants).items():
            spec = dict(spec)
            variant_tokens[name] = spec.pop("tokens", None)  # the T values this variant runs at (None: all)
            variants[name] = variant_layer(model, spec, max(tokens))
            impls = [m for m in impls if m != name] + [name]
        if "torch_bf16" in impls:
            w13b = torch.stack([decode_weight(w["w13"][j], w["w13_scale"][j], w["w13_alpha"][j, 0]).to(torch.bfloat16)
                                for j in range(e)])
            w2b = torch.stack([decode_weight(w["w2"][j], w["w2_scale"][j], w["w2_alpha"][j]).to(torch.bfloat16)
                               for j in range(e)])
        rows = []
        for t in tokens:
            x, ids, wts = routed_inputs(t, h, e, k, gen)
            touched = int(torch.unique(ids).numel())
            floor_bytes = touched * per_expert / ceil["copy_bytes_per_s"]
            floor_flops = 2 * t * k * (h * 2 * i + i * h) / ceil["bf16_flops_per_s"]
            row = {"T": t, "experts_touched": touched, "floor_us": max(floor_bytes, floor_flops) * 1e6,
                   "floor_bytes_us": floor_bytes * 1e6, "floor_flops_us": floor_flops * 1e6}
            outs, graphs = {}, {}
            for impl in impls:
                if impl in variants and (t > args.variant_max_tokens
                                         or (variant_tokens[impl] is not None and t not in variant_tokens[impl])):
                    continue
                out = torch.full((t, h), float("nan"), device="cuda")
                try:
                    if impl.startswith("ours"):
                        lay = layer if impl == "ours" else variants[impl]
                        tiled = lay.shape.weight_tiles
                        if tiled and w_tiled is None:
                            w_tiled = tile_expert_weights(w)
                        ww = w_tiled if tiled else w
                        fn = lambda: lay(x, ids, wts, **ww, out=out)  # noqa: E731
                    elif impl == "torch_bf16":
                        run = torch_bf16_layer(w13b, w2b, e, k)
                        fn = lambda: run(x, ids, wts, out)  # noqa: E731
                    elif impl == "humming":
                        if humming is None:
                            try:
                                humming = humming_layer(w, h, i, e, k)
                            except Exception as exc:  # set-up failed: report it at every T, try once
                                humming = exc
                        if isinstance(humming, Exception):
                            raise humming
                        fn = humming(x, ids, wts, out)
                    elif impl == "quack":
                        if quack is None:
                            quack = quack_layer(w, h, i, k)
                        fn = quack(x, ids, wts, out)
                    else:
                        continue
                    # the callable stays referenced with its graph: the anchors' set-up tensors (QuACK's routing
                    # plan, humming's buffers) live in its closure, outside the graph's memory pool
                    graphs[impl] = (capture(fn), fn)
                    outs[impl] = out
                except Exception as exc:  # an anchor that cannot run is reported, not fatal
                    row[impl + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"  {impl}: {row[impl + '_error']}", flush=True)
            times: dict[str, list[float]] = {impl: [] for impl in graphs}
            for _ in range(args.rounds):
                for impl, (g, _fn) in graphs.items():
                    times[impl].append(timer.time(g, args.reps))
            for impl, ts in times.items():
                row[impl + "_us"] = statistics.median(ts)
                if args.rounds > 1:
                    row[impl + "_rounds_us"] = ts
            del graphs
            if "ours" in outs:  # every implementation computes the same layer
                for impl, o in outs.items():
                    row[impl + "_relerr_vs_ours"] = float((o - outs["ours"]).norm() / outs["ours"].norm())
            rows.append(row)
            cells = "  ".join(f"{m}={row[m + '_us']:8.1f}us ({row['floor_us'] / row[m + '_us']:.0%})"
                              for m in impls if m + "_us" in row)
            print(f"{model:8s} T={t:5d} experts={touched:3d} floor={row['floor_us']:7.1f}us  {cells}", flush=True)
        results["models"][model] = rows
        with open(args.out, "w") as f:  # after each model, so a cut-short run keeps what it measured
            json.dump(results, f, indent=1)
        del w, w13b, w2b, layer
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.plot:
        plot(results, impls, args.plot)


def plot(results: dict, impls: list[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = results["models"][model]
        for impl in impls:
            pts = [(r["T"], r["floor_us"] / r[impl + "_us"]) for r in rows if impl + "_us" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("floor / time")
        ax.set_title(f"{model} MoE layer, {results['device']}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
