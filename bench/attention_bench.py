"""Benchmark DeepSeek-V4 decode attention (SWA ring + compressed entries + sink) on the GPU.

Shapes: V4-Flash (64 heads, CSA top-k 512) and V4-Pro (128 heads, top-k 1024); batch 1, 8, 32, 128;
context 4K, 64K, 1M. Per (model, batch, context) two layer kinds:
* CSA: full 128-slot window + top-k compressed entries gathered by index (min(k, ctx/4) valid);
  indices are distinct, uniformly drawn from a pool of ``min(ctx/4, max(2k, 65536 / B))`` entries per
  request (the kernel reads the same bytes as with the full ctx/4 pool; the pool is not cached: see below);
* HCA: full window + all ctx/128 compressed entries.

Implementations: ``ours`` (``kernels/sm90_decode_attention.sm90_decode_attention``) and ``torch`` (gather +
BF16 bmm + float32 softmax with the sink column + bmm: ``decode_attention_torch``). Each is captured in
a CUDA graph and replayed with a cold L2 (a 512 MiB buffer is rewritten before every timed replay);
the median of ``--reps`` replays is reported. ``floor`` = (q + KV entries read + out) bytes / the
copy bandwidth measured at start (read + write bytes of a 1 GiB device copy). Every configuration
also checks ours against the torch baseline (relative error).

The lightning indexer top-k (the GPU backend's ``indexer_topk``: the fused score kernel, then the
sort kernel, one CTA up to 4,096 keys and segment passes up to 1M keys over the batch, ``torch.topk`` beyond;
also the score kernel alone, and the score kernel with ``torch.topk``) is timed the same way at 64 index heads x
128 dims over ctx/4 keys; its floor is the key bytes over the copy bandwidth. ``--plot`` needs no GPU.

    python bench/attention_bench.py --reps 15 --variants '{"cl1": {"cluster": 1}}'  # bench/results/attention_bench.json
    python bench/attention_bench.py --reps 15 --no-attention --out bench/results/indexer_bench.json
    python bench/attention_bench.py --plot bench/results/attention_bench.json bench/results/attention_bench.png

``--prefill`` times a chunk's prefill instead (``attention_prefill.py``: the prefill form of the kernel against the
chunk path's torch composition, in TFLOP/s and against FlashMLA's published sparse-prefill rate; the indexer's
shared-keys score kernel and the sort):

    python bench/attention_bench.py --prefill --reps 10          # bench/results/attention_prefill_bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import ColdTimer, measure_copy, time_into  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # the outputs docs/benchmarks.md quotes
MODELS = {"V4-Flash": (64, 512), "V4-Pro": (128, 1024)}
BATCHES = (1, 8, 32, 128)
CONTEXTS = (4096, 65536, 1 << 20)
WINDOW = 128
D = 512
SCALE = D ** -0.5


def make_inputs(b: int, h: int, kind: str, ctx: int, top_k: int, gen: torch.Generator) -> dict:
    dev = "cuda"
    q = torch.randn(b, h, D, device=dev, generator=gen).bfloat16()
    kvw = torch.randn(b, WINDOW, D, device=dev, generator=gen).bfloat16()
    wlen = torch.full((b,), WINDOW, dtype=torch.int32, device=dev)
    sink = torch.randn(h, device=dev, generator=gen)
    if kind == "CSA":
        k = min(top_k, ctx // 4)
        pool = min(ctx // 4, max(2 * top_k, 65536 // b))
        kvc = torch.randn(b, pool, D, device=dev, generator=gen).bfloat16()
        idx = torch.argsort(torch.rand(b, pool, device=dev, generator=gen), dim=1)[:, :k].int().contiguous()
        entries = k
    else:
        n = ctx // 128
        kvc = torch.randn(b, n, D, device=dev, generator=gen).bfloat16()
        idx = None
        entries = n
    return dict(q=q, kvw=kvw, wlen=wlen, kvc=kvc, idx=idx, sink=sink, entries=entries)


def bench_attention(args, copy_bw: float, timer: ColdTimer) -> list[dict]:
    from nvfp4_megamoe.kernels.decode_attention_reference import decode_attention_torch
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_decode_attention as decode_attention
    from nvfp4_megamoe.kernels.sm90_heuristics import pick_splits
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, (h, top_k) in MODELS.items():
        for ctx in args.contexts:
            for b in args.batches:
                for kind in ("CSA", "HCA"):
                    x = make_inputs(b, h, kind, ctx, top_k, gen)
                    out = torch.empty(b, h, D, dtype=torch.bfloat16, device="cuda")

                    def ours_with(**kw):  # another configuration of ours, into its own output
                        out_kw = torch.empty_like(out)
                        return lambda: decode_attention(x["q"], x["kvw"], x["wlen"], x["kvc"], x["idx"], x["sink"],
                                                        SCALE, out=out_kw, **kw)
                    ours = lambda: decode_attention(x["q"], x["kvw"], x["wlen"], x["kvc"], x["idx"], x["sink"],  # noqa: E731
                                                    SCALE, out=out)
                    ref_out = {}

                    def torch_fn():
                        ref_out["o"] = decode_attention_torch(x["q"], x["kvw"], x["wlen"], x["kvc"], x["idx"],
                                                              x["sink"], SCALE)
                    nbytes = (2 * b * h * D + b * (WINDOW + x["entries"]) * D) * 2
                    row = dict(model=model, heads=h, batch=b, context=ctx, kind=kind, entries=WINDOW + x["entries"],
                               bytes=nbytes, floor_us=nbytes / copy_bw * 1e6,
                               splits=pick_splits(b, h, WINDOW + x["entries"], sms))
                    time_into(row, "ours", ours, timer, args.reps)
                    for n_split in args.splits:  # other split counts than pick_splits', for the record
                        time_into(row, f"ours_s{n_split}", ours_with(splits=n_split), timer, args.reps)
                    variant_outs = {}
                    for name, tiling in args.variants.items():  # other kernel configurations, side by side
                        fn = ours_with(**tiling)
                        time_into(row, f"ours_{name}", fn, timer, args.reps)
                        variant_outs[name] = fn
                    time_into(row, "torch", torch_fn, timer, max(3, args.reps // 2))
                    if "ours_us" in row and "o" in ref_out:
                        ours()
                        torch.cuda.synchronize()
                        r = ref_out["o"].double()
                        row["relerr_vs_torch"] = float((out.double() - r).norm() / r.norm())
                        for name, fn in variant_outs.items():
                            if f"ours_{name}_us" in row:
                                row[f"relerr_{name}_vs_torch"] = float((fn().double() - r).norm() / r.norm())
                    if "ours_us" in row:
                        row["frac_of_copy_bw"] = row["floor_us"] / row["ours_us"]
                        row["ours_TBps"] = nbytes / row["ours_us"] * 1e-6
                    if "ours_us" in row and "torch_us" in row:
                        row["speedup_vs_torch"] = row["torch_us"] / row["ours_us"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    torch.cuda.empty_cache()
    return rows


def bench_indexer(args, copy_bw: float, timer: ColdTimer) -> list[dict]:
    """ours = the GPU backend's ``indexer_topk`` (fused score kernel, then the sort kernel: one CTA up to 4096 keys, segment
    passes beyond), ours_scores = the score kernel alone (int64 order keys out), ours_torch_topk = the score
    kernel + ``torch.topk`` on its keys, torch = the torch composition of the scores and keys +
    ``torch.topk``; the scores compared between the two, ours' indices with ``torch.topk``'s on the same keys."""
    from nvfp4_megamoe.kernels.indexer_keys import (indexer_scores_torch, ordered_key, scores_of_key,
                                                    topk_of_keys_torch)
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys as indexer_keys
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_topk_of_keys as topk_of_keys
    from nvfp4_megamoe.runtime.hopper import HopperBackend

    backend = HopperBackend()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for ctx in args.contexts:
        for b in args.batches:
            n = ctx // 4
            for top_k in (512, 1024):
                q = torch.randn(b, 64, 128, device="cuda", generator=gen).bfloat16()
                keys = torch.randn(b, n, 128, device="cuda", generator=gen).bfloat16()
                w = torch.randn(b, 64, device="cuda", generator=gen)
                nbytes = keys.numel() * 2
                row = dict(batch=b, context=ctx, keys=n, top_k=top_k, bytes=nbytes, floor_us=nbytes / copy_bw * 1e6)
                nv = torch.full((b,), n, device="cuda")
                fns = {"ours": lambda: backend.indexer_topk(q, keys, w, top_k, nv),
                       "ours_scores": lambda: indexer_keys(q, keys, w),
                       "ours_torch_topk": lambda: topk_of_keys_torch(indexer_keys(q, keys, w), top_k)}
                if b * n * 64 * 4 <= (16 << 30):        # the torch [B, 64, N] float32 intermediate up to 16 GiB
                    fns["torch"] = lambda: topk_of_keys_torch(ordered_key(indexer_scores_torch(q, keys, w)), top_k)
                for name, fn in fns.items():
                    time_into(row, name, fn, timer, max(3, args.reps // 2))
                if "ours_us" in row:
                    row["frac_of_copy_bw"] = row["floor_us"] / row["ours_us"]
                    key = indexer_keys(q, keys, w)
                    if n <= 4096 or top_k <= 2048:  # the sort kernel takes it (sm90_indexer.topk_can_implement)
                        row["ours_equals_torch_topk"] = bool(torch.equal(topk_of_keys(key, top_k),
                                                                         topk_of_keys_torch(key, top_k)))
                    del key
                if "torch_us" in row and "ours_us" in row:
                    row["speedup_vs_torch"] = row["torch_us"] / row["ours_us"]
                    ref = indexer_scores_torch(q, keys, w).double()
                    got = scores_of_key(indexer_keys(q, keys, w)).double()
                    row["scores_relerr_vs_torch"] = float((got - ref).norm() / ref.norm())
                    del ref
                rows.append(row)
                print(json.dumps(row), flush=True)
                q = keys = w = None  # the next sizes' operands need the memory (the closures above read these names)
                torch.cuda.empty_cache()
    return rows


def table(res: dict) -> str:
    lines = [f"copy bandwidth {res['copy_bytes_per_s'] / 1e12:.2f} TB/s on {res['device']}",
             f"{'model':9} {'B':>4} {'ctx':>8} {'kind':4} {'entries':>7} {'floor us':>9} {'ours us':>9} "
             f"{'torch us':>9} {'%copy':>6} {'x torch':>8} {'err':>8}"]
    for r in res["attention"]:
        lines.append(f"{r['model']:9} {r['batch']:4d} {r['context']:8d} {r['kind']:4} {r['entries']:7d} "
                     f"{r['floor_us']:9.1f} {r.get('ours_us', float('nan')):9.1f} {r.get('torch_us', float('nan')):9.1f} "
                     f"{100 * r.get('frac_of_copy_bw', float('nan')):6.1f} {r.get('speedup_vs_torch', float('nan')):8.1f} "
                     f"{r.get('relerr_vs_torch', float('nan')):8.1e}")
    lines.append(f"{'indexer':9} {'B':>4} {'ctx':>8} {'k':>5} {'floor us':>9} {'ours us':>9} {'scores us':>9} "
                 f"{'torch us':>9} {'%copy':>6} {'x torch':>8}")
    nan = float("nan")
    for r in res.get("indexer", []):
        lines.append(f"{'':9} {r['batch']:4d} {r['context']:8d} {r['top_k']:5d} {r['floor_us']:9.1f} "
                     f"{r.get('ours_us', nan):9.1f} {r.get('ours_scores_us', nan):9.1f} {r.get('torch_us', nan):9.1f} "
                     f"{100 * r.get('frac_of_copy_bw', nan):6.1f} {r.get('speedup_vs_torch', nan):8.1f}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["attention"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharey="row")
    for j, model in enumerate(MODELS):
        for i, kind in enumerate(("CSA", "HCA")):
            ax = axes[i, j]
            sel = [r for r in rows if r["model"] == model and r["kind"] == kind and "ours_us" in r]
            labels = [f"B{r['batch']}\n{r['context'] // 1024}K" for r in sel]
            xs = range(len(sel))
            ax.plot(xs, [r["ours_us"] for r in sel], "o-", label="ours (CuTeDSL sm_90a)")
            ax.plot(xs, [r.get("torch_us", float("nan")) for r in sel], "s-", label="torch gather + bmm")
            ax.plot(xs, [r["floor_us"] for r in sel], "k--", label="floor: bytes / copy BW")
            ax.set_yscale("log")
            ax.set_xticks(list(xs), labels, fontsize=7)
            ax.set_title(f"{model} ({sel[0]['heads'] if sel else ''} heads), {kind}")
            ax.grid(True, which="both", alpha=0.3)
            if i == 1:
                ax.set_xlabel("batch / context")
            if j == 0:
                ax.set_ylabel("us per decode step (one layer)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"DeepSeek-V4 decode attention on {res['device']} (cold L2, CUDA graph)")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    from PIL import Image  # matplotlib's own dependency: a 64-colour palette keeps the PNG small
    Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)


def run_prefill(args) -> None:
    """``--prefill``: the chunk's attention and indexer (``attention_prefill.py``), one results file."""
    from attention_prefill import bench_prefill_attention, bench_prefill_indexer, prefill_table
    t0 = time.time()
    timer = ColdTimer()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=args.reps)
    out = args.out or str(RESULTS / "attention_prefill_bench.json")
    res["prefill_attention"] = [] if args.no_attention else bench_prefill_attention(args, timer, MODELS)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    if not args.no_indexer:
        res["prefill_indexer"] = bench_prefill_indexer(args, timer, tuple(k for _, k in MODELS.values()))
    res["wall_s"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(prefill_table(res))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results file (default: bench/results/attention_bench.json, with --prefill "
                                 "attention_prefill_bench.json)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    p.add_argument("--contexts", type=int, nargs="*", default=list(CONTEXTS))
    p.add_argument("--no-indexer", action="store_true")
    p.add_argument("--no-attention", action="store_true", help="only the indexer")
    p.add_argument("--variants", type=json.loads, default={},
                   help='other launches of ours as JSON {name: sm90_decode_attention keyword arguments (splits, '
                        'cluster)}, e.g. \'{"cl1": {"cluster": 1}}\'')
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time ours with these fixed flash-decoding split counts (ours_s<N>_us)")
    p.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="only draw the plot of a results file")
    p.add_argument("--prefill", action="store_true", help="time a chunk's prefill (attention_prefill.py) instead")
    p.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096], help="--prefill: query tokens of the chunk")
    p.add_argument("--index-tokens", type=int, default=1024, help="--prefill: the indexer's query tokens")
    p.add_argument("--index-entries", type=int, nargs="*", default=[1024, 16384],
                   help="--prefill: the indexer's compressed entries")
    p.add_argument("--no-torch", action="store_true", help="--prefill: skip the torch float32 compositions")
    args = p.parse_args()
    if args.prefill:
        run_prefill(args)
        return
    args.out = args.out or str(RESULTS / "attention_bench.json")
    if args.plot:
        with open(args.plot[0]) as f:
            res = json.load(f)
        plot(res, args.plot[1])
        print(table(res))
        return
    t0 = time.time()
    copy_bw = measure_copy()
    timer = ColdTimer()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bytes_per_s=copy_bw,
               reps=args.reps)
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    res["attention"] = [] if args.no_attention else bench_attention(args, copy_bw, timer)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if not args.no_indexer:
        res["indexer"] = bench_indexer(args, copy_bw, timer)
    res["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
