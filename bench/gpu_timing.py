"""Timing on the GPU for the benchmarks: measured ceilings, cold-L2 CUDA-graph timing, capture.

Shared by ``moe_bench.py`` and ``attention_bench.py`` so both report against the same physical
limits measured the same way in the same run.
"""

from __future__ import annotations

import statistics

import torch


def _median_seconds(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(reps):
        ev[0].record(); fn(); ev[1].record(); torch.cuda.synchronize()  # noqa: E702
        ts.append(ev[0].elapsed_time(ev[1]) * 1e-3)
    return statistics.median(ts)


def measure_copy() -> float:
    """Device copy bandwidth in bytes/s (read + write counted) over a 1 GiB buffer."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * n / _median_seconds(lambda: b.copy_(a))


def measure_bf16_matmul() -> float:
    """Dense BF16 matmul rate in FLOP/s (8192^3)."""
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / _median_seconds(lambda: m @ m)


class ColdTimer:
    """Median microseconds of one CUDA-graph replay with the L2 flushed before each."""

    def __init__(self):
        self.flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def time(self, graph: torch.cuda.CUDAGraph, reps: int) -> float:
        ts = []
        for _ in range(reps):
            self.flush.fill_(1)
            self.ev[0].record(); graph.replay(); self.ev[1].record()  # noqa: E702
            torch.cuda.synchronize()
            ts.append(self.ev[0].elapsed_time(self.ev[1]) * 1e3)
        return statistics.median(ts)


def capture(fn) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` in a CUDA graph (run once and warmed on a side stream first: compile/allocate)."""
    fn(); torch.cuda.synchronize()  # noqa: E702
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_into(row: dict, name: str, fn, timer: ColdTimer, reps: int) -> None:
    """``row[name + "_us"]``: median cold graph replay of ``fn``; or ``row[name + "_error"]`` if it cannot run."""
    try:
        g = capture(fn)
        row[f"{name}_us"] = timer.time(g, reps)
        del g
    except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
        row[f"{name}_error"] = repr(e)[:300]
