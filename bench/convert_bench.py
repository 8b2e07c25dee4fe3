"""Converter benchmark (not a test): conversion time against ``cp -r`` of the same source, peak anonymous
memory, throughput; default options (dense FP8 linears kept), ``--dense nvfp4``, ``--buffered-io`` and
``--target sm90``; the scaling with the number of workers; where the time goes (the process's serial steps, and per
stage and thread in the pipeline: ``nvfp4-convert convert --timings``); and the memory check at twice the experts.

    python bench/convert_bench.py --workdir /tmp/convert-bench   # makes the checkpoints if missing;
                                                                 # writes bench/results/convert_bench.json
    python bench/convert_bench.py --workdir DIR --runs 2 --workers 16 --scaling 2,4,8,16 --twice ''
    python bench/convert_bench.py --workdir DIR --twice '' --convert-args '--shard-size 1GB'   # options for every run

Sources are synthetic checkpoints with real V4-Flash layer shapes (``synth`` presets
``flash-layer``: H=4096, I=2048, 64 experts, 3 layers + MTP, ~3.9 GB; ``flash-layer-2x``: the same
with 128 experts, ~7.5 GB). Caches cannot be dropped here (no root access to
``/proc/sys/vm/drop_caches`` assumed), so every timed command starts with the source warm in the
page cache: it is read once (``cat > /dev/null``) right before each run, for ``cp -r`` and the
converter alike, and the workdir's other checkpoint is dropped from the cache (``posix_fadvise``).
Rounds interleave the timed commands; each figure is the best of its rounds (``--runs``, default 3).
``cp -r`` is timed with and without a final ``sync`` (the converter fsyncs every
shard, so ``cp -r && sync`` is the like-for-like figure). Peak anonymous memory is ``RssAnon`` of
the converter process sampled from ``/proc/PID/status`` every 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from nvfp4_megamoe.convert.timing import format_report, format_run

GiB = 1024**3


def warm(src: Path) -> None:
    """Source in the page cache, and the workdir's other checkpoints out of it, so every timed command
    starts with the same source cached and about the same free memory (writing gigabytes into a page
    cache that must first evict other files costs several seconds here)."""
    for other in src.parent.iterdir():
        if other.is_dir() and other != src and (other / "model.safetensors.index.json").exists():
            for p in other.iterdir():
                if p.is_file():
                    fd = os.open(p, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
    for p in sorted(src.iterdir()):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_sampled(cmd: list[str]) -> tuple[float, int, subprocess.CompletedProcess]:
    """Run ``cmd``; return (wall seconds, peak RssAnon bytes, result)."""
    peak = 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            v = rss_anon(proc.pid)
            if v is not None:
                peak = max(peak, v)
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    t.join()
    return wall, peak, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def time_cp(src: Path, dst: Path, sync: bool) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    warm(src)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    if sync:
        subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    return wall


def time_convert(src: Path, out: Path, extra: list[str], workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    warm(src)
    timings = out.with_name(out.name + "-timings.json")
    cmd = [sys.executable, "-m", "nvfp4_megamoe.convert.cli", "convert", str(src), str(out), "--no-progress",
           "--workers", str(workers), "--timings", str(timings), *extra]
    wall, peak, res = run_sampled(cmd)
    if res.returncode != 0:
        raise SystemExit(f"conversion failed:\n{res.stderr[-3000:]}")
    result = {"wall_s": wall, "peak_rss_anon": peak, "out_bytes": folder_bytes(out), "workers": workers,
              "shards": len(list(out.glob("*.safetensors"))), "timings": json.loads(timings.read_text())}
    timings.unlink()
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    return result


# The pipeline's stages in the scaling table's breakdown, in the order a byte meets them (``convert/timing.py``).
STAGES = ("read", "check", "convert", "write", "io-write", "read-back", "hash-output", "hash-file")


def scaling_row(r: dict, base: dict) -> str:
    """One line of the scaling table: time, speed-up over the first worker count, torch's import and the pipeline,
    what the workers did, and each stage's wall seconds summed over its threads."""
    t = r["timings"]
    workers = t["threads"].get("convert", {"threads": 0, "busy_s": [], "stages": {}})
    busy = sum(workers["busy_s"]) / max(1, workers["threads"]) / t["wall_s"]
    stages = workers["stages"]
    cpu = sum(v["cpu_s"] for k, v in stages.items() if not k.startswith("wait:"))
    waits = sorted(((k, v["wall_s"]) for k, v in stages.items() if k.startswith("wait:")), key=lambda kv: -kv[1])
    phases = t.get("run", {}).get("phases", {})
    per_stage = " ".join(f"{t['stages'].get(k, {}).get('wall_s', 0.0):.1f}" for k in STAGES)
    return (f"| {r['workers']} | {r['wall_s']:.1f} | {base['wall_s'] / r['wall_s']:.2f} | "
            f"{phases.get('import-torch', 0.0):.1f} | {t['wall_s']:.1f} | {busy * 100:.0f} % | "
            f"{cpu / max(1e-9, sum(workers['busy_s'])) * 100:.0f} % | "
            + ", ".join(f"{k} {s:.1f}" for k, s in waits[:2]) + f" | {per_stage} | {r['peak_rss_anon'] / 2**20:.0f} |")


def baseline_rss() -> int:
    """RssAnon of a process that only imports the converter (interpreter + torch + libraries)."""
    code = ("import nvfp4_megamoe.convert.api, nvfp4_megamoe.convert.cli, time, os;"
            "print(open(f'/proc/{os.getpid()}/status').read())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) * 1024 for line in out.splitlines() if line.startswith("RssAnon:"))


def breakdown(src: Path, dense: str = "nvfp4") -> dict:
    """Time every unit kind in this process, one unit after another, outputs discarded; and the source sha256."""
    import collections

    from nvfp4_megamoe.convert.options import Options
    from nvfp4_megamoe.convert.plan import make_plan
    from nvfp4_megamoe.convert.source import LocalSource
    from nvfp4_megamoe.convert.hashing import sha256_file
    from nvfp4_megamoe.convert.units import run_unit

    class Discard:
        def write(self, *args) -> None: ...

    source = LocalSource(src)
    plan = make_plan(source, Options(dense=dense))
    secs: collections.Counter = collections.Counter()
    nbytes: collections.Counter = collections.Counter()
    for unit in plan.units:
        kind = getattr(unit, "fmt", "copy")
        t0 = time.perf_counter()
        run_unit(unit, source, Discard())
        secs[kind] += time.perf_counter() - t0
        nbytes[kind] += sum(source.tensors[n].info.nbytes for n in unit.sources)
    t0 = time.perf_counter()
    for f in source.files:
        sha256_file(source.file_path(f))
    secs["sha256"], nbytes["sha256"] = time.perf_counter() - t0, sum(source.file_size(f) for f in source.files)
    return {k: {"s": secs[k], "source_bytes": nbytes[k]} for k in secs}


def ensure(workdir: Path, preset: str) -> Path:
    path = workdir / preset
    if not (path / "model.safetensors.index.json").exists():
        from nvfp4_megamoe.convert.synth import write_synthetic

        print(f"generating {preset} in {path} (slow, once) ...", flush=True)
        shutil.rmtree(path, ignore_errors=True)
        write_synthetic(path, preset=preset, variant="flash")
    return path


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.1f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/convert-bench"))
    ap.add_argument("--preset", default="flash-layer")
    ap.add_argument("--twice", default="flash-layer-2x", help="preset with twice the experts ('' to skip)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds of the timed commands (the best of each is "
                    "reported; all are recorded)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="workers of the timed modes (default: "
                    "one per CPU, as the converter's default)")
    ap.add_argument("--scaling", default="auto", help="worker counts of the scaling runs (default options), e.g. "
                    "2,4,8,16; auto: 1, 2, 4, ... up to the CPUs; '' to skip")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "convert_bench.json")
    ap.add_argument("--breakdown", action="store_true", help="only: time each unit kind in one thread (no output)")
    ap.add_argument("--convert-args", default="", help="options added to every conversion, e.g. '--shard-size 1GB'")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = ensure(args.workdir, args.preset)
    if args.breakdown:
        for kind, r in breakdown(src).items():
            print(f"{kind:8s} {r['s']:7.1f} s  {r['source_bytes'] / 1e9:6.2f} GB of source  "
                  f"{r['source_bytes'] / max(r['s'], 1e-9) / 1e6:9.0f} MB/s")
        print(f"load average {os.getloadavg()[0]:.1f}")
        return
    twice = ensure(args.workdir, args.twice) if args.twice else None
    size = folder_bytes(src)
    cpus = os.cpu_count() or 1
    scaling = ([w for w in (1, 2, 4, 8, 16, 32, 64) if w <= cpus] if args.scaling == "auto" else
               [int(w) for w in args.scaling.split(",") if w.strip()])
    res: dict = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM",
                 "load_before": os.getloadavg(), "source": str(src), "source_bytes": size, "workers": args.workers,
                 "baseline_rss_anon": baseline_rss()}
    # Rounds interleave the commands (cp, cp && sync, default, --dense nvfp4, --buffered-io, --target sm90), so a
    # machine that drifts (other work, memory state) affects all alike; each figure is the best of its rounds.
    modes = (("default", []), ("dense_nvfp4", ["--dense", "nvfp4"]), ("default_buffered", ["--buffered-io"]),
             ("target_sm90", ["--target", "sm90"]))
    common = shlex.split(args.convert_args)
    res["convert_args"] = common
    cp, cp_sync, runs = [], [], {name: [] for name, _ in modes}
    scaled: dict[int, list] = {w: [] for w in scaling}
    for _ in range(args.runs):
        cp.append(time_cp(src, args.workdir / "cp-copy", sync=False))
        cp_sync.append(time_cp(src, args.workdir / "cp-copy", sync=True))
        for name, extra in modes:
            runs[name].append(time_convert(src, args.workdir / "out", extra + common, args.workers))
        for w in scaling:
            scaled[w].append(time_convert(src, args.workdir / "out", common, w))
    res["cp_s"], res["cp_sync_s"], res["cp_runs_s"], res["cp_sync_runs_s"] = min(cp), min(cp_sync), cp, cp_sync
    for name, _ in modes:
        res[name] = dict(min(runs[name], key=lambda r: r["wall_s"]))
        res[name]["peak_rss_anon"] = max(r["peak_rss_anon"] for r in runs[name])
        res[name]["runs_s"] = [r["wall_s"] for r in runs[name]]
    res["scaling"] = []
    for w in scaling:
        best = dict(min(scaled[w], key=lambda r: r["wall_s"]))
        best["peak_rss_anon"] = max(r["peak_rss_anon"] for r in scaled[w])
        best["runs_s"] = [r["wall_s"] for r in scaled[w]]
        res["scaling"].append(best)
    if twice is not None:
        res["twice_source_bytes"] = folder_bytes(twice)
        res["twice_default"] = time_convert(twice, args.workdir / "out", common, args.workers)
    res["load_after"] = os.getloadavg()

    print(f"\nmachine: {res['machine']}; load average before {res['load_before'][0]:.1f}, after {res['load_after'][0]:.1f}")
    print(f"source: {src} ({size / 1e9:.2f} GB); workers {args.workers}; best of {args.runs} interleaved rounds; "
          "source warm in the page cache before every timed command (read once with cat-like reads)"
          + (f"; every conversion with {' '.join(common)}" if common else ""))
    print(f"all rounds (s): cp -r {_fmt(cp)}, cp -r && sync {_fmt(cp_sync)}, "
          + ", ".join(f"{name} {_fmt(res[name]['runs_s'])}" for name, _ in modes))
    print(f"baseline RssAnon (imports only): {res['baseline_rss_anon'] / 2**20:.0f} MiB")
    print(f"cp -r: {res['cp_s']:.1f} s   cp -r && sync: {res['cp_sync_s']:.1f} s   output of the default: "
          f"{res['default']['out_bytes'] / 1e9:.2f} GB in {res['default']['shards']} shards")
    print("| run | time (s) | / cp -r | / cp -r+sync | source GB/s | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|---|")
    rows = [("default", res["default"], size), ("--dense nvfp4", res["dense_nvfp4"], size),
            ("--buffered-io", res["default_buffered"], size), ("--target sm90", res["target_sm90"], size)]
    if twice is not None:
        rows.append(("default, 2x experts", res["twice_default"], res["twice_source_bytes"]))
    for label, r, nbytes in rows:
        ratio = "" if nbytes != size else f"{r['wall_s'] / res['cp_s']:.2f}"
        ratio_s = "" if nbytes != size else f"{r['wall_s'] / res['cp_sync_s']:.2f}"
        print(f"| {label} | {r['wall_s']:.1f} | {ratio} | {ratio_s} | {nbytes / r['wall_s'] / 1e9:.2f} | "
              f"{r['peak_rss_anon'] / 2**20:.0f} |")
    print("\nthe whole process (the serial steps before the pipeline, and after the timings were taken):")
    for label, r, _ in rows:
        print(f"  {label}: {format_run(r['timings'], r['wall_s'])}")
    if twice is not None:
        growth = res["twice_default"]["peak_rss_anon"] / res["default"]["peak_rss_anon"] - 1
        print(f"peak RssAnon growth at twice the experts: {growth * 100:+.1f}%")
    if res["scaling"]:
        print("\nscaling (default options; busy: the share of the pipeline the workers spent in a stage; CPU: the "
              "share of that on a CPU; stages: wall seconds summed over the threads, " + " / ".join(STAGES) + ")")
        print("| workers | time (s) | speed-up | torch's import (s) | pipeline (s) | workers busy | busy on CPU | "
              "workers' longest waits (s) | stages (s) | peak RssAnon (MiB) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in res["scaling"]:
            print(scaling_row(r, res["scaling"][0]))
    print(f"\nwhere the time went (default options, {args.workers} workers, best round):")
    print(format_report(res["default"]["timings"], res["default"]["wall_s"]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
