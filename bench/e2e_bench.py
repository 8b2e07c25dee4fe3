"""End to end on one GPU: load time, prefill tokens/s, and the decode step against its bytes floor.

For a converted checkpoint (``--checkpoint``; with ``--preset`` the synthetic preset is written and converted
``--target sm90`` there first when the folder holds no checkpoint, which takes minutes) this measures:

* ``load``: seconds of ``load_model(path, device="cuda")`` (reading the shards and compiling or loading the
  kernels: ``warmup_seconds`` of it);
* ``prefill``: tokens/s of ``Model.prefill`` of one ``--prefill-tokens`` prompt fed ``--prefill-chunk`` tokens at a
  time (the second of two runs), against its compute floor: :func:`prefill_flops` at the BF16 matmul rate measured
  in the same run (``floor_ms``, ``pct_of_floor``);
* ``decode``, per context (``--contexts``) and batch (``--batches``): ``Model.step`` replayed from the state's CUDA
  graph. The state is not prefilled token by token: :meth:`DecodeState.assume_positions` puts slot ``s`` at
  ``context - 1 - (s * 37) % 128`` (slots close their compressor windows at different steps) over random entries
  (ring, compressed entries, indexer keys, pending windows), so every store holds ``positions // ratio`` valid
  rows, as a real prefill of that length would leave it; the logits are not any sequence's. Per configuration:

  - ``wall_ms``: a step as a user sees it, ``steps`` back-to-back calls with one synchronisation at the end;
  - ``gpu_ms``: the GPU time of a step, the state's graph replayed ``steps`` times back to back between two CUDA
    events (no host in between);
  - ``host_share``: ``(wall_ms - gpu_ms) / wall_ms``, the share of a step the GPU waits for the host (the step's
    token copy and logits copy, outside the graph, count here);
  - ``floor_ms``: the bytes floor: every non-expert weight of each layer, the routed experts a batch of B tokens
    touches (``E (1 - (1 - k/E)^B)`` of them per layer) and the head (``head``, ``norm``, ``hc_head_*``), read once
    at the copy bandwidth of a 1 GiB device copy measured in the same run; ``state_floor_ms`` adds the bytes a
    step must read from the decode state (ring, valid indexer keys, top-k or all valid entries, pending windows);
  - ``pct_of_floor``: ``floor_ms / wall_ms``; ``per_layer_ms``: ``wall_ms`` over the layers; ``tokens_per_s``.

Results go to ``--out`` (one entry per checkpoint folder name, other entries kept) and a table is printed last,
with the seconds each configuration took (state, first step and capture, timed steps and replays). Loading
includes compiling the kernels the first time a shape is met (``warmup_seconds``; later runs load them from the
kernel cache on disk). Writing a synthetic preset takes minutes: make the checkpoints first, then time them, one
command each::

    nvfp4-convert synth /tmp/flash-layer-src --preset flash-layer
    nvfp4-convert convert /tmp/flash-layer-src /tmp/flash-layer-sm90 --target sm90
    nvfp4-convert synth /tmp/pro-layer-src --preset pro-layer
    nvfp4-convert convert /tmp/pro-layer-src /tmp/pro-layer-sm90 --target sm90
    python bench/e2e_bench.py --checkpoint /tmp/flash-layer-sm90      # writes bench/results/e2e_bench.json
    python bench/e2e_bench.py --checkpoint /tmp/pro-layer-sm90        # adds its entry
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "e2e_bench.json"
WARM_STEPS = 3          # replays after the capturing step, before timing
HEAD_NAMES = ("head.", "norm.", "hc_head_")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a converted checkpoint folder")
    ap.add_argument("--preset", default=None, help="synthetic preset to write and convert (--target sm90) into "
                    "--checkpoint when it holds no checkpoint (flash-layer, pro-layer)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--steps", type=int, default=20, help="timed steps (and timed graph replays) per configuration")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the commit)")
    args = ap.parse_args(argv)
    for name in ("batches", "contexts"):
        if any(v < 1 for v in getattr(args, name)):
            ap.error(f"--{name} must be positive")
    if args.steps < 1 or args.prefill_tokens < 1 or args.prefill_chunk < 1:
        ap.error("--steps, --prefill-tokens and --prefill-chunk must be positive")
    return args


# -- the bytes floor (no GPU needed) ------------------------------------------------------------------------------
def expected_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of ``batch`` tokens touches on average, each picking ``top_k`` of ``n_experts``
    uniformly: ``E (1 - (1 - k/E)^B)``."""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def checkpoint_bytes(path: Path, config) -> dict:
    """Bytes of the tensors a decode step reads, from the shards' headers: per decoder layer the non-expert
    weights and the routed experts (all ``E`` of them), and the head. Left out: the embedding and a hash layer's
    ``tid2eid`` (a step reads B rows of each) and the MTP block (not run)."""
    from nvfp4_megamoe.convert.safetensors_header import read_header

    layers = {i: {"non_expert": 0, "experts": 0} for i in range(config.num_layers)}
    head = 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        for name, info in read_header(shard).tensors.items():
            if name.startswith("layers.") and not name.endswith(".tid2eid"):
                i = int(name.split(".")[1])
                layers[i]["experts" if ".ffn.experts." in name else "non_expert"] += info.nbytes
            elif name.startswith(HEAD_NAMES):
                head += info.nbytes
    return {"layers": layers, "head": head, "n_experts": config.n_routed_experts, "top_k": config.top_k}


def floor_bytes(sizes: dict, batch: int) -> int:
    """Weight bytes a step of ``batch`` tokens must read (see :func:`checkpoint_bytes`)."""
    e, k = sizes["n_experts"], sizes["top_k"]
    touched = expected_experts(e, k, batch) / e
    return round(sum(lb["non_expert"] + touched * lb["experts"] for lb in sizes["layers"].values()) + sizes["head"])


def state_read_bytes(config, batch: int, context: int, state_bytes: int = 2) -> int:
    """Bytes a step must read from the decode state at ``context`` tokens per slot: the ring of every layer; CSA:
    the valid indexer keys, the top-k entries and the pending windows of both compressors with the overlap half;
    HCA: every valid entry and the pending window (float32 kv and gate)."""
    d, w, di = config.head_dim, config.sliding_window, config.index_head_dim
    per_seq = 0
    for ratio in config.compress_ratios:
        per_seq += min(context, w) * d * state_bytes
        count = context // ratio if ratio else 0
        if ratio == 4:
            per_seq += count * di * state_bytes + min(count, config.index_topk) * d * state_bytes
            per_seq += 2 * 4 * (2 * d + 2 * di) * 4 + 2 * 4 * (d + di) * 4     # pending kv/gate, overlap halves
        elif ratio:
            per_seq += count * d * state_bytes + 2 * ratio * d * 4
    return batch * per_seq


# -- GPU measurements ------------------------------------------------------------------------------------------------
def ensure_checkpoint(path: Path, preset: str | None) -> None:
    if (path / "nvfp4_manifest.json").exists():
        return
    if preset is None:
        raise SystemExit(f"{path} holds no converted checkpoint: convert one there, or pass --preset to write one")
    from nvfp4_megamoe.convert.api import convert_checkpoint
    from nvfp4_megamoe.convert.synth import write_synthetic

    src = path.with_name(path.name + "-src")
    if not (src / "config.json").exists():
        write_synthetic(src, preset=preset, variant="flash", seed=0)
    convert_checkpoint(src, path, target="sm90", progress=False)


def fill_state(state, context: int, gen: torch.Generator) -> list[int]:
    """Random entries everywhere and slot s at ``context - 1 - (s * 37) % 128`` tokens (module docstring)."""
    for t in state.tensors()[1:]:
        t.normal_(generator=gen)
    positions = [max(0, context - 1 - (s * 37) % 128) for s in range(state.batch)]
    state.assume_positions(positions)
    return positions


def time_decode(model, context: int, batch: int, steps: int, gen: torch.Generator) -> dict:
    t_start = time.perf_counter()
    # room for the capturing step, the warm and timed steps and as many graph-only replays (not seen by the host)
    state = model.new_state(batch, context + 1 + WARM_STEPS + 2 * steps)
    fill_state(state, context, gen)
    toks = torch.randint(0, model.config.vocab_size, (1 + WARM_STEPS + steps, batch), device="cuda", generator=gen)
    for i in range(1 + WARM_STEPS):
        model.step(toks[i], state)
    torch.cuda.synchronize()
    calls = []
    t0 = time.perf_counter()
    for i in range(1 + WARM_STEPS, 1 + WARM_STEPS + steps):
        c0 = time.perf_counter()
        logits = model.step(toks[i], state)
        calls.append(time.perf_counter() - c0)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    row = {"context": context, "batch": batch, "state_bytes": state.nbytes, "wall_ms": wall * 1e3,
           "host_call_ms": statistics.median(calls) * 1e3, "finite": bool(torch.isfinite(logits).all())}
    graph = model.decode_graphs.graph(("step", state.serial)) if model.decode_graphs is not None else None
    if graph is not None:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(steps):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        gpu = ev[0].elapsed_time(ev[1]) * 1e-3 / steps
        row.update(gpu_ms=gpu * 1e3, host_share=max(0.0, wall - gpu) / wall)
    del state, graph
    torch.cuda.empty_cache()
    row["seconds"] = time.perf_counter() - t_start
    return row


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of a prefill of ``tokens`` tokens from position 0 (the numerator of its compute floor). Per decoder
    layer and token: 2 x the weights the token multiplies (the attention projections; a compressed layer's
    compressor projections, and CSA's indexer ones; the shared and the ``top_k`` routed experts; the router; the
    mHC products before both sublayers), plus 4 H D per key its query attends to (its window of up to
    ``sliding_window`` positions, then CSA's top-k of the entries it may see or HCA's every entry it may see) and
    CSA's indexer, 2 h d per entry scored; plus the head once (the last token's logits)."""
    c = config
    h, heads, d = c.hidden_size, c.num_heads, c.head_dim
    attention_weights = (h * c.q_lora_rank + c.q_lora_rank * heads * d + h * d + heads * d * c.o_lora_rank
                         + c.o_groups * c.o_lora_rank * h)
    ffn_weights = (c.n_shared_experts + c.top_k) * 3 * h * c.moe_intermediate_size + h * c.n_routed_experts
    mhc_weights = 2 * (2 + c.hc_mult) * c.hc_mult * c.hc_mult * h
    index_dims = c.index_n_heads * c.index_head_dim
    total = 0.0
    for ratio in c.compress_ratios:
        weights = attention_weights + ffn_weights + mhc_weights
        if ratio == 4:    # CSA: overlapping compressors (2d wide kv and gate), the indexer's, its query, its weights
            weights += 4 * h * d + 4 * h * c.index_head_dim + h * c.index_n_heads + c.q_lora_rank * index_dims
        elif ratio:       # HCA
            weights += 2 * h * d
        total += 2.0 * weights * tokens
        for pos in range(tokens):
            keys = min(c.sliding_window, pos + 1)
            visible = (pos + 1) // ratio if ratio else 0
            keys += min(c.index_topk, visible) if ratio == 4 else visible
            total += 4.0 * heads * d * keys + (2.0 * index_dims * visible if ratio == 4 else 0.0)
    return total + 2.0 * h * c.vocab_size


def time_prefill(model, tokens: int, chunk: int, gen: torch.Generator) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda", generator=gen)
    state = model.new_state(1, tokens)
    runs = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.prefill([ids], state, [0], chunk=chunk)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return {"tokens": tokens, "chunk": chunk, "seconds": runs[-1], "tokens_per_s": tokens / runs[-1],
            "first_run_seconds": runs[0]}


def compile_summary(report: list) -> dict:
    """The load's worker compiles: kernels, workers, the longest and the sum of their seconds, the workers' longest
    start-up (imports) and when the last answer came (seconds after the workers started)."""
    seconds = [c.seconds for c in report]
    return {"kernels": len(report), "workers": len({c.worker for c in report}),
            "failed": sum(bool(c.error) for c in report), "longest_s": max(seconds, default=0.0), "sum_s": sum(seconds),
            "startup_s": max((c.startup_s for c in report), default=0.0),
            "last_s": max((c.finished_s for c in report), default=0.0)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from gpu_timing import measure_bf16_matmul, measure_copy

    from nvfp4_megamoe.runtime import ModelConfig, load_model

    ensure_checkpoint(args.checkpoint, args.preset)
    config = ModelConfig.from_file(args.checkpoint)
    sizes = checkpoint_bytes(args.checkpoint, config)
    copy_bw, bf16_rate = measure_copy(), measure_bf16_matmul()
    t0 = time.perf_counter()
    model = load_model(args.checkpoint, device="cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = len(model.layer_indices)
    entry = {"label": args.label, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "checkpoint": str(args.checkpoint), "backend": model.backend.name, "layers": layers,
             "compress_ratios": list(config.compress_ratios), "n_experts": sizes["n_experts"], "top_k": sizes["top_k"],
             "copy_bytes_per_s": copy_bw, "bf16_flops_per_s": bf16_rate, "load_seconds": load_s,
             "warmup_seconds": getattr(model.backend, "warmup_seconds", None),
             "compiled": compile_summary(getattr(model.backend, "compile_report", [])),
             "prefill": time_prefill(model, args.prefill_tokens, args.prefill_chunk, gen), "decode": []}
    prefill = entry["prefill"]
    prefill["flops"] = prefill_flops(config, args.prefill_tokens)
    prefill["floor_ms"] = prefill["flops"] / bf16_rate * 1e3
    prefill["pct_of_floor"] = prefill["floor_ms"] / (prefill["seconds"] * 1e3)
    for context in args.contexts:
        for batch in args.batches:
            row = time_decode(model, context, batch, args.steps, gen)
            weights, state = floor_bytes(sizes, batch), state_read_bytes(config, batch, context)
            row.update(floor_bytes=weights, floor_ms=weights / copy_bw * 1e3,
                       state_floor_ms=(weights + state) / copy_bw * 1e3, per_layer_ms=row["wall_ms"] / layers,
                       pct_of_floor=weights / copy_bw * 1e3 / row["wall_ms"], tokens_per_s=batch / row["wall_ms"] * 1e3)
            entry["decode"].append(row)
            print(json.dumps(row), flush=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.checkpoint.name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))

    kernels, built = entry["warmup_seconds"] or 0.0, entry["compiled"]
    print(f"\n{args.checkpoint.name}: {layers} layers, load {load_s:.1f} s (kernels {kernels:.1f} s: "
          f"{built['kernels']} compiled in {built['workers']} processes, longest {built['longest_s']:.1f} s, "
          f"sum {built['sum_s']:.1f} s), "
          f"prefill {prefill['tokens_per_s']:,.0f} tok/s ({prefill['pct_of_floor']:.1%} of its compute floor, "
          f"{prefill['floor_ms']:.1f} ms at {bf16_rate / 1e12:.0f} TFLOP/s BF16), copy {copy_bw / 1e12:.2f} TB/s")
    print(f"{'ctx':>6} {'B':>4} {'step ms':>8} {'GPU ms':>7} {'host':>5} {'/layer':>7} {'floor ms':>8} "
          f"{'% floor':>7} {'+state':>7} {'tok/s':>9} {'s':>5}")
    for r in entry["decode"]:
        gpu, host = r.get("gpu_ms", float("nan")), r.get("host_share", float("nan"))
        print(f"{r['context']:>6} {r['batch']:>4} {r['wall_ms']:8.3f} {gpu:7.3f} {host:5.0%} {r['per_layer_ms']:7.3f} "
              f"{r['floor_ms']:8.3f} {r['pct_of_floor']:7.1%} {r['state_floor_ms']:7.3f} {r['tokens_per_s']:9,.0f} "
              f"{r['seconds']:5.1f}")


if __name__ == "__main__":
    main()
