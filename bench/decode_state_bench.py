"""What the decode state's dtype costs one attention layer's decode step on the GPU backend (H200).

``HopperBackend`` ops of one decode step (CSA: indexer top-k + decode attention; HCA: decode attention)
on a float32 state (the reference dtype: the backend converts the ring, every compressed entry and
every indexer key to BF16 each step) and on a BF16 state (``HopperBackend.state_dtype``: nothing to
convert). V4-Flash shapes: 64 heads x 512, SWA ring 128, CSA ratio 4 with top-512 and 64 index heads x
128, HCA ratio 128. CUDA graphs, cold L2 (``gpu_timing.ColdTimer``).

Then the cost of emitting one CSA entry into such a state (``emit_cost``): ``torch.cat`` of the whole
state against the runtime's write into its fixed-size store.

    python bench/decode_state_bench.py   # writes bench/results/decode_state_bench.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gpu_timing import ColdTimer, capture

HEADS, DIM, WINDOW, TOPK, INDEX_HEADS, INDEX_DIM = 64, 512, 128, 512, 64, 128
CASES = [("CSA", 65536, 1), ("CSA", 65536, 8), ("CSA", 65536, 32), ("CSA", 1 << 20, 1), ("CSA", 1 << 20, 8),
         ("HCA", 1 << 20, 1), ("HCA", 1 << 20, 8), ("HCA", 1 << 20, 32)]


def step_fn(be, kind: str, ctx: int, b: int, dtype: torch.dtype, gen: torch.Generator):
    """One layer's decode attention ops on a state of ``dtype``; returns (fn, state bytes)."""
    dev = "cuda"
    n = ctx // 4 if kind == "CSA" else ctx // 128
    q = torch.randn(b, HEADS, DIM, device=dev, generator=gen)
    window = torch.randn(b, WINDOW, DIM, device=dev, generator=gen).to(dtype)
    entries = torch.randn(b, n, DIM, device=dev, generator=gen).to(dtype)
    wlen = torch.full((b,), WINDOW, dtype=torch.int32, device=dev)
    sink = torch.randn(HEADS, device=dev, generator=gen)
    state_bytes = window.nbytes + entries.nbytes
    if kind == "HCA":
        return (lambda: be.decode_attention(q, window, wlen, entries, None, sink, DIM ** -0.5)), state_bytes
    iq = torch.randn(b, INDEX_HEADS, INDEX_DIM, device=dev, generator=gen)
    keys = torch.randn(b, n, INDEX_DIM, device=dev, generator=gen).to(dtype)
    w = torch.randn(b, INDEX_HEADS, device=dev, generator=gen)
    nv = torch.full((b,), n, dtype=torch.int32, device=dev)

    def fn():
        idx = be.indexer_topk(iq, keys, w, TOPK, nv)
        return be.decode_attention(q, window, wlen, entries, idx, sink, DIM ** -0.5)
    return fn, state_bytes + keys.nbytes


def _event_us(fn, reps: int) -> float:
    """Mean microseconds of ``fn`` over ``reps`` eager calls (CUDA events)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def emit_cost(ctx: int, b: int, reps: int) -> dict:
    """One CSA compressor emit (an entry [B, 1, 512] and an indexer key [B, 1, 128], once per 4 tokens) into
    a state holding ctx / 4 of each: ``torch.cat`` of the whole state (the anchor: a copy per emit) against the
    runtime's write into its fixed-size store (``StepAttention``: one row per slot, at each slot's own entry
    index, a ``scatter_``)."""
    n, dev, bf = ctx // 4, "cuda", torch.bfloat16
    ent, key = torch.randn(b, n, DIM, device=dev).to(bf), torch.randn(b, n, INDEX_DIM, device=dev).to(bf)
    new_e, new_k = torch.randn(b, 1, DIM, device=dev), torch.randn(b, 1, INDEX_DIM, device=dev)
    cat_us = _event_us(lambda: (torch.cat((ent, new_e.to(bf)), 1), torch.cat((key, new_k.to(bf)), 1)), reps)
    rows = torch.randint(0, n, (b, 1, 1), device=dev)

    def write():
        for store, new in ((ent, new_e), (key, new_k)):
            store.scatter_(1, rows.expand(b, 1, store.shape[2]), new.to(bf))
    write_us = _event_us(write, reps)
    return dict(context=ctx, batch=b, cat_us=cat_us, store_write_us=write_us,
                per_token_saving_us=(cat_us - write_us) / 4)


def main() -> None:
    from nvfp4_megamoe.runtime.hopper import HopperBackend

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--emit-only", action="store_true", help="only the emit costs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "decode_state_bench.json"))
    args = ap.parse_args()
    be, timer, rows = HopperBackend(), ColdTimer(), []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind, ctx, b in ([] if args.emit_only else CASES):
        row = dict(kind=kind, context=ctx, batch=b)
        for dtype in (torch.float32, torch.bfloat16):
            fn, nbytes = step_fn(be, kind, ctx, b, dtype, gen)
            name = str(dtype).removeprefix("torch.")
            g = capture(fn)
            row[f"{name}_us"] = timer.time(g, args.reps)
            row[f"{name}_state_MiB"] = nbytes / 2**20
            del g, fn
            torch.cuda.empty_cache()
        row["speedup"] = row["float32_us"] / row["bfloat16_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    emits = []
    for ctx, b in ((65536, 8), (1 << 20, 1), (1 << 20, 8)):
        emits.append(emit_cost(ctx, b, args.reps))
        print(json.dumps(emits[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
                   "rows": rows, "emit": emits}, f, indent=1)


if __name__ == "__main__":
    main()
