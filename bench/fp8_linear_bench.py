"""The dense FP8 linears of a layer against their floor, beside the NVFP4 linear and torch's FP8 GEMM.

Every dense linear of a V4 layer that the official releases store in FP8 (``--preset``: the shapes of
``flash-layer`` or ``pro-layer``; ``wq_a`` with ``wkv``, and the shared expert's w1 with w3, each one weight, as the
runtime calls them), at T = 1, 8, 32, 64, 128 tokens (``--prefill``: also 2048):

* ``fp8``: ``sm90_fp8_linear`` as the heuristics pick it (``fp8_linear_config``), x BF16; ``fp8_x32`` the same
  reading float32 x (the runtime's activations; calls of up to ``sm90_heuristics.fp8_reads_f32_x`` tokens run it);
  with ``--sweep`` also its K splits (``fp8_s<S>``) and, at 32 tokens, one row tile (``fp8_rt1``);
* ``fp8_wgmma`` (T >= 32): the FP8 WGMMA linear (``sm90_fp8_wgmma``, ``sm90_heuristics.fp8_wgmma_config``'s pick),
  x BF16: what ``sm90_fp8_linear`` runs for 33 to 128 tokens (``sm90_heuristics.fp8_wgmma_pays``);
* ``dequant_bf16``: the weight dequantised to BF16, then cuBLAS BF16 (float32 accumulation and out): what
  ``sm90_fp8_linear`` runs past the kernel's token range (``sm90_heuristics.fp8_kernel_pays``);
* ``reference``: what a FP8 linear costs without the kernel (``fp8_linear``: the weight dequantised to float32 at
  every call, a float32 GEMM);
* ``nvfp4``: the NVFP4 linear of the same shape (``sm90_nvfp4_linear``), the default conversion's dense layers;
* ``scaled_mm``: ``torch._scaled_mm`` (cuBLAS FP8 tensor cores) with row-wise scales, x quantised to FP8 outside
  the timing: the FP8 GEMM the hardware offers, an anchor (it reads the same weight bytes, x as FP8);
* from ``W8A8_MIN_TOKENS`` tokens (``--prefill``): ``w8a8``, the W8A8 block-scaled GEMM as a call runs it
  (``sm90_fp8_gemm.sm90_fp8_gemm``: x quantised per token and 128 K, then the FP8 x FP8 GEMM), and ``w8a8_gemm``
  the GEMM alone on x quantised outside the timing; each also as a fraction of the FP8 matmul rate.

Each figure is a CUDA graph of ``--chain`` calls back to back, each on its own copy of the weights, replayed with
the L2 flushed first (``gpu_timing.ColdTimer``; the median over the calls). Floor: the larger of the FP8 weights,
block scales, x and out read or written once at the copy bandwidth, and the FLOPs at the BF16 matmul rate (the
kernel's MMAs are BF16), both measured in the same run; the FP8 matmul rate (``_scaled_mm`` at 8192^3) is measured
too. Per token count the layer's line sums the path the runtime runs (:func:`runtime_path`) against the floor and
against the FLOPs at the FP8 rate, and so does the W8A8 GEMM where it was timed. Numerics are checked by the GPU tests
(``tests/test_fp8_linear_sm90.py``, ``tests/test_fp8_gemm_sm90.py``), not here.

    python bench/fp8_linear_bench.py --preset flash-layer --prefill --json bench/results/fp8_linear_bench.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

W8A8_MIN_TOKENS = 2048   # the W8A8 GEMM is timed from this many tokens on (the prefill calls it is for)


WGMMA_MIN_TOKENS = 32   # calls from this many tokens also time the FP8 WGMMA linear (``fp8_wgmma``)


def fp8_shapes(preset: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, groups) of the FP8 linears of a layer of ``preset`` as the runtime calls them: ``linear_bench``'s
    shapes with ``wq_a`` and ``wkv`` one weight, as the shared expert's w1 and w3 are (``HopperBackend.linears``:
    one input), no head (the releases keep it BF16)."""
    from linear_bench import dense_shapes

    shapes = {name: (n, k, groups) for name, n, k, groups in dense_shapes(preset) if name != "head"}
    (qa, k, _), (kv, _, _) = shapes.pop("wq_a"), shapes.pop("wkv")
    names = {"shared w13": "shared w1 + w3"}
    return [("wq_a + wkv", qa + kv, k, 1)] + [(names.get(name, name), *shape) for name, shape in shapes.items()]


def measure_fp8_matmul() -> float:
    """Dense FP8 matmul rate in FLOP/s (``torch._scaled_mm`` 8192^3, row-wise scales, BF16 out)."""
    from gpu_timing import _median_seconds

    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    return 2 * 8192 ** 3 / _median_seconds(lambda: torch._scaled_mm(a, b.T, sa, sb, out_dtype=torch.bfloat16))


def variants(n: int, k: int, t: int, groups: int, sweep: bool) -> dict:
    """label -> FP8 kernel configuration to time: the pick, and with ``sweep`` its alternatives."""
    from nvfp4_megamoe.kernels.sm90_config import K_TILE
    from nvfp4_megamoe.kernels.sm90_fp8_linear import Sm90Fp8Linear
    from nvfp4_megamoe.kernels.sm90_heuristics import fit_depth, fp8_linear_config

    picked = fp8_linear_config(n, k, t, groups=groups)
    # the pick reading float32 x (the runtime's activations) and rounding it itself, as calls of up to
    # ``fp8_reads_f32_x`` tokens run it
    found = {"fp8": picked, "fp8_x32": replace(picked, x_f32=True)}
    if not sweep:
        return found
    for s in (1, 2, 4, 8, 16, 32):
        if s != picked.k_splits and (k // K_TILE) % s == 0:
            found[f"fp8_s{s}"] = replace(picked, k_splits=s, depth=fit_depth(k // K_TILE // s, 4 // picked.row_tiles))
    if picked.row_tiles == 2:
        found["fp8_rt1"] = replace(picked, row_tiles=1, depth=fit_depth(k // K_TILE // picked.k_splits, 4))
    return {key: c for key, c in found.items() if Sm90Fp8Linear.can_implement(c)}


def runtime_path(tokens: int) -> str:
    """The row key of what ``sm90_fp8_linear`` runs for a call of ``tokens`` rows of the runtime's float32 x: the
    kernel reading float32, the kernel on x cast to BF16, or the weight dequantised for cuBLAS."""
    from nvfp4_megamoe.kernels.sm90_heuristics import fp8_kernel_pays, fp8_reads_f32_x

    if not fp8_kernel_pays(tokens):
        return "dequant_bf16"
    return "fp8_x32" if fp8_reads_f32_x(tokens) else "fp8"


def layer_summary(rows: list[dict], tokens: int, fp8_rate: float) -> dict:
    """A layer's FP8 linears at ``tokens``: the time of the path the runtime runs (:func:`runtime_path`), against
    the sum of the rows' floors and against their FLOPs at the FP8 matmul rate (the prefill goal's measure), and
    the NVFP4 linears of the same shapes and the FP8 WGMMA linear (NaN where a row has no ``fp8_wgmma``)."""
    sel = [r for r in rows if r["tokens"] == tokens]
    path = runtime_path(tokens)
    us = sum(r[path + "_us"] for r in sel)
    floor = sum(r["floor_us"] for r in sel)
    at_fp8_rate = sum(2 * r["tokens"] * r["groups"] * r["n"] * r["k"] for r in sel) / fp8_rate * 1e6
    found = dict(path=path, us=us, floor_us=floor, of_floor=floor / us, fp8_rate_us=at_fp8_rate,
                 of_fp8_rate=at_fp8_rate / us, nvfp4_us=sum(r.get("nvfp4_us", 0.0) for r in sel),
                 fp8_wgmma_us=sum(r.get("fp8_wgmma_us", float("nan")) for r in sel))
    if sel and all("w8a8_us" in r for r in sel):
        w8a8 = sum(r["w8a8_us"] for r in sel)
        found.update(w8a8_us=w8a8, w8a8_of_fp8_rate=at_fp8_rate / w8a8)
    return found


def main(argv: list[str] | None = None) -> None:
    from gpu_timing import ColdTimer, measure_bf16_matmul, measure_copy, time_into

    from nvfp4_megamoe.kernels import cute_host, sm90_fp8_gemm as w8a8, sm90_fp8_linear as fp8
    from nvfp4_megamoe.kernels import sm90_fp8_wgmma as fp8_wgmma
    from nvfp4_megamoe.kernels.sm90_heuristics import fp8_wgmma_config
    from nvfp4_megamoe.kernels import sm90_nvfp4_linear as nvfp4
    from nvfp4_megamoe.kernels.fp8_reference import fp8_linear
    from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes

    from nvfp4_megamoe.kernels.sm90_heuristics import fp8_gemm_config

    from linear_bench import parse_arguments

    args, tokens = parse_arguments(__doc__, "time the FP8 kernel's alternatives, not only the pick", argv)

    copy_bw, bf16_rate, fp8_rate = measure_copy(), measure_bf16_matmul(), measure_fp8_matmul()
    timer = ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name, n, k, groups in fp8_shapes(args.preset):
        if not fp8.can_implement(n, k, groups):
            print(f"{name}: N={n} K={k} not tiled by the FP8 kernel, skipped")
            continue
        rows, c = groups * n, args.chain
        # finite E4M3 codes (0x7F and 0xFF are NaN), E8M0 scales near a real checkpoint's
        w = torch.randint(0, 0x7F, (c, rows, k), dtype=torch.uint8, device="cuda", generator=gen)
        w |= torch.randint(0, 2, w.shape, dtype=torch.uint8, device="cuda", generator=gen) << 7
        sc = torch.randint(115, 122, (c, -(-rows // 128), k // 128), dtype=torch.uint8, device="cuda", generator=gen)
        w4 = torch.randint(0, 256, (c, rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s4 = torch.randint(0x30, 0x38, (c, groups * swizzled_nbytes(n, k // 16)), dtype=torch.uint8, device="cuda",
                           generator=gen)
        alpha = torch.ones(1, device="cuda")
        for t in tokens:
            x = torch.randn(t, groups * k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty(t, groups * n, device="cuda")
            found = variants(n, k, t, groups, args.sweep)
            wgmma = fp8_wgmma_config(n, k, t, groups) if t >= WGMMA_MIN_TOKENS else None
            cases.append((name, n, k, groups, t, w, sc, w4, s4, alpha, x, out, found, wgmma))
    with cute_host.collecting() as jobs:
        for name, n, k, groups, t, w, sc, w4, s4, alpha, x, out, found, wgmma in cases:
            for config in found.values():
                cute_host.compile_op(fp8.linear_op(config), [w[0], sc[0], x.float() if config.x_f32 else x, out])
            if wgmma is not None:
                cute_host.compile_op(fp8_wgmma.linear_op(wgmma), [w[0], sc[0], x, out])
            nvfp4.warmup(n, k, "cuda", groups=groups)
            if t >= W8A8_MIN_TOKENS:
                w8a8.warmup(n, k, "cuda", groups=groups, x_dtype=torch.bfloat16)
    print(f"compiled {cute_host.compile_all(jobs)} kernels")

    rows_out = []
    for name, n, k, groups, t, w, sc, w4, s4, alpha, x, out, found, wgmma in cases:
        chain = range(args.chain)
        nbytes = groups * n * k + sc[0].numel() + x.numel() * 2 + out.numel() * 4
        floor = max(nbytes / copy_bw, 2 * t * groups * n * k / bf16_rate)
        row = dict(name=name, n=n, k=k, groups=groups, tokens=t, floor_us=floor * 1e6,
                   picked=repr(found["fp8"]))
        xf = x.float()
        for key, config in found.items():
            op = fp8.linear_op(config)

            def run(op=op, xk=xf if config.x_f32 else x):
                for i in chain:
                    if op.k_splits > 1:
                        out.zero_()
                    cute_host.launch(op, [w[i], sc[i], xk, out])
            time_into(row, key, run, timer, args.reps)
        if wgmma is not None:
            op = fp8_wgmma.linear_op(wgmma)
            row["picked_wgmma"] = repr(wgmma)

            def run_wgmma(op=op):
                for i in chain:
                    if op.k_splits > 1:
                        out.zero_()
                    cute_host.launch(op, [w[i], sc[i], x, out])
            time_into(row, "fp8_wgmma", run_wgmma, timer, args.reps)
        time_into(row, "dequant_bf16", lambda: [fp8._dequantized_linear(x, w[i], sc[i], out, groups) for i in chain],
                  timer, args.reps)
        wf8 = w.view(torch.float8_e4m3fn)
        if groups == 1:
            time_into(row, "reference", lambda: [fp8_linear(x, wf8[i], sc[i]) for i in chain], timer, args.reps)
        time_into(row, "nvfp4", lambda: [nvfp4.sm90_nvfp4_linear(x, w4[i], s4[i], alpha, out=out, groups=groups)
                                         for i in chain], timer, args.reps)
        if groups == 1:
            xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
            sa, sb = torch.ones(t, 1, device="cuda"), torch.ones(1, n, device="cuda")
            time_into(row, "scaled_mm", lambda: [torch._scaled_mm(xq, wf8[i].T, sa, sb, out_dtype=torch.bfloat16)
                                                 for i in chain], timer, args.reps)
        if t >= W8A8_MIN_TOKENS and w8a8.can_implement(n, k, groups):
            time_into(row, "w8a8", lambda: [w8a8.sm90_fp8_gemm(x, w[i], sc[i], groups=groups, out=out)
                                            for i in chain], timer, args.reps)
            x8, sx8 = w8a8.quantize_activations(x)
            gemm = w8a8.gemm_op(fp8_gemm_config(n, k, t, groups))
            time_into(row, "w8a8_gemm", lambda: [cute_host.launch(gemm, [x8, sx8, w[i], sc[i], out]) for i in chain],
                      timer, args.reps)
        for key in [key for key in row if key.endswith("_us") and key != "floor_us"]:
            row[key] /= args.chain
        at_fp8_rate = 2 * t * groups * n * k / fp8_rate * 1e6
        for key in ("w8a8", "w8a8_gemm"):
            if f"{key}_us" in row:
                row[f"{key}_of_fp8_rate"] = at_fp8_rate / row[f"{key}_us"]
        rows_out.append(row)
        got = row.get("fp8_us", float("nan"))
        best = min((v, key) for key, v in row.items() if key.startswith("fp8") and key.endswith("_us"))
        print(f"{name:13s} N={n:6d} K={k:5d} G={groups} T={t:5d}: fp8 {got:7.1f} us ({row['floor_us'] / got:5.1%} of "
              f"floor {row['floor_us']:6.1f}); best {best[1][:-3]} {best[0]:7.1f}; dequant_bf16 "
              f"{row.get('dequant_bf16_us', float('nan')):7.1f}; nvfp4 "
              f"{row.get('nvfp4_us', float('nan')):7.1f}; fp8_wgmma {row.get('fp8_wgmma_us', float('nan')):7.1f}; "
              f"scaled_mm {row.get('scaled_mm_us', float('nan')):7.1f}; "
              f"reference {row.get('reference_us', float('nan')):8.1f}"
              + (f"; w8a8 {row['w8a8_us']:7.1f} ({row['w8a8_of_fp8_rate']:5.1%} of the FP8 rate), GEMM alone "
                 f"{row['w8a8_gemm_us']:7.1f} ({row['w8a8_gemm_of_fp8_rate']:5.1%})"
                 if "w8a8_gemm_us" in row and "w8a8_us" in row else ""))
    for t in tokens:
        got = layer_summary(rows_out, t, fp8_rate)
        print(f"T={t}: a layer's FP8 linears as the runtime runs them ({got['path']}) {got['us']:.1f} us, floor "
              f"{got['floor_us']:.1f} us ({got['of_floor']:.1%}), at the FP8 rate {got['fp8_rate_us']:.1f} us "
              f"({got['of_fp8_rate']:.1%}); NVFP4 {got['nvfp4_us']:.1f} us; FP8 WGMMA {got['fp8_wgmma_us']:.1f} us"
              + (f"; W8A8 {got['w8a8_us']:.1f} us ({got['w8a8_of_fp8_rate']:.1%} of the FP8 rate)"
                 if "w8a8_us" in got else ""))
    print(f"copy {copy_bw / 1e12:.2f} TB/s, BF16 matmul {bf16_rate / 1e12:.0f} TFLOP/s, FP8 matmul "
          f"{fp8_rate / 1e12:.0f} TFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(dict(preset=args.preset, copy_bytes_per_s=copy_bw, bf16_flops_per_s=bf16_rate,
                                             fp8_flops_per_s=fp8_rate, rows=rows_out), indent=1) + "\n")


if __name__ == "__main__":
    main()
