"""``nvfp4-convert``: the command line. Thin: parse options, call the Python API, print results.

Imports torch only inside the commands, so ``convert`` can start hashing a local source first.
"""

from __future__ import annotations

import atexit
import gc
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import click

from nvfp4_megamoe import __version__

from nvfp4_megamoe.errors import Nvfp4MegamoeError
from nvfp4_megamoe.input_files import folder_problem

from .hashing import hash_ahead
from .options import DEFAULT_DENSE, DEFAULT_SHARD_SIZE, DENSE_MODES, TARGETS, default_workers
from .summary import counted, matrix_counts, matrix_line, tensor_kind, tensor_kinds, tensor_line
from .synth_config import PRESETS, VARIANTS

if TYPE_CHECKING:
    from .plan import Plan

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MAX_SHARD_SIZE = 2**50  # 1 PiB: far above any file system's practical file size, far below int overflow
# Errors a command turns into one "error: ..." paragraph and exit status 1 (OSError: a file system refusal
# the command did not foresee, still reported without a traceback).
REFUSALS = (Nvfp4MegamoeError, OSError)


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1e9' -> bytes (at least 1, at most :data:`MAX_SHARD_SIZE`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size (examples: 5GB, 500MiB, 1000000)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not 1 <= value <= MAX_SHARD_SIZE:  # also refuses 1e400 (inf) and sizes below a byte
        raise click.BadParameter(f"{text!r} is outside 1 byte .. {MAX_SHARD_SIZE:,} bytes")
    return int(value)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return str(n)


def _shards(n: int) -> str:
    return f"{n} shard" + ("" if n == 1 else "s")


def format_rules(counts: dict[str, int], title: str = "tensors per rule:") -> list[str]:
    """The source's tensors per rule of ``convert/rules.py`` (the plan's, or ``inspect``'s of a source)."""
    return [title] + [f"  {rule:32s} {n:7d}" for rule, n in sorted(counts.items())]


def format_outputs(plan: Plan) -> list[str]:
    """What the plan writes: output tensors (passthrough, converted), bytes, shards."""
    kinds = Counter(k if k in ("passthrough", "input_scale") else "converted"
                    for k in (tensor_kind({"transform": o.transform}) for o in plan.outputs))
    lines = [f"output tensors: {len(plan.outputs)} ({counted(kinds)}), {_human(plan.total_bytes)} in "
             f"{_shards(len(plan.shards))} (dense: {plan.options.dense}, target: {plan.options.target}, "
             f"shard size {_human(plan.options.shard_size)})"]
    for i, shard in enumerate(plan.shards):
        lines.append(f"  shard {i + 1:5d}: {len(shard):6d} tensors {_human(sum(o.nbytes for o in shard)):>12s}"
                     f"  {shard[0].name} .. {shard[-1].name}")
    return lines


def format_plan(plan: Plan) -> str:
    """The dry-run report: the source's tensors per rule, then :func:`format_outputs`."""
    return "\n".join(format_rules(plan.rule_counts, "source tensors per rule:") + format_outputs(plan))


def format_result(manifest: dict) -> list[str]:
    """A finished conversion in the shared nouns (``summary.py``): its NVFP4 matrices and the worst error, and
    the MXFP4 blocks that were re-rounded."""
    tensors = manifest["tensors"]
    line = matrix_line(matrix_counts(tensors))
    lossy = [(n, e["error"]["rel_fro"]) for n, e in tensors.items() if "error" in e and n.endswith(".weight")]
    if lossy:
        worst = max(lossy, key=lambda x: x[1])
        line += f"; worst relative error {worst[1]:.3e} ({worst[0]})"
    inexact = sum(e.get("inexact_blocks", 0) for n, e in tensors.items() if n.endswith(".weight"))
    return [line, f"MXFP4 blocks outside E4M3's exact range (re-rounded, counted in the manifest): {inexact}"]


def _fail(exc: Exception | str) -> None:
    if isinstance(exc, OSError) and not isinstance(exc, Nvfp4MegamoeError):
        exc = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else exc
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


class _Commands(click.Group):
    """Ctrl-C ends a command with ``interrupted`` and exit status 130 (128 + SIGINT), not click's ``Aborted!``;
    ``convert`` says how to resume first."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)


def _interrupted(out: Path) -> None:
    """Ctrl-C during ``convert``: what ``out`` keeps and the command that continues."""
    from .resume import JOURNAL_FILE

    if (out / JOURNAL_FILE).is_file():
        click.echo(f"\ninterrupted: {out} keeps the finished shards and the progress journal. Run the same command "
                   f"with --resume to continue, or remove {out} to start over.", err=True)
    else:
        click.echo(f"\ninterrupted before anything was written to {out}.", err=True)
    sys.exit(130)


@click.group(cls=_Commands)
@click.version_option(__version__, prog_name="nvfp4-convert")
def main() -> None:
    """Convert DeepSeek-V4 checkpoints to kernel-ready NVFP4 (format 1), and check the result."""
    # Once torch is imported, the interpreter's closing garbage collections walk its ~180,000 objects: 0.5 s of
    # a conversion's exit on a 2-core VM, 0.1 s with them frozen. What a command writes is closed by then, and the
    # memory goes back with the process. At exit only: a caller running commands in its own process keeps its
    # collector until then (registered once however many commands it runs).
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


@main.command()
@click.argument("source")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dense", type=click.Choice(list(DENSE_MODES)), default=DEFAULT_DENSE, show_default=True,
              help="Dense FP8 linears (attention, shared experts, indexer projections): keep them as released (byte "
                   "for byte), or requantize them to NVFP4, which saves about 2 % of the checkpoint at a relative "
                   "weight error of about 0.1 and a 1-3 % faster H200 decode step (docs/cli.md).")
@click.option("--target", type=click.Choice(list(TARGETS)), default="sm100", show_default=True,
              help="GPUs the checkpoint is for: sm100 is format 1's canonical layout (any GPU); sm90 also lays the "
                   "routed experts' weights out in Hopper row tiles, which the H100/H200 MoE kernels read 6-12 % "
                   "faster (docs/format.md).")
@click.option("--shard-size", default=str(DEFAULT_SHARD_SIZE), show_default=True, callback=lambda c, p, v: parse_size(v),
              help="Largest output shard (a single larger tensor gets its own shard).")
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--revision", default=None, help="Hub sources: branch, tag or commit (resolved once to a commit).")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted conversion in OUT (refused if the source or options differ).")
@click.option("--keep-source/--no-keep-source", default=True, show_default=True,
              help="Hub sources: keep downloaded shards in the HF cache, or stage them in OUT and delete each "
                   "once converted (disk holds a few shards).")
@click.option("--workers", default=default_workers(), show_default="one per CPU, at most 32", type=click.IntRange(1, 64),
              help="Threads converting in parallel (the output bytes do not depend on it).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the FP8 -> NVFP4 and MXFP4 -> NVFP4 numerics run: cpu, or cuda (cuda:N) on a GPU. The "
                   "output bytes are the same.")
@click.option("--direct-io/--buffered-io", default=True, show_default=True,
              help="Write shards with O_DIRECT (past the page cache) where the file system allows it, or buffered. "
                   "The output bytes are the same.")
@click.option("--timings", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write where the run's time went (the steps before the conversion pipeline, and its wall and CPU "
                   "seconds per stage and per thread) to this JSON file.")
def convert(source: str, out: Path, dense: str, target: str, shard_size: int, dry_run: bool, progress: bool,
            revision: str | None, resume: bool, keep_source: bool, workers: int, device: str, direct_io: bool,
            timings: Path | None) -> None:
    """Convert SOURCE (a checkpoint folder, or a Hub repo id owner/name) into OUT."""
    if timings is not None and not timings.parent.is_dir():
        raise click.BadParameter(f"the folder {timings.parent} does not exist; create it first", param_hint="--timings")
    if not (dry_run or resume) and Path(source).is_dir():
        # Before torch is imported (over a second on one core): the source hashes get under way meanwhile.
        hash_ahead(sorted(p for p in Path(source).glob("*.safetensors") if p.is_file()))
    from .api import convert_checkpoint

    try:
        result = convert_checkpoint(source, out, dense=dense, target=target, shard_size=shard_size, dry_run=dry_run,
                                    progress=progress, on_plan=lambda p: click.echo(format_plan(p)),
                                    revision=revision, resume=resume, keep_source=keep_source, workers=workers,
                                    direct_io=direct_io, device=device)
    except REFUSALS as exc:
        _fail(exc)
    except KeyboardInterrupt:
        if dry_run:
            raise
        _interrupted(out)
    if dry_run:
        click.echo("dry run: nothing written")
        return
    if timings is not None and result.timings is not None:
        try:
            timings.write_text(json.dumps(result.timings, indent=1))
        except OSError as exc:
            _fail(exc)
    if result.skipped_shards:
        click.echo(f"resumed: {result.skipped_shards} of {len(result.plan.shards)} shards were already finished")
    click.echo(f"wrote {_shards(len(result.plan.shards))}, {tensor_line(tensor_kinds(result.manifest['tensors']))}, "
               f"{_human(result.plan.total_bytes)} to {out}")
    click.echo("\n".join(format_result(result.manifest)))


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True,
              help="Model size preset (convert/synth_config.py).")
@click.option("--variant", type=click.Choice(VARIANTS), default="flash", show_default=True)
@click.option("--seed", default=0, show_default=True)
def synth(out: Path, preset: str, variant: str, seed: int) -> None:
    """Write a synthetic DeepSeek-V4 checkpoint in the official on-disk format (no network)."""
    from .synth import write_synthetic

    try:
        path = write_synthetic(out, preset=preset, variant=variant, seed=seed)
    except (ValueError, OSError) as exc:
        _fail(exc)
    click.echo(f"wrote synthetic {variant} checkpoint ({preset}) to {path}")


@main.command()
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Where to put the source and output (default: a new temporary folder).")
@click.option("--variant", type=click.Choice(VARIANTS), default="flash", show_default=True)
def demo(workdir: Path | None, variant: str) -> None:
    """Make a tiny synthetic checkpoint, convert it, verify it, run it, and show what happened."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="nvfp4-demo-"))
    src, out = workdir / "source", workdir / "converted"
    taken = [p for p in (src, out) if p.exists()]
    if taken:
        _fail(f"{workdir}: already holds {' and '.join(p.name + '/' for p in taken)} (an earlier demo?); the demo "
              "writes a new checkpoint there. Remove them, or pass another --workdir.")
    try:
        report = _demo(src, out, variant)
    except REFUSALS as exc:
        _fail(exc)
    click.echo(f"demo files are in {workdir}")
    if not report.ok:
        sys.exit(1)


def _demo(src: Path, out: Path, variant: str):
    """The demo's steps (a refusal on the way is reported by :func:`demo`); returns the verify report."""
    import torch

    from nvfp4_megamoe.runtime import load_model

    from .api import convert_checkpoint
    from .inspect import format_summary, inspect_checkpoint
    from .synth import write_synthetic
    from .verify import format_report, verify_checkpoint

    write_synthetic(src, preset="tiny", variant=variant)
    click.echo(format_summary(inspect_checkpoint(src)))  # with the source's tensors per rule: printed once
    click.echo("")
    result = convert_checkpoint(src, out, on_plan=lambda p: click.echo("\n".join(format_outputs(p))), progress=False)
    click.echo("\n".join(format_result(result.manifest)))
    click.echo("")
    click.echo(format_summary(inspect_checkpoint(out)))
    click.echo("")
    report = verify_checkpoint(out, progress=False)
    click.echo(format_report(report))
    model = load_model(out)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    click.echo(f"\nran the converted model ({type(model.backend).__name__}) on {ids.shape[1]} tokens: logits "
               f"{list(logits.shape)}, finite: {bool(torch.isfinite(logits).all())}, next token {int(logits[0, -1].argmax())}")
    return report


@main.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--revision", default=None, help="Hub repositories: branch, tag or commit.")
def inspect_cmd(path: str, as_json: bool, revision: str | None) -> None:
    """Summarise a source or converted checkpoint: a folder, or a Hub repo id owner/name (only config.json, the
    index, the manifest and the shard headers are fetched, never a shard)."""
    from .inspect import format_summary, inspect_checkpoint

    try:
        s = inspect_checkpoint(path, revision=revision)
    except REFUSALS as exc:
        _fail(exc)
    click.echo(json.dumps(s, indent=1) if as_json else format_summary(s))


@main.command("verify")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--source", type=click.Path(path_type=Path), default=None,
              help="Source checkpoint folder for the round trip (default: the local path the manifest recorded).")
@click.option("--structure-only", is_flag=True,
              help="Check structure, hashes and values only, without the round trip against the source (otherwise "
                   "verify fails when it cannot reach the source).")
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write the full per-tensor report to this file (its folder must exist).")
@click.option("--fast", is_flag=True, help="Skip the shard sha256 hashes (the round trip still compares every tensor).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def verify_cmd(out: Path, source: Path | None, structure_only: bool, json_path: Path | None, fast: bool,
               progress: bool) -> None:
    """Check the converted checkpoint in OUT against its manifest and its source; exit 0 only if all holds."""
    if source is not None and structure_only:
        raise click.UsageError("--source asks for the round trip and --structure-only skips it; give one of them")
    if json_path is not None and not json_path.parent.is_dir():
        raise click.BadParameter(f"the folder {json_path.parent} does not exist; create it first (verify writes "
                                 "only the report file)", param_hint="--json")
    problem = folder_problem(out)
    if problem is not None:  # answered before torch is imported
        _fail(f"{out}: {problem}. Give the folder a conversion wrote (nvfp4-convert convert SOURCE {out}).")
    from .verify import format_report, verify_checkpoint

    try:
        report = verify_checkpoint(out, source=source, fast=fast, progress=progress, structure_only=structure_only)
    except REFUSALS as exc:
        _fail(exc)
    click.echo(format_report(report))
    if json_path is not None:
        try:
            report.write_json(json_path)
        except OSError as exc:
            _fail(exc)
        click.echo(f"full report: {json_path}")
    sys.exit(0 if report.ok else 1)


@main.command("warmup")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--processes", type=click.IntRange(1, 256), default=None,
              help="Compiling processes (default: one per CPU core).")
def warmup_cmd(out: Path, processes: int | None) -> None:
    """Compile, on this machine's GPU, every kernel the converted checkpoint in OUT needs and keep them in the kernel
    cache (``$NVFP4_MEGAMOE_KERNEL_CACHE``, else ~/.cache/nvfp4_megamoe/kernels), so that a later load_model
    compiles nothing. Needs an H100/H200 and the gpu extra."""
    problem = folder_problem(out)
    if problem is not None:
        _fail(f"{out}: {problem}. Give the folder a conversion wrote (nvfp4-convert convert SOURCE {out}).")
    import time

    from nvfp4_megamoe.kernels.cute_host import cache_folder
    from nvfp4_megamoe.runtime import load_model
    from nvfp4_megamoe.runtime.hopper import HopperBackend, hopper_available

    if cache_folder() is None:
        _fail("the kernel cache is off (NVFP4_MEGAMOE_KERNEL_CACHE is 0, off, false, none or empty): compiled "
              "kernels would not outlive this process; set it to a folder or unset it")
    if not hopper_available("cuda"):
        _fail("warmup compiles for the GPU it runs on: it needs an sm_90 GPU (H100/H200) and CuTeDSL "
              "(pip install 'nvfp4-megamoe[gpu]')")
    t0 = time.perf_counter()
    backend = HopperBackend()
    try:
        model = load_model(out, device="cuda", backend=backend)
        backend.warmup(model, processes)
    except REFUSALS as exc:
        _fail(exc)
    click.echo(f"{backend.compiled_at_warmup} kernels compiled, the rest found cached, in "
               f"{time.perf_counter() - t0:.1f} s; kept in {cache_folder()}")


if __name__ == "__main__":
    main()
