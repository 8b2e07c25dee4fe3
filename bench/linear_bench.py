"""The dense NVFP4 linear of the decode step against its bytes floor, at the token counts of a decode batch.

Every dense NVFP4 linear of a V4 layer (``--preset``: the shapes of ``flash-layer`` or ``pro-layer``), at T = 1, 8,
32, 128 tokens: the kernel with the configuration the heuristics pick (``sm90_heuristics.linear_config``), and with
``--sweep`` every K split that the kernel takes, so that the split rule can be checked against the measurement.
Anchor: ``torch`` BF16 ``x @ W.T`` (cuBLAS) of the same shape, which reads 3.6x the bytes.

Each figure is a CUDA graph of ``--chain`` calls back to back, each on its own copy of the weights, replayed with
the L2 flushed first (``gpu_timing.ColdTimer``; the median replay over the calls): cold weights and no launch gaps,
as a decode step's graph runs them. Floor: the weights, block scales, x and out read or written once at the copy
bandwidth measured in the same run.

    python bench/linear_bench.py --preset flash-layer --sweep --json bench/results/linear_bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENS = (1, 8, 32, 128)


def dense_shapes(preset: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, groups) of every dense NVFP4 linear of a layer of ``preset``, and of the head."""
    from nvfp4_megamoe.convert.synth_config import synthetic_config
    from nvfp4_megamoe.runtime.config import ModelConfig

    c = ModelConfig.from_dict(synthetic_config(preset))
    h, heads, hd = c.hidden_size, c.num_heads, c.head_dim
    shared = c.moe_intermediate_size * c.n_shared_experts
    return [("wq_a", c.q_lora_rank, h, 1), ("wq_b", heads * hd, c.q_lora_rank, 1), ("wkv", hd, h, 1),
            ("wo_a", c.o_lora_rank, heads * hd // c.o_groups, c.o_groups), ("wo_b", h, c.o_groups * c.o_lora_rank, 1),
            ("shared w13", 2 * shared, h, 1), ("shared w2", h, shared, 1),
            ("indexer wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, 1), ("head", c.vocab_size, h, 1)]


def split_choices(n: int, k: int, t: int, groups: int) -> list[int]:
    """Every K split the kernel takes for this call (float32 out), the heuristics' own first."""
    from nvfp4_megamoe.kernels.sm90_config import K_TILE
    from nvfp4_megamoe.kernels.sm90_heuristics import linear_config

    picked = linear_config(n, k, t, groups=groups).tiling.k_splits
    return [picked] + [s for s in (1, 2, 4, 8, 16, 32) if s != picked and (k // K_TILE) % s == 0]


def op_for(n: int, k: int, t: int, groups: int, splits: int, row_tiles: int):
    """The heuristics' kernel for the call with ``splits`` K shares and ``row_tiles`` (2: 128-row CTAs, each
    activation fragment feeding twice the weight rows)."""
    from nvfp4_megamoe.kernels.sm90_heuristics import fit_depth, linear_config
    from nvfp4_megamoe.kernels.sm90_config import K_TILE
    from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4MmaGemm

    config = linear_config(n, k, t, groups=groups)
    tiling = replace(config.tiling, k_splits=splits, row_tiles=row_tiles,
                     depth=fit_depth(k // K_TILE // splits, 4 if row_tiles == 1 else 2))
    return Sm90Nvfp4MmaGemm(config.problem, tiling)


def variants(n: int, k: int, t: int, groups: int, sweep: bool) -> list[tuple[int, int]]:
    """(K splits, row tiles) to time: the heuristics' pick first; with ``sweep`` every split at one row tile, and
    from 32 tokens two row tiles (128-row CTAs) at the picked split and half of it."""
    from nvfp4_megamoe.kernels.sm90_heuristics import linear_config
    from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4MmaGemm

    picked = linear_config(n, k, t, groups=groups).tiling
    found = [(picked.k_splits, picked.row_tiles)]
    if sweep:
        found += [(s, 1) for s in split_choices(n, k, t, groups)]
        if t >= 32:
            for s in (picked.k_splits, max(1, picked.k_splits // 2)):
                op = op_for(n, k, t, groups, s, 1)
                if Sm90Nvfp4MmaGemm.can_implement(op.problem, replace(op.tiling, row_tiles=2, depth=1)):
                    found.append((s, 2))
    return list(dict.fromkeys(found))


def label(splits: int, row_tiles: int) -> str:
    return f"splits{splits}" + ("" if row_tiles == 1 else "_rt2")


def main(argv: list[str] | None = None) -> None:
    from gpu_timing import ColdTimer, measure_copy, time_into

    from nvfp4_megamoe.kernels import cute_host, sm90_nvfp4_linear as lin
    from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash-layer", choices=["flash-layer", "pro-layer"])
    ap.add_argument("--sweep", action="store_true", help="time every K split the kernel takes, not only the picked one")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--chain", type=int, default=8, help="calls per timed graph, each on its own weight copy")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)

    copy_bw = measure_copy()
    timer = ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name, n, k, groups in dense_shapes(args.preset):
        if not lin.can_implement(n, k, groups):
            print(f"{name}: N={n} K={k} not tiled by the kernel, skipped")
            continue
        w = torch.randint(0, 256, (args.chain, groups * n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        sc = torch.randint(0x30, 0x38, (args.chain, groups * swizzled_nbytes(n, k // 16)), dtype=torch.uint8,
                           device="cuda", generator=gen)
        alpha = torch.ones(1, device="cuda")
        wbf = torch.randn(args.chain, groups * n, k, device="cuda", generator=gen).to(torch.bfloat16)
        for t in TOKENS:
            x = torch.randn(t, groups * k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty(t, groups * n, device="cuda")
            cases.append((name, n, k, groups, t, w, sc, alpha, wbf, x, out, variants(n, k, t, groups, args.sweep)))
    # every configuration compiled up front, in parallel processes
    with cute_host.collecting() as jobs:
        for name, n, k, groups, t, w, sc, alpha, wbf, x, out, found in cases:
            for s, rt in found:
                cute_host.compile_op(op_for(n, k, t, groups, s, rt), lin._operands(x, w[0], sc[0], alpha, out))
    print(f"compiled {cute_host.compile_all(jobs)} kernels")

    rows = []
    for name, n, k, groups, t, w, sc, alpha, wbf, x, out, found in cases:
        nbytes = groups * (n * k // 2 + swizzled_nbytes(n, k // 16)) + x.numel() * 2 + out.numel() * 4
        row = dict(name=name, n=n, k=k, groups=groups, tokens=t, floor_us=nbytes / copy_bw * 1e6,
                   picked_splits=found[0][0])
        for s, rt in found:
            op = op_for(n, k, t, groups, s, rt)
            chain = [lin._operands(x, w[i], sc[i], alpha, out) for i in range(args.chain)]

            def run(op=op, chain=chain):
                for ops in chain:
                    if op.k_splits > 1:
                        out.zero_()
                    cute_host.launch(op, ops)
            time_into(row, label(s, rt), run, timer, args.reps)
        xs = x.view(t, groups, k).transpose(0, 1)
        time_into(row, "torch_bf16", lambda: [torch.bmm(xs, wb.view(groups, n, k).transpose(1, 2)) for wb in wbf],
                  timer, args.reps)
        for key in [key for key in row if key.endswith("_us") and key != "floor_us"]:
            row[key] /= args.chain
        rows.append(row)
        best = min((row[f"{label(*v)}_us"], label(*v)) for v in found if f"{label(*v)}_us" in row)
        picked = row.get(f"{label(*found[0])}_us", float("nan"))
        print(f"{name:13s} N={n:6d} K={k:5d} G={groups:2d} T={t:4d}: picked s={found[0][0]:2d} {picked:7.1f} us "
              f"({row['floor_us'] / picked:5.1%} of floor {row['floor_us']:.1f} us); best {best[1]} {best[0]:7.1f};"
              f" torch bf16 {row.get('torch_bf16_us', float('nan')):7.1f} us")
    for t in TOKENS:
        sel = [r for r in rows if r["tokens"] == t]
        picked = sum(r[f"splits{r['picked_splits']}_us"] for r in sel)
        floor = sum(r["floor_us"] for r in sel if r["name"] != "head")
        picked_layer = sum(r[f"splits{r['picked_splits']}_us"] for r in sel if r["name"] != "head")
        print(f"T={t}: a layer's dense linears {picked_layer:.1f} us, floor {floor:.1f} us ({floor / picked_layer:.1%});"
              f" with the head {picked:.1f} us")
    if args.json:
        args.json.write_text(json.dumps(dict(preset=args.preset, copy_bytes_per_s=copy_bw, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
