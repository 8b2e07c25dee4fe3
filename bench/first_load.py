"""Where a first ``load_model(path, device="cuda")`` goes: imports, reading the weights, compiling (or loading) the
kernels, the warm-up forwards.

Run it twice in fresh processes with ``NVFP4_MEGAMOE_KERNEL_CACHE`` set to one empty folder: the first run is a
cold load (every kernel compiled, in one worker process per core), the second a warm one (every kernel read from
the disk cache). ``compile_all`` is timed by wrapping ``cute_host.compile_all``; the kernels read from disk by
wrapping ``cute_host._load_cached``; the worker compiles come from ``model.backend.compile_report``.

    export NVFP4_MEGAMOE_KERNEL_CACHE=$(mktemp -d)
    python bench/first_load.py /tmp/flash-layer-sm90     # cold
    python bench/first_load.py /tmp/flash-layer-sm90     # warm
"""

import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402

from nvfp4_megamoe.kernels import cute_host  # noqa: E402
from nvfp4_megamoe.runtime import load_model  # noqa: E402
from e2e_bench import compile_summary  # noqa: E402


def main(path: str) -> None:
    t_imports = time.perf_counter() - T0
    marks: dict[str, float] = {}
    loads = [0, 0.0]
    compile_all, load_cached = cute_host.compile_all, cute_host._load_cached

    def timed_compile_all(jobs, processes=None, report=None):
        marks["start"] = time.perf_counter()
        n = compile_all(jobs, processes, report)
        marks["end"] = time.perf_counter()
        return n

    def timed_load_cached(where):
        t = time.perf_counter()
        fn = load_cached(where)
        loads[0] += 1
        loads[1] += time.perf_counter() - t
        return fn

    cute_host.compile_all, cute_host._load_cached = timed_compile_all, timed_load_cached
    t = time.perf_counter()
    model = load_model(path, device="cuda")
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    be = model.backend
    print(f"imports {t_imports:.1f} s; load_model {t_end - t:.1f} s = weights {marks['start'] - t:.1f} s + "
          f"kernels {marks['end'] - marks['start']:.1f} s (compiled {be.compiled_at_warmup}; {loads[0]} read from "
          f"disk in {loads[1]:.1f} s) + warm-up forwards {t_end - marks['end']:.1f} s")
    report = be.compile_report
    if report:
        built = compile_summary(report)
        print(f"worker compiles: {built['kernels']} kernels in {built['workers']} processes, "
              f"sum {built['sum_s']:.1f} s, longest {built['longest_s']:.1f} s, failed {built['failed']}")
        for c in sorted(report, key=lambda c: -c.seconds)[:12]:
            print(f"   {c.name:<28} {c.seconds:5.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
