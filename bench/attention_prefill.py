"""The prefill mode of ``attention_bench.py`` (``--prefill``): one sequence's chunk of T query tokens, every token a
request of the decode attention kernel's prefill form (``sm90_prefill_attention``) and of the indexer's shared-keys
score kernel, against the torch float32 compositions the chunk path runs today.

Attention, per model (V4-Flash 64 heads, top-512; V4-Pro 128 heads, top-1024) and T (1024, 4096 by default), the
chunk the last T tokens of a context whose 127 past window rows are present (every window full):

* SWA: the window alone (128 keys a query);
* CSA: the window and the query's top-k of the 16,384 entries of a 64K-token context (ratio 4), drawn at random;
* HCA-4K, HCA-64K: the window and every entry the query may see of a 4K / 64K-token context (ratio 128).

``ours`` is the kernel; ``torch`` is ``attention_reference.sink_attention_picked`` as ``ChunkAttention`` calls it
(float32 operands; the window as a bias over the past and chunk rows, HCA's entries as more masked keys, CSA's picks
gathered per query), 256 queries at a time. FLOPs: 2 * 2 * H * 512 per key a query reads (its valid window and
entries); ``flashmla_frac`` is ours against FlashMLA's published sparse-prefill rate, 640 TFLOP/s on an H800 (the
same tensor-core peak as an H200), an anchor rather than a measurement here.

Indexer: T = 1024 queries (64 index heads of 128 dims) at the end of a context of 4 N tokens against its N = 1,024
and 16,384 entries, causal ``n_valid``: ``ours`` the shared-keys score kernel then the sort kernel, ``ours_scores``
the score kernel alone, ``ours_torch_topk`` the score kernel then ``torch.topk``, ``torch`` the chunk path's
``indexer_reference.topk_in_blocks`` (float32, 4,096 keys at a time) 256 queries at a time.
"""

from __future__ import annotations

import json

import torch

from gpu_timing import ColdTimer, time_into

D = 512
WINDOW = 128
SCALE = D ** -0.5
QUERY_BLOCK = 256              # ChunkAttention's queries per block
INDEX_KEY_BLOCK = 4096         # ChunkAttention's indexer keys per block
FLASHMLA_TFLOPS = 640.0        # FlashMLA's sparse prefill on an H800 (published)
KINDS = {"SWA": (0, 0), "CSA": (65536, 4), "HCA-4K": (4096, 128), "HCA-64K": (65536, 128)}  # context, ratio
INDEX_HEADS, INDEX_DIM = 64, 128


def prefill_inputs(t: int, h: int, kind: str, top_k: int, gen: torch.Generator) -> dict:
    """One sequence's chunk of ``t`` tokens at the end of its context: operands of the kernel (BF16) and what the
    torch composition reads (float32), the keys each query reads."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import chunk_windows
    dev = "cuda"
    ctx, ratio = KINDS[kind]
    past = WINDOW - 1
    q = torch.randn(t, h, D, device=dev, generator=gen).bfloat16()
    rows = torch.randn(1, past + t, D, device=dev, generator=gen).bfloat16()
    start, length = chunk_windows(past, t, WINDOW, device=dev)
    sink = torch.randn(h, device=dev, generator=gen)
    x = dict(q=q, rows=rows, start=start, length=length, sink=sink, kvc=None, idx=None, count=None)
    keys_read = float(length.sum())
    if ratio:
        n = ctx // ratio
        x["kvc"] = torch.randn(1, n, D, device=dev, generator=gen).bfloat16()
        visible = ((max(ctx, t) - t + torch.arange(t, device=dev) + 1) // ratio).clamp(max=n).to(torch.int32)
        if kind == "CSA":
            x["idx"] = torch.argsort(torch.rand(t, n, device=dev, generator=gen), dim=1)[:, :top_k].int().contiguous()
            keys_read += t * top_k
        else:
            x["count"] = visible
            keys_read += float(visible.sum())
    x["flops"] = 2 * 2 * h * D * keys_read
    return x


def chunk_attention_torch(x: dict, out: torch.Tensor) -> None:
    """The chunk path's attention (``ChunkAttention.__call__`` after its indexer) into ``out`` [1, T, H, D]."""
    from nvfp4_megamoe.kernels.attention_reference import sink_attention_picked
    q, keys, bias, sink = x["q_f32"], x["keys_f32"], x["bias"], x["sink"]
    t = q.shape[1]
    for q0 in range(0, t, QUERY_BLOCK):
        r = slice(q0, q0 + QUERY_BLOCK)
        if x["idx"] is None:
            out[:, r] = sink_attention_picked(q[:, r], keys, bias[None, r], None, None, sink, SCALE)
        else:
            picked = x["idx"][None, r].long()
            gathered = x["entries_f32"][torch.arange(1, device=q.device)[:, None, None], picked.clamp(min=0)]
            out[:, r] = sink_attention_picked(q[:, r], keys, bias[None, r], gathered, picked >= 0, sink, SCALE)


def torch_operands(x: dict) -> None:
    """What the chunk path holds: float32 query and keys, the window bias over past and chunk rows (HCA: the entries
    as more keys, masked past each query's count)."""
    t, length = x["q"].shape[0], x["rows"].shape[1]
    span = torch.arange(length, device="cuda")[None]
    start, end = x["start"][:, None].long(), (x["start"] + x["length"])[:, None].long()
    x["q_f32"] = x["q"].float()[None]
    x["keys_f32"] = x["rows"].float()
    x["bias"] = torch.zeros(t, length, device="cuda").masked_fill((span < start) | (span >= end), float("-inf"))
    if x["count"] is not None:
        n = x["kvc"].shape[1]
        seen = torch.arange(n, device="cuda")[None] < x["count"][:, None].long()
        x["keys_f32"] = torch.cat((x["keys_f32"], x["kvc"].float()), dim=1)
        x["bias"] = torch.cat((x["bias"], torch.zeros(t, n, device="cuda").masked_fill(~seen, float("-inf"))), -1)
    elif x["idx"] is not None:
        x["entries_f32"] = x["kvc"].float()


def bench_prefill_attention(args, timer: ColdTimer, models: dict) -> list[dict]:
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_prefill_attention
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    for model, (h, top_k) in models.items():
        for t in args.tokens:
            for kind in KINDS:
                x = prefill_inputs(t, h, kind, top_k, gen)
                out = torch.empty(t, h, D, dtype=torch.bfloat16, device="cuda")

                def ours():
                    sm90_prefill_attention(x["q"], x["rows"], x["start"], x["length"], x["kvc"], x["idx"], x["sink"],
                                           SCALE, count=x["count"], max_window=WINDOW, out=out)
                row = dict(model=model, heads=h, tokens=t, kind=kind, keys_per_query=x["flops"] / (4 * h * D * t),
                           gflop=x["flops"] * 1e-9)
                time_into(row, "ours", ours, timer, args.reps)
                if not args.no_torch:
                    torch_operands(x)
                    ref = torch.empty(1, t, h, D, device="cuda")
                    time_into(row, "torch", lambda: chunk_attention_torch(x, ref), timer, max(3, args.reps // 4))
                    if "ours_us" in row and "torch_us" in row:
                        ours()
                        chunk_attention_torch(x, ref)
                        r = ref[0].double()
                        row["relerr_vs_torch"] = float((out.double() - r).norm() / r.norm())
                        row["speedup_vs_torch"] = row["torch_us"] / row["ours_us"]
                        row["torch_TFLOPs"] = x["flops"] / row["torch_us"] * 1e-6
                if "ours_us" in row:
                    row["ours_TFLOPs"] = x["flops"] / row["ours_us"] * 1e-6
                    row["flashmla_frac"] = row["ours_TFLOPs"] / FLASHMLA_TFLOPS
                rows.append(row)
                print(json.dumps(row), flush=True)
                x = ref = out = None  # the next shape needs the memory (the closures read these names)
                torch.cuda.empty_cache()
    return rows


def bench_prefill_indexer(args, timer: ColdTimer, top_ks: tuple[int, ...]) -> list[dict]:
    from nvfp4_megamoe.kernels.indexer_keys import topk_of_keys_torch
    from nvfp4_megamoe.kernels.indexer_reference import topk_in_blocks
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys, sm90_topk_of_keys
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    t = args.index_tokens
    for n in args.index_entries:
        for k in top_ks:
            q = torch.randn(t, INDEX_HEADS, INDEX_DIM, device="cuda", generator=gen).bfloat16()
            keys = torch.randn(1, n, INDEX_DIM, device="cuda", generator=gen).bfloat16()
            w = torch.randn(t, INDEX_HEADS, device="cuda", generator=gen)
            nv = ((4 * n - t + torch.arange(t, device="cuda") + 1) // 4).clamp(0, n).to(torch.int32)
            key = torch.empty(t, n, dtype=torch.int64, device="cuda")
            picked = {}

            def ours():
                picked["ours"] = sm90_topk_of_keys(sm90_indexer_keys(q, keys, w, nv, out=key), k)

            def chunk_topk():  # ChunkAttention's be.chunk_topk, float32, over blocks of queries
                blocks = [slice(q0, q0 + QUERY_BLOCK) for q0 in range(0, t, QUERY_BLOCK)]
                picked["torch"] = torch.cat([topk_in_blocks(qf[None, r], kf, w[None, r], nv[r], k, INDEX_KEY_BLOCK)
                                             for r in blocks], dim=1)[0]
            fns = {"ours": ours, "ours_scores": lambda: sm90_indexer_keys(q, keys, w, nv, out=key),
                   "ours_torch_topk": lambda: topk_of_keys_torch(sm90_indexer_keys(q, keys, w, nv, out=key), k)}
            if not args.no_torch:
                qf, kf = q.float(), keys.float()
                fns["torch"] = chunk_topk
            flops = 2.0 * INDEX_HEADS * INDEX_DIM * float(nv.sum())
            row = dict(tokens=t, entries=n, top_k=k, score_gflop=flops * 1e-9)
            for name, fn in fns.items():
                time_into(row, name, fn, timer, max(3, args.reps // 2))
            if "ours_scores_us" in row:
                row["ours_scores_TFLOPs"] = flops / row["ours_scores_us"] * 1e-6
            if "ours_us" in row and "torch_us" in row:
                row["speedup_vs_torch"] = row["torch_us"] / row["ours_us"]
                fns["ours"]()
                fns["torch"]()
                a, b = picked["ours"].long().sort(-1).values, picked["torch"].long().sort(-1).values
                row["same_picks_frac"] = float((a == b).all(-1).float().mean())   # rows with the same set
            rows.append(row)
            print(json.dumps(row), flush=True)
            q = keys = w = key = qf = kf = None  # the next sizes need the memory (the closures read these names)
            torch.cuda.empty_cache()
    return rows


def prefill_table(res: dict) -> str:
    nan = float("nan")
    lines = [f"prefill attention on {res['device']} (FlashMLA anchor {FLASHMLA_TFLOPS:.0f} TFLOP/s)",
             f"{'model':9} {'T':>5} {'kind':8} {'keys/q':>7} {'ours us':>9} {'TFLOP/s':>8} {'%FlashMLA':>9} "
             f"{'torch us':>10} {'x torch':>8} {'err':>8}"]
    for r in res.get("prefill_attention", []):
        lines.append(f"{r['model']:9} {r['tokens']:5d} {r['kind']:8} {r['keys_per_query']:7.0f} "
                     f"{r.get('ours_us', nan):9.1f} {r.get('ours_TFLOPs', nan):8.1f} "
                     f"{100 * r.get('flashmla_frac', nan):9.1f} {r.get('torch_us', nan):10.1f} "
                     f"{r.get('speedup_vs_torch', nan):8.1f} {r.get('relerr_vs_torch', nan):8.1e}")
    lines.append(f"{'indexer':9} {'T':>5} {'N':>6} {'k':>5} {'ours us':>9} {'scores us':>9} {'TFLOP/s':>8} "
                 f"{'torch us':>10} {'x torch':>8} {'same':>6}")
    for r in res.get("prefill_indexer", []):
        lines.append(f"{'':9} {r['tokens']:5d} {r['entries']:6d} {r['top_k']:5d} {r.get('ours_us', nan):9.1f} "
                     f"{r.get('ours_scores_us', nan):9.1f} {r.get('ours_scores_TFLOPs', nan):8.1f} "
                     f"{r.get('torch_us', nan):10.1f} {r.get('speedup_vs_torch', nan):8.1f} "
                     f"{r.get('same_picks_frac', nan):6.3f}")
    return "\n".join(lines)
