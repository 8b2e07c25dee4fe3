"""Where a first ``load_model(path, device="cuda")`` goes: imports, then the phases ``Model.load_seconds`` records
(reading the headers and starting the weights' copies, starting the kernel compiles while the copies run, the rest
of the copies, waiting for the kernels, the warm-up forwards), then a user's first decode steps (a new state's
first step runs eagerly and captures the state's CUDA graph).

Run it twice in fresh processes with ``NVFP4_MEGAMOE_KERNEL_CACHE`` set to one empty folder: the first run is a
cold load (every kernel compiled, in one worker process per core), the second a warm one (every kernel read from
the disk cache). The kernels read from disk are counted by wrapping ``cute_host._load_cached``; the worker compiles
come from ``model.backend.compile_report``.

    export NVFP4_MEGAMOE_KERNEL_CACHE=$(mktemp -d)
    python bench/first_load.py /tmp/flash-layer-sm90     # cold (it says so when CuTeDSL lacks its bytecode)
    python bench/first_load.py /tmp/flash-layer-sm90     # warm
"""

import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402

from nvfp4_megamoe.kernels import cute_host  # noqa: E402
from nvfp4_megamoe.runtime import load_model  # noqa: E402
from e2e_bench import compile_summary  # noqa: E402


def uncompiled_cutedsl() -> tuple[int, str]:
    """(CuTeDSL modules without bytecode, the folder to byte-compile): an install unpacked without it (``pip
    install`` compiles it) makes every interpreter compile those modules, about 1.5 s of each load on the H200
    machine, and of each compiling worker's start."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("cutlass")
    if spec is None or spec.origin is None:
        return 0, ""
    root = Path(spec.origin).parent
    missing = sum(not Path(importlib.util.cache_from_source(str(p))).exists() for p in root.rglob("*.py"))
    return missing, str(root)


def main(path: str) -> None:
    t_imports = time.perf_counter() - T0
    missing, root = uncompiled_cutedsl()
    if missing:
        print(f"note: {missing} CuTeDSL modules have no bytecode, so this load compiles them first; as pip installs "
              f"it: python -m compileall -q {root}")
    loads = [0, 0.0]
    load_cached = cute_host._load_cached

    def timed_load_cached(where):
        t = time.perf_counter()
        fn = load_cached(where)
        loads[0] += 1
        loads[1] += time.perf_counter() - t
        return fn

    cute_host._load_cached = timed_load_cached
    t = time.perf_counter()
    model = load_model(path, device="cuda")
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    be = model.backend
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in model.load_seconds.items() if k != "total")
    print(f"imports {t_imports:.1f} s; load_model {total:.1f} s = {phases}; {be.compiled_at_warmup} kernels "
          f"compiled, {loads[0]} read from disk in {loads[1]:.1f} s; weights {model.checkpoint.bytes_read / 1e9:.2f} GB")
    steps = []
    for batch in (1, 8):   # a user's first steps: each new state runs eagerly, then captures its CUDA graph
        state = model.new_state(batch)
        ids = torch.zeros(batch, dtype=torch.long, device="cuda")
        for _ in range(2):
            t = time.perf_counter()
            model.step(ids, state)
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t)
    print(f"first steps after the load: B = 1 {steps[0]:.2f} s (eager + graph capture), then {steps[1] * 1e3:.1f} ms; "
          f"B = 8 {steps[2]:.2f} s, then {steps[3] * 1e3:.1f} ms")
    report = be.compile_report
    if report:
        built = compile_summary(report)
        print(f"worker compiles: {built['kernels']} kernels in {built['workers']} processes, "
              f"sum {built['sum_s']:.1f} s, longest {built['longest_s']:.1f} s, failed {built['failed']}; workers' "
              f"start-up up to {built['startup_s']:.1f} s, last kernel {built['last_s']:.1f} s after they started")
        for c in sorted(report, key=lambda c: -c.seconds)[:12]:
            print(f"   {c.name:<28} {c.seconds:5.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
