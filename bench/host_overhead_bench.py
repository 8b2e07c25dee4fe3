"""Host time of eager (not graph-captured) calls: kernel launches, one MoE layer, one decode step.

An eager decode step is bound by the host, not the GPU (``docs/runtime.md``), so what a launch costs
on the CPU is what an eager user waits for. Measured, on the GPU machine:

* ``launch_us``: one launch of the MoE L1 kernel (V4-Flash shape, T = 1) through ``cute_host.launch``;
* ``moe_layer_us``: one ``Sm90Nvfp4Moe`` call (V4-Flash, T = 1 and 4: routing glue + L1 + L2);
* ``decode_attention_us``: one ``sm90_decode_attention`` call (64 heads, B = 1, CSA top-k 512, 10 splits +
  the combine kernel);
* ``step_ms``: one ``Model.step`` of the tiny synthetic V4-Flash model (5 layers, dense NVFP4, Hopper
  backend) at batch 1 and 8, every op eager, with the number of kernel launches per step and the host
  time spent in them; ``step_graphs``: the same with the whole step replayed from the state's CUDA graph
  (``Model.decode_graphs``, the default of ``load_model`` on the kernels path; a state's first step
  captures, and is among the timed steps only if it is the median).

Host times are medians of ``perf_counter`` spans around calls that do not wait for the GPU (the GPU is
synchronised every 20 calls so its queue stays short); a step synchronises before and after.

    python bench/host_overhead_bench.py   # writes bench/results/host_overhead_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def host_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def kernel_calls(res: dict) -> None:
    from nvfp4_megamoe.kernels import cute_host
    from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
    from nvfp4_megamoe.kernels.sm90_config import MoeShape
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_decode_attention
    from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, e, k = 4096, 2048, 256, 6
    w = random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False)
    layer = Sm90Nvfp4Moe(MoeShape(h, i, e, k, 10.0), max_tokens=4)
    for t in (1, 4):
        x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices.int()
        wts = torch.rand(t, k, device="cuda", generator=gen)
        out = torch.empty(t, h, device="cuda")
        res[f"moe_layer_t{t}_us"] = host_us(lambda: layer(x, ids, wts, **w, out=out))
        if t == 1:
            _, l1, _ = layer.kernels(layer.plan(1))
            args = [w["w13"], w["w13_scale"], w["w13_alpha"].reshape(-1), x, layer.zeros, wts.reshape(-1),
                    ids.reshape(k, 1), layer.num_tiles, layer.hbuf[:k], out]
            res["launch_us"] = host_us(lambda: cute_host.launch(l1, args))
    q = torch.randn(1, 64, 512, device="cuda", generator=gen).bfloat16()
    kvw = torch.randn(1, 128, 512, device="cuda", generator=gen).bfloat16()
    wlen = torch.full((1,), 128, dtype=torch.int32, device="cuda")
    kvc = torch.randn(1, 2048, 512, device="cuda", generator=gen).bfloat16()
    idx = torch.argsort(torch.rand(1, 2048, device="cuda", generator=gen), dim=1)[:, :512].int().contiguous()
    sink = torch.randn(64, device="cuda", generator=gen)
    o = torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16)
    res["decode_attention_us"] = host_us(lambda: sm90_decode_attention(q, kvw, wlen, kvc, idx, sink, 512 ** -0.5, out=o))


def decode_steps(res: dict, steps: int = 20) -> None:
    import nvfp4_megamoe.kernels.sm90_decode_attention as m_attention
    import nvfp4_megamoe.kernels.sm90_indexer as m_indexer
    import nvfp4_megamoe.kernels.sm90_mhc as m_mhc
    import nvfp4_megamoe.kernels.sm90_moe as m_moe
    import nvfp4_megamoe.kernels.sm90_nvfp4_linear as m_linear
    from nvfp4_megamoe.convert.api import convert_checkpoint
    from nvfp4_megamoe.convert.synth import write_synthetic
    from nvfp4_megamoe.runtime import load_model

    spent = {"n": 0, "s": 0.0}
    for mod in (m_moe, m_linear, m_attention, m_indexer, m_mhc):  # count and time every kernel launch
        def timed(op, tensors, orig=mod._launch):
            t0 = time.perf_counter()
            orig(op, tensors)
            spent["s"] += time.perf_counter() - t0
            spent["n"] += 1
        mod._launch = timed
    with tempfile.TemporaryDirectory() as d:
        src = write_synthetic(f"{d}/src", preset="tiny", variant="flash", seed=0)
        convert_checkpoint(src, f"{d}/out", dense="nvfp4", progress=False)
        model = load_model(f"{d}/out", device="cuda")
        res["layers"] = len(model.layer_indices)
        gen = torch.Generator(device="cuda").manual_seed(0)
        graphs = getattr(model, "decode_graphs", None)  # None where load_model uses none (or predates them)
        for mode in ("eager", "graphs") if graphs is not None else ("eager",):
            model.decode_graphs = graphs if mode == "graphs" else None
            for b in (1, 8):
                state = model.new_state(b)
                model(torch.randint(0, model.config.vocab_size, (b, 8), device="cuda", generator=gen), state)
                times = []
                spent.update(n=0, s=0.0)
                for _ in range(steps):
                    tok = torch.randint(0, model.config.vocab_size, (b,), device="cuda", generator=gen)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.step(tok, state)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                name = f"step_b{b}" if mode == "eager" else f"step_graphs_b{b}"
                res[f"{name}_ms"] = statistics.median(times) * 1e3
                res[f"{name}_launches"] = spent["n"] / steps
                res[f"{name}_launch_ms"] = spent["s"] / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "host_overhead_bench.json"))
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the commit)")
    args = ap.parse_args()
    res = {"label": args.label, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    kernel_calls(res)
    decode_steps(res)
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
