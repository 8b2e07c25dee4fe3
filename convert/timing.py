"""Where a conversion's time goes: wall and CPU seconds per stage and per thread, counted while it runs.

A stage is a stretch of one thread's work (``with stage("read"): ...``). Stages nest; a stage's figures leave
out the stages inside it, so a thread's stages add up to its busy time. Each thread counts into its own
record (no lock on the way; one dictionary update per stage), and :func:`report` sums the records.

CPU seconds (``time.thread_time``) beside wall seconds tell computing from waiting: a stage whose wall time
is well above its CPU time waited for the disk, a lock, the GIL or a free core. Stages named ``wait:...``
are explicit waits (memory budget, a free bounce buffer, the source file); the rest of a thread's life
in the run, outside any stage, is idle (its pool had no work for it).

:func:`start` begins a new count (a conversion calls it first); conversions that overlap in one process
count into the same figures.

The pipeline is not the whole run: before it come the process's start and imports, the source's headers, the
plan and torch's import, and after it the process's exit. :func:`phase` times each serial step of the run on the
calling thread (:func:`begin_run` drops an earlier run's), and :func:`report` puts them beside the pipeline's
figures with the process's age, so that a benchmark timing the process accounts for all of it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_local = threading.local()
_epoch = 0
_started = time.perf_counter()
_records: list["_ThreadRecord"] = []
_phases: dict[str, float] = {}  # the run's serial steps outside the pipeline: name -> wall s, in order
_run_began: float | None = None  # the process's age when the run began


class _ThreadRecord:
    """One thread's counters in one count: stage -> [wall s, CPU s, calls]."""

    def __init__(self, name: str, epoch: int):
        self.name, self.epoch = name, epoch
        self.stages: dict[str, list] = {}


def _record() -> _ThreadRecord:
    rec = getattr(_local, "record", None)
    if rec is None or rec.epoch != _epoch:
        rec = _ThreadRecord(threading.current_thread().name, _epoch)
        _local.record = rec
        with _lock:
            _records.append(rec)
    return rec


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the enclosed work as stage ``name`` of the calling thread.

    A stage that began before :func:`start` counts from there (its CPU seconds at most its wall seconds)."""
    stack = getattr(_local, "open", None)
    if stack is None:
        stack = _local.open = []  # the thread's open stages: [wall at entry, CPU at entry, inner wall, inner CPU]
    frame = [time.perf_counter(), time.thread_time(), 0.0, 0.0]
    stack.append(frame)
    try:
        yield
    finally:
        now = time.perf_counter()
        wall, cpu = now - frame[0], time.thread_time() - frame[1]
        stack.pop()
        if stack:  # the enclosing stage leaves this one out
            stack[-1][2] += wall
            stack[-1][3] += cpu
        rec = _record()
        if frame[0] < _started:
            wall = now - _started
            cpu = min(cpu, wall)
            frame[2] = min(frame[2], wall)
            frame[3] = min(frame[3], cpu)
        entry = rec.stages.setdefault(name, [0.0, 0.0, 0])
        entry[0] += wall - frame[2]
        entry[1] += cpu - frame[3]
        entry[2] += 1


def start() -> None:
    """Begin a new count: what threads counted before is dropped."""
    global _epoch, _started
    with _lock:
        _epoch += 1
        _started = time.perf_counter()
        _records.clear()


def process_age() -> float | None:
    """Seconds since this process started (Linux: its start time in ``/proc``, to a clock tick), or None where
    that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, IndexError, ValueError):
        return None


def begin_run() -> None:
    """A run begins: the phases an earlier run in this process counted are dropped."""
    global _run_began
    with _lock:
        _phases.clear()
        _run_began = process_age()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the enclosed work as the run's serial step ``name`` (wall seconds; a step run twice adds up)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        wall = time.perf_counter() - t0
        with _lock:
            _phases[name] = _phases.get(name, 0.0) + wall


def _group(thread: str) -> str:
    """A pool's threads under one name: ``convert_3`` -> ``convert``, ``Thread-7 (worker)`` -> ``Thread``."""
    return re.sub(r"(_\d+|-\d+.*)$", "", thread) or thread


def report() -> dict:
    """The count since :func:`start`: per stage (all threads), and per thread group: busy (in a stage) and idle
    seconds of each thread over the run's wall time, and the stages' wall and CPU seconds; and the whole run
    (``run``): the process's age when the run began (for a command: the interpreter's start and the command's
    imports), the serial steps (:func:`phase`) before the pipeline's ``wall_s``, and the process's age now (what
    follows, the command's output and the process's exit, is the process's wall time less this)."""
    wall = time.perf_counter() - _started
    with _lock:
        records = [r for r in _records if r.epoch == _epoch]
    stages: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    for rec in records:
        snapshot = {k: list(v) for k, v in list(rec.stages.items())}
        g = groups.setdefault(_group(rec.name), {"threads": 0, "busy_s": [], "stages": {}})
        g["threads"] += 1
        g["busy_s"].append(sum(v[0] for k, v in snapshot.items() if not k.startswith("wait:")))
        for k, (w, c, n) in snapshot.items():
            for into in (stages.setdefault(k, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0}),
                         g["stages"].setdefault(k, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0})):
                into["wall_s"] += w
                into["cpu_s"] += c
                into["calls"] += n
    for g in groups.values():
        waits = sum(v["wall_s"] for k, v in g["stages"].items() if k.startswith("wait:"))
        g["busy_s"] = sorted(g["busy_s"], reverse=True)
        g["idle_s"] = max(0.0, g["threads"] * wall - sum(g["busy_s"]) - waits)
    with _lock:
        run = {"began_s": _run_began, "phases": dict(_phases), "pipeline_s": wall, "reported_s": process_age()}
    return {"wall_s": wall, "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "stages": stages, "threads": groups, "run": run}


def format_run(rep: dict, process_s: float | None = None) -> str:
    """The whole run on one line: the process's start and imports, each serial step, the pipeline, and, given the
    process's wall time ``process_s`` (timed from outside), what followed the report (output, exit)."""
    run = rep.get("run")
    if run is None:
        return f"pipeline {rep['wall_s']:.2f} s"
    parts = [] if run["began_s"] is None else [f"start and imports {run['began_s']:.2f}"]
    parts += [f"{k} {v:.2f}" for k, v in run["phases"].items()] + [f"pipeline {run['pipeline_s']:.2f}"]
    if process_s is not None and run["reported_s"] is not None:
        parts.append(f"output and exit {process_s - run['reported_s']:.2f}; process {process_s:.2f}")
    return "run (s): " + ", ".join(parts)


def format_report(rep: dict, process_s: float | None = None) -> str:
    """The report as a line for the whole run (:func:`format_run`) and two small tables: stages summed over
    threads, and thread groups (busy, waiting, idle)."""
    lines = [format_run(rep, process_s), f"pipeline wall {rep['wall_s']:.2f} s on {rep['cpus']} CPUs",
             "stage           wall s    CPU s   calls"]
    for k, v in sorted(rep["stages"].items(), key=lambda kv: -kv[1]["wall_s"]):
        lines.append(f"  {k:13s} {v['wall_s']:8.2f} {v['cpu_s']:8.2f} {v['calls']:7d}")
    lines.append("threads            n   busy s   wait s   idle s  top stages (wall s)")
    for name, g in sorted(rep["threads"].items(), key=lambda kv: -sum(kv[1]["busy_s"])):
        waits = sum(v["wall_s"] for k, v in g["stages"].items() if k.startswith("wait:"))
        top = sorted(g["stages"].items(), key=lambda kv: -kv[1]["wall_s"])[:4]
        lines.append(f"  {name:15s} {g['threads']:3d} {sum(g['busy_s']):8.2f} {waits:8.2f} {g['idle_s']:8.2f}  "
                     + ", ".join(f"{k} {v['wall_s']:.2f}" for k, v in top))
    return "\n".join(lines)
