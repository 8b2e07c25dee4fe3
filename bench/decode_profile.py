"""GPU time of every kernel of one decode step, by kernel name: where a step's time goes, op by op.

For a converted checkpoint on the GPU (``load_model(device="cuda")``): a state of ``--context`` tokens per slot
filled as ``e2e_bench.py`` fills it (random entries, slots at staggered positions), three warm steps, then
``--steps`` eager steps (``model.decode_graphs = None``: the same kernels a graph replays, one launch each) under
``torch.profiler``; per batch, the kernels' GPU microseconds a step and launches a step, summed by kernel name,
largest first. The sum is the step's GPU time without the host (a graph replay's, up to launch gaps). With
``--by-op``, the same time summed by the torch op (and its input shapes) that launched it instead: which line of the
model a kernel name stands for (CuTeDSL kernels appear under the op that called them, or none). With
``--prefill T``, the same tables for ``Model.prefill`` of one T-token prompt (``--chunk`` tokens a call) after a warm
prefill of the same length, instead of decode steps: where a prompt's time goes.

    python bench/decode_profile.py --checkpoint /tmp/flash-layer-sm90 --batches 1 32
    python bench/decode_profile.py --checkpoint /tmp/flash-layer-sm90 --batches 1 --by-op
    python bench/decode_profile.py --checkpoint /tmp/flash-layer-sm90 --prefill 4096 --by-op
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from e2e_bench import fill_state


def _profiled_steps(model, batch: int, context: int, steps: int, gen: torch.Generator, activities: list,
                    **options) -> torch.profiler.profile:
    """``steps`` eager steps at ``batch`` under ``torch.profiler`` (``activities``, ``options``), after a state of
    ``context`` tokens a slot is filled and three steps warm it."""
    state = model.new_state(batch, context + 3 + steps)
    fill_state(state, context, gen)
    toks = torch.randint(0, model.config.vocab_size, (3 + steps, batch), device="cuda", generator=gen)
    for i in range(3):
        model.step(toks[i], state)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities, **options) as prof:
        for i in range(3, 3 + steps):
            model.step(toks[i], state)
        torch.cuda.synchronize()
    return prof


def _profiled_prefill(model, tokens: int, chunk: int, gen: torch.Generator, activities: list,
                      **options) -> torch.profiler.profile:
    """One prefill of a ``tokens``-token prompt, ``chunk`` tokens a call, under ``torch.profiler``, after one
    unprofiled prefill of the same prompt (compiles, workspaces)."""
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda", generator=gen)
    state = model.new_state(1, tokens)
    model.prefill([ids], state, [0], chunk=chunk)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities, **options) as prof:
        model.prefill([ids], state, [0], chunk=chunk)
        torch.cuda.synchronize()
    return prof


def kernel_table(prof: torch.profiler.profile, runs: int) -> dict[str, tuple[float, float]]:
    """Kernel name -> (GPU us a run, launches a run) of a profile of ``runs`` runs."""
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name][0] += e.device_time_total / runs
            total[e.name][1] += 1 / runs
    return {name: (us, n) for name, (us, n) in total.items()}


def profile_step(model, batch: int, context: int, steps: int, gen: torch.Generator) -> dict[str, tuple[float, float]]:
    """Kernel name -> (GPU us a step, launches a step) over ``steps`` eager steps at ``batch``."""
    return kernel_table(_profiled_steps(model, batch, context, steps, gen, [torch.profiler.ProfilerActivity.CUDA]),
                        steps)


def ops_table(averages, steps: int, time_attr: str = "self_device_time_total") -> list[tuple[str, str, float, float]]:
    """(op, its input shapes, us a step, calls a step) from ``key_averages(group_by_input_shape=True)``, by the time
    the op itself took (``time_attr``: its own kernels, not those of ops it called), largest first; ops without
    any left out, and so are the kernels' own rows (device events, each already counted under its op)."""
    cpu = torch.autograd.DeviceType.CPU
    rows = [(a.key, str(a.input_shapes)[:80], getattr(a, time_attr) / steps, a.count / steps) for a in averages
            if a.device_type == cpu]
    return sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])


def profile_ops(model, batch: int, context: int, steps: int, gen: torch.Generator) -> list[tuple[str, str, float, float]]:
    """:func:`ops_table` of ``steps`` eager steps at ``batch`` (the state filled as :func:`profile_step` fills it)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = _profiled_steps(model, batch, context, steps, gen, activities, record_shapes=True)
    return ops_table(prof.key_averages(group_by_input_shape=True), steps)


def _print_rows(rows: dict[str, tuple[float, float]], top: int) -> None:
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t:9.1f} us {n:5.0f}x  {name[:100]}")


def print_prefill(model, args: argparse.Namespace, gen: torch.Generator) -> None:
    """The kernels (or, ``--by-op``, the ops) of one ``--prefill``-token prompt, largest first."""
    cuda, cpu = torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU
    what = f"prefill of {args.prefill} tokens, chunks of {args.chunk}"
    if args.by_op:
        prof = _profiled_prefill(model, args.prefill, args.chunk, gen, [cpu, cuda], record_shapes=True)
        ops = ops_table(prof.key_averages(group_by_input_shape=True), 1)
        print(f"\n{what}: {sum(r[2] for r in ops) / 1e3:.1f} ms of kernels, by op")
        for op, shapes, t, n in ops[:args.top]:
            print(f"{t:9.1f} us {n:5.0f}x  {op[:40]:40s} {shapes}")
        return
    rows = kernel_table(_profiled_prefill(model, args.prefill, args.chunk, gen, [cuda]), 1)
    us, launches = sum(v[0] for v in rows.values()), sum(v[1] for v in rows.values())
    print(f"\n{what}: {us / 1e3:.1f} ms of kernels, {launches:.0f} launches")
    _print_rows(rows, args.top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a converted checkpoint folder")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="kernel names (ops) printed per batch")
    ap.add_argument("--by-op", action="store_true", help="sum the GPU time by the torch op and shapes that launched it")
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="profile the prefill of one T-token prompt instead of decode steps")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill tokens a call (with --prefill)")
    args = ap.parse_args()
    from nvfp4_megamoe.runtime import load_model

    model = load_model(args.checkpoint, device="cuda")
    model.decode_graphs = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.prefill:
        print_prefill(model, args, gen)
        return
    for batch in args.batches:
        if args.by_op:
            ops = profile_ops(model, batch, args.context, args.steps, gen)
            print(f"\nB={batch}, context {args.context}: {sum(r[2] for r in ops):.0f} us of kernels a step, by op")
            for op, shapes, t, n in ops[:args.top]:
                print(f"{t:9.1f} us {n:5.0f}x  {op[:40]:40s} {shapes}")
            continue
        rows = profile_step(model, batch, args.context, args.steps, gen)
        us, launches = sum(v[0] for v in rows.values()), sum(v[1] for v in rows.values())
        print(f"\nB={batch}, context {args.context}: {us:.0f} us of kernels a step, {launches:.0f} launches")
        _print_rows(rows, args.top)


if __name__ == "__main__":
    main()
