"""Expert-parallel benchmark: load real-shape synthetic layers across the GPUs of one host, compare the
logits with one GPU holding every expert, and time decode (tokens/s) for each combine scheme.

Run under torchrun, one process per GPU (NCCL). NVLink multicast stays off (this script sets the three
variables below as well: nothing here uses multicast or symmetric memory)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node 2 bench/ep_bench.py \\
        --checkpoint /tmp/flash-layer-nvfp4 --steps 16   # writes bench/results/ep_bench.json

If ``--checkpoint`` does not exist, rank 0 writes the synthetic ``--preset`` (default ``flash-layer``:
real V4-Flash layer shapes, 3 layers, 64 experts; ~4 GB, minutes) and converts it (``--dense keep``)
while the other ranks wait for it. Steps, all on the same token ids:

1. rank 0 alone: the full model on its GPU (``world=None``): prefill logits, decode tokens/s per batch;
2. every rank, per ``--combine``: ``load_model(..., world=World.from_group(combine=c))`` (this rank's
   expert range only), load seconds, bytes read, GPU memory, prefill logits (relative error against
   step 1), decode tokens/s per batch (the slowest rank's time; every rank runs the same batch);
3. rank 0 writes the JSON (``--out``) and prints a table.

On a machine without GPUs it runs on the CPU with gloo (``--preset tiny``: a smoke test of the script).
"""

from __future__ import annotations

import os

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v  # multicast off, whatever the caller's environment says

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nvfp4_megamoe.runtime import ReferenceBackend, World, load_model  # noqa: E402
from nvfp4_megamoe.runtime.distributed import expert_ranges, init_distributed  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_checkpoint(path: Path, preset: str, rank: int) -> None:
    """Rank 0 writes and converts the synthetic checkpoint; the others wait for its marker file
    (a file, not a collective: writing flash-layer takes minutes, past NCCL's timeouts)."""
    done = path / ".ep_bench_ready"
    if rank == 0 and not done.exists():
        from nvfp4_megamoe.convert.api import convert_checkpoint
        from nvfp4_megamoe.convert.synth import write_synthetic

        src = path.with_name(path.name + "-src")
        if not (src / "config.json").exists():
            write_synthetic(src, preset=preset, variant="flash", seed=0)
        if not (path / "nvfp4_manifest.json").exists():
            convert_checkpoint(src, path, dense="keep", progress=False)
        done.touch()
    while not done.exists():
        time.sleep(1)


def decode_rate(model, ids: torch.Tensor, batch: int, prefill: int, steps: int, world: World | None) -> dict:
    """Decode tokens/s at ``batch``: prefill ``prefill`` tokens, 3 untimed steps, ``steps`` timed ones."""
    dev = model.device
    rows = ids[:1, :prefill].expand(batch, -1).contiguous()
    state = model.new_state(batch)
    model(rows, state)
    token = rows[:, -1]
    for _ in range(3):
        token = model.step(token, state).argmax(-1)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = model.step(token, state).argmax(-1)
    sync(dev)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
    if world is not None:  # the slowest rank sets the pace
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=world.group)
    s = float(seconds)
    return {"batch": batch, "steps": steps, "seconds": s, "ms_per_step": 1e3 * s / steps,
            "tokens_per_s": batch * steps / s}


def measure(ckpt: Path, device, world: World | None, args, ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    t0 = time.perf_counter()
    backend = ReferenceBackend() if args.backend == "reference" else None
    model = load_model(ckpt, device=device, world=world, backend=backend)
    sync(model.device)
    load_s = time.perf_counter() - t0
    moe = next(iter(model.weights.layers.values())).moe
    rec = {"backend": model.backend.name, "load_seconds": load_s, "bytes_read": model.checkpoint.bytes_read,
           "expert_range": list(moe.expert_range),
           "warmup_seconds": getattr(model.backend, "warmup_seconds", None)}
    if model.device.type == "cuda":
        rec["gpu_memory_allocated"] = torch.cuda.memory_allocated(model.device)
    logits = model(ids)
    sync(model.device)
    rec["decode"] = [decode_rate(model, ids, b, args.prefill, args.steps, world) for b in args.batches]
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rec, logits.float().cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--preset", default="flash-layer", help="synthetic preset written when --checkpoint is missing")
    ap.add_argument("--combine", nargs="+", default=["all_reduce", "all_to_all"], choices=["all_reduce", "all_to_all"])
    ap.add_argument("--backend", default="auto", choices=["auto", "reference"],
                    help="auto: Hopper kernels on sm_90, references elsewhere")
    ap.add_argument("--tokens", type=int, default=64, help="prefill length of the logits comparison")
    ap.add_argument("--prefill", type=int, default=64, help="context before the timed decode steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "ep_bench.json")
    args = ap.parse_args()

    world, device = init_distributed(timeout=datetime.timedelta(minutes=30))
    if device.type == "cpu":
        torch.set_num_threads(1)
    make_checkpoint(args.checkpoint, args.preset, world.rank)
    cfg = json.loads((args.checkpoint / "config.json").read_text())
    ids = torch.randint(0, cfg["vocab_size"], (1, max(args.tokens, args.prefill)),
                        generator=torch.Generator().manual_seed(0))[:, : args.tokens].to(device)

    report = {"world_size": world.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "checkpoint": str(args.checkpoint), "n_routed_experts": cfg["n_routed_experts"],
              "expert_ranges": expert_ranges(cfg["n_routed_experts"], world.size),
              "tokens": args.tokens, "prefill": args.prefill, "env": {k: os.environ[k] for k in
              ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}}
    ref = None
    if world.rank == 0:
        report["single"], ref = measure(args.checkpoint, device, None, args, ids)
    dist.barrier()

    report["ep"] = {}
    for combine in args.combine:
        rec, logits = measure(args.checkpoint, device, World.from_group(combine=combine), args, ids)
        per_rank = [None] * world.size
        dist.all_gather_object(per_rank, {k: rec[k] for k in ("expert_range", "bytes_read", "load_seconds",
                                                              "gpu_memory_allocated") if k in rec})
        if world.rank == 0:
            rec["per_rank"] = per_rank
            rec["logits_rel_err_vs_single"] = float((logits - ref).norm() / ref.norm())
            report["ep"][combine] = rec

    if world.rank == 0:
        print(f"world {world.size} on {report['device']}, {report['n_routed_experts']} experts, ranges {report['expert_ranges']}")
        rows = [("single", report["single"])] + [(f"ep:{c}", r) for c, r in report["ep"].items()]
        for name, r in rows:
            err = r.get("logits_rel_err_vs_single")
            print(f"{name:14s} load {r['load_seconds']:6.1f} s  read {r['bytes_read'] / 2**30:6.2f} GiB"
                  + ("" if err is None else f"  logits rel err {err:.2e}"))
            for d in r["decode"]:
                print(f"    B={d['batch']:3d}  {d['ms_per_step']:8.2f} ms/step  {d['tokens_per_s']:9.1f} tok/s")
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
