"""The dense NVFP4 linears of a layer against their floor, at the token counts of a decode batch (and a prefill
chunk).

Every dense NVFP4 linear of a V4 layer (``--preset``: the shapes of ``flash-layer`` or ``pro-layer``) and the head's
shape, at T = 1, 8, 32, 64, 128 tokens (``--prefill``: also 2048): the kernel the heuristics pick
(``sm90_heuristics.linear_config``: mma.sync below the token tile of ``linear_wgmma_min_tile``, WGMMA from there,
its permute of x into the "staged" K order included), and with ``--sweep`` the alternatives the rules were chosen
against (mma.sync K splits; from 17 tokens the mma.sync kernel's own pick and WGMMA warpgroups and K splits). Anchor:
``torch`` BF16 ``x @ W.T`` (cuBLAS) of the same shape, which reads 3.6x the bytes.

Each figure is a CUDA graph of ``--chain`` calls back to back, each on its own copy of the weights, replayed with
the L2 flushed first (``gpu_timing.ColdTimer``; the median replay over the calls): cold weights and no launch gaps,
as a decode step's graph runs them. Floor: the larger of the weights, block scales, x and out read or written once
at the copy bandwidth, and the FLOPs at the BF16 matmul rate, both measured in the same run.

    python bench/linear_bench.py --preset flash-layer --sweep --prefill --json bench/results/linear_bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENS = (1, 8, 32, 64, 128)
PREFILL_TOKENS = (2048,)  # with --prefill


def parse_arguments(doc: str, sweep_help: str, argv: list[str] | None) -> tuple[argparse.Namespace, tuple[int, ...]]:
    """The dense-linear benchmarks' options (a preset, ``--sweep``, the token counts, timing, ``--json``) and the token
    counts they ask for."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--preset", default="flash-layer", choices=["flash-layer", "pro-layer"])
    ap.add_argument("--sweep", action="store_true", help=sweep_help)
    ap.add_argument("--prefill", action="store_true",
                    help=f"also T = {', '.join(map(str, PREFILL_TOKENS))} (a prefill chunk)")
    ap.add_argument("--tokens", type=int, nargs="+", help=f"token counts to time (default {TOKENS})")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--chain", type=int, default=8, help="calls per timed graph, each on its own weight copy")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    return args, tuple(args.tokens or TOKENS) + (PREFILL_TOKENS if args.prefill else ())


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


def mma_op(n: int, k: int, t: int, groups: int, splits: int, row_tiles: int):
    """The mma.sync kernel of the call (``linear_mma_config``) with ``splits`` K shares and ``row_tiles`` (2: 128-row
    CTAs, each activation fragment feeding twice the weight rows)."""
    from nvfp4_megamoe.kernels.sm90_heuristics import fit_depth, linear_mma_config
    from nvfp4_megamoe.kernels.sm90_config import K_TILE
    from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4MmaGemm

    config = linear_mma_config(n, k, t, groups=groups)
    tiling = replace(config.tiling, k_splits=splits, row_tiles=row_tiles,
                     depth=fit_depth(k // K_TILE // splits, 4 if row_tiles == 1 else 2))
    return Sm90Nvfp4MmaGemm(config.problem, tiling)


def wgmma_op(n: int, k: int, t: int, groups: int, tile_tokens: int, warpgroups: int, splits: int):
    """The WGMMA kernel of the call with the given token tile, warpgroups and K shares (None: it does not take them)."""
    from nvfp4_megamoe.kernels.sm90_config import GemmConfig, GemmProblem
    from nvfp4_megamoe.kernels.sm90_gemm_family import gemm_can_implement, gemm_kernel
    from nvfp4_megamoe.kernels.sm90_heuristics import linear_wgmma_tiling

    tiling = linear_wgmma_tiling(n, k, t, groups, tile_tokens=tile_tokens, warpgroups=warpgroups, k_splits=splits)
    if tiling is None:
        return None
    config = GemmConfig(GemmProblem(m=n, k=k, mode="store", b_order="staged", groups=groups), tiling)
    return gemm_kernel(config) if gemm_can_implement(config) else None


def variants(n: int, k: int, t: int, groups: int, sweep: bool) -> dict:
    """label -> kernel to time: the heuristics' pick first ("picked"); with ``sweep``, below the
    32-token tile (``LINEAR_WGMMA_MIN_TILE``) the mma.sync kernel at every K split it takes, from there on the
    mma.sync kernel's own pick ("mma") and the WGMMA kernel at the token tile the heuristics take, with one or two
    warpgroups and 1..16 K shares (1 or 2 for calls of several token tiles)."""
    from nvfp4_megamoe.kernels.sm90_config import K_TILE
    from nvfp4_megamoe.kernels.sm90_heuristics import LINEAR_WGMMA_MIN_TILE, LINEAR_WGMMA_TILES, linear_mma_config
    from nvfp4_megamoe.kernels.sm90_nvfp4_linear import linear_op

    found = {"picked": linear_op(n, k, t, groups=groups)}
    if not sweep:
        return found
    mma = linear_mma_config(n, k, t, groups=groups).tiling
    if t <= LINEAR_WGMMA_MIN_TILE // 2:
        for s in dict.fromkeys([mma.k_splits, 1, 2, 4, 8, 16, 32]):
            if (k // K_TILE) % s == 0:
                found[f"splits{s}"] = mma_op(n, k, t, groups, s, 1)
        return found
    found["mma"] = mma_op(n, k, t, groups, mma.k_splits, mma.row_tiles)
    bn = min(b for b in LINEAR_WGMMA_TILES if b >= min(t, LINEAR_WGMMA_TILES[-1]))
    for wgs in (1, 2):
        for s in (1, 2, 4, 8, 16) if t <= bn else (1, 2):
            op = wgmma_op(n, k, t, groups, bn, wgs, s)
            if op is not None:
                found[f"wgmma_n{bn}_wg{wgs}_s{s}"] = op
    return found


def main(argv: list[str] | None = None) -> None:
    from gpu_timing import ColdTimer, measure_bf16_matmul, measure_copy, time_into

    from nvfp4_megamoe.kernels import cute_host, sm90_nvfp4_linear as lin
    from nvfp4_megamoe.kernels.sm90_moe_wgmma import Sm90Nvfp4WgmmaGemm
    from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes

    args, tokens = parse_arguments(__doc__, "time the kernels' alternatives, not only the picked one", argv)

    copy_bw, bf16_rate = measure_copy(), measure_bf16_matmul()
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
        for t in tokens:
            x = torch.randn(t, groups * k, device="cuda", generator=gen).to(torch.bfloat16)
            staged = torch.empty_like(x)
            out = torch.empty(t, groups * n, device="cuda")
            cases.append((name, n, k, groups, t, w, sc, alpha, wbf, x, staged, out,
                          variants(n, k, t, groups, args.sweep)))
    # every configuration compiled up front, in parallel processes
    with cute_host.collecting() as jobs:
        for name, n, k, groups, t, w, sc, alpha, wbf, x, staged, out, found in cases:
            for op in found.values():
                cute_host.compile_op(op, lin._operands(x, w[0], sc[0], alpha, out))
        cute_host.compile_op(lin._PERMUTE, [x, staged])
    print(f"compiled {cute_host.compile_all(jobs)} kernels")

    rows = []
    for name, n, k, groups, t, w, sc, alpha, wbf, x, staged, out, found in cases:
        nbytes = groups * (n * k // 2 + swizzled_nbytes(n, k // 16)) + x.numel() * 2 + out.numel() * 4
        floor = max(nbytes / copy_bw, 2 * t * groups * n * k / bf16_rate)
        picked = found["picked"]
        row = dict(name=name, n=n, k=k, groups=groups, tokens=t, floor_us=floor * 1e6,
                   picked=[key for key, op in found.items() if key != "picked" and op.key() == picked.key()][:1]
                   or [type(picked).__name__])
        for key, op in found.items():
            wgmma = isinstance(op, Sm90Nvfp4WgmmaGemm)
            chain = [lin._operands(staged if wgmma else x, w[i], sc[i], alpha, out) for i in range(args.chain)]

            def run(op=op, chain=chain, wgmma=wgmma):
                for ops in chain:
                    if wgmma:  # as sm90_nvfp4_linear: x permuted into the "staged" K order first
                        cute_host.launch(lin._PERMUTE, [x, staged])
                    if op.k_splits > 1:
                        out.zero_()
                    cute_host.launch(op, ops)
            time_into(row, key, run, timer, args.reps)
        xs = x.view(t, groups, k).transpose(0, 1)
        time_into(row, "torch_bf16", lambda: [torch.bmm(xs, wb.view(groups, n, k).transpose(1, 2)) for wb in wbf],
                  timer, args.reps)
        for key in [key for key in row if key.endswith("_us") and key != "floor_us"]:
            row[key] /= args.chain
        rows.append(row)
        timed = {key: row[f"{key}_us"] for key in found if f"{key}_us" in row}
        best = min((v, key) for key, v in timed.items())
        got = timed.get("picked", float("nan"))
        print(f"{name:13s} N={n:6d} K={k:5d} G={groups:2d} T={t:5d}: picked {row['picked'][0]:22s} {got:8.1f} us "
              f"({row['floor_us'] / got:5.1%} of floor {row['floor_us']:.1f} us); best {best[1]} {best[0]:8.1f};"
              f" torch bf16 {row.get('torch_bf16_us', float('nan')):8.1f} us")
    for t in tokens:
        sel = [r for r in rows if r["tokens"] == t and r["name"] != "head"]
        got = sum(r["picked_us"] for r in sel)
        floor = sum(r["floor_us"] for r in sel)
        print(f"T={t}: a layer's dense linears {got:.1f} us, floor {floor:.1f} us ({floor / got:.1%}); cuBLAS BF16 "
              f"{sum(r['torch_bf16_us'] for r in sel):.1f} us")
    if args.json:
        args.json.write_text(json.dumps(dict(preset=args.preset, copy_bytes_per_s=copy_bw, bf16_flops_per_s=bf16_rate,
                                             rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
