"""Expert parallelism (runtime/distributed.py) on the CPU: gloo ranks spawned on 127.0.0.1.

Each case spawns ``size`` processes that load a tiny synthetic checkpoint with ``world=...`` and run,
in both combine schemes, a prefill and a few decode steps; the parent compares their logits with
one process holding every expert, and checks that each rank read exactly its experts' bytes.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nvfp4_megamoe.runtime import load_model
from nvfp4_megamoe.runtime.distributed import World, expert_ranges, resolve_world

from numeric import rel_err

BATCH, TOKENS, STEPS = 2, 40, 4  # window 32 and CSA ratio 4 (10 entries > top-k 8) are engaged
EXPERT_FIELDS = ("w13", "w13_scale", "w13_alpha", "w2", "w2_scale", "w2_alpha")


def a2a_rows(rank: int, size: int) -> list[int]:
    """all_to_all: rank 0 runs rows [0, 1], rank r > 0 row r + 1 (batch size + 1, uneven on purpose)."""
    return [0, 1] if rank == 0 else [rank + 1]


def a2a_tokens(rank: int) -> int:
    """all_to_all: ranks sit at different positions and send different token counts (but make the
    same number of forward calls: the collectives run once per layer and call)."""
    return TOKENS - 3 * rank


def run(model, ids: torch.Tensor) -> dict:
    """Prefill logits of all of ``ids``, and decode: prefill all but STEPS tokens, then step through them."""
    full = model(ids)
    state = model.new_state(ids.shape[0])
    prefill = ids.shape[1] - STEPS
    model(ids[:, :prefill], state)
    steps = torch.stack([model.step(ids[:, i], state) for i in range(prefill, ids.shape[1])], dim=1)
    return {"prefill": full, "steps": steps}


def _worker(rank: int, size: int, port: int, ckpt: str, ids: torch.Tensor, results: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        out = {}
        model = load_model(ckpt, world="auto")  # all_reduce: same tokens on every rank
        moe = {i: lw.moe for i, lw in model.weights.layers.items()}
        out["expert_range"] = {i: m.expert_range for i, m in moe.items()}
        out["shapes"] = {i: (tuple(m.w13.shape), tuple(m.w2.shape), tuple(m.w13_alpha.shape)) for i, m in moe.items()}
        out["bytes_read"] = model.checkpoint.bytes_read
        out["all_reduce"] = run(model, ids[:BATCH])
        out["all_reduce_calls"] = model.backend.comm_calls
        model = load_model(ckpt, world=World.from_group(combine="all_to_all"))
        out["all_to_all"] = run(model, ids[a2a_rows(rank, size), :a2a_tokens(rank)])
        torch.save(out, f"{results}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(synth_checkpoints):
    return lambda variant: synth_checkpoints.converted(variant, dense="keep").output


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Ranks start from a fork server that has imported torch, the runtime and this module once: not from a fork of the
# test process (whose threads a fork would copy mid-flight), nor each from a fresh interpreter (seconds per rank).
mp.set_forkserver_preload(["torch", "nvfp4_megamoe.runtime", __name__])


def test_expert_ranges_split_evenly():
    assert expert_ranges(8, 2) == [(0, 4), (4, 8)]
    assert expert_ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert expert_ranges(256, 3) == [(0, 86), (86, 171), (171, 256)]
    assert expert_ranges(5, 5) == [(i, i + 1) for i in range(5)]
    for n, size in ((384, 7), (256, 8), (13, 4)):
        r = expert_ranges(n, size)
        sizes = [b - a for a, b in r]
        assert r[0][0] == 0 and r[-1][1] == n and all(r[i][1] == r[i + 1][0] for i in range(size - 1))
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="at least one"):
        expert_ranges(4, 5)


def test_world_without_process_group():
    assert resolve_world(None) is None and resolve_world("auto") is None  # not initialised: single process
    with pytest.raises(RuntimeError, match="not initialised"):
        resolve_world("all_to_all")
    with pytest.raises(ValueError):
        World(2, 2)
    with pytest.raises(ValueError, match="combine"):
        World(0, 2, combine="ring")


@pytest.mark.parametrize("variant,size", [("flash", 2), ("flash", 4), ("modelopt", 3), ("modelopt", 4)],
                         ids=["flash-2", "flash-4", "modelopt-3-uneven", "modelopt-4"])
def test_expert_parallel_matches_single_process(checkpoint, tmp_path, variant, size):
    ckpt = checkpoint(variant)
    ref = load_model(ckpt)
    n = ref.config.n_routed_experts
    ids = torch.randint(0, ref.config.vocab_size, (size + 1, TOKENS), generator=torch.Generator().manual_seed(3))
    mp.start_processes(_worker, args=(size, free_port(), str(ckpt), ids, str(tmp_path)), nprocs=size, join=True,
                       start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]

    # Each rank read its own expert range and nothing else of the routed experts.
    expert_bytes = sum(getattr(lw.moe, f).nbytes for lw in ref.weights.layers.values() for f in EXPERT_FIELDS)
    other_bytes = ref.checkpoint.bytes_read - expert_bytes
    for rank, (res, (start, stop)) in enumerate(zip(results, expert_ranges(n, size))):
        held = stop - start
        assert set(res["expert_range"].values()) == {(start, stop)}
        for w13, w2, alpha in res["shapes"].values():
            assert w13[0] == w2[0] == alpha[0] == held
        assert res["bytes_read"] == other_bytes + expert_bytes * held // n, rank
        assert res["all_reduce_calls"] > 0

    # all_reduce: every rank ran the same BATCH rows and got the single-process logits.
    want = run(ref, ids[:BATCH])
    errors = []
    for res in results:
        for key in ("prefill", "steps"):
            errors.append(rel_err(res["all_reduce"][key], want[key]))
            assert errors[-1] < 1e-5, key

    # all_to_all: each rank ran its own rows (different counts and positions).
    for rank, res in enumerate(results):
        want = run(ref, ids[a2a_rows(rank, size), :a2a_tokens(rank)])
        for key in ("prefill", "steps"):
            errors.append(rel_err(res["all_to_all"][key], want[key]))
            assert errors[-1] < 1e-5, (rank, key)
    print(f"{variant} x{size}: max rel err {max(errors):.2e}")  # measured: see docs/distributed.md
