"""``convert_checkpoint``: the converter's Python entry point (the CLI is a thin layer over it).

A run: open the source (a folder, or a Hub repo pinned to one commit), make the plan from
headers alone, prepare the output folder (or, with ``resume``, check that the unfinished run
there is this run and keep its verified shards), then execute the plan:

* the units' pieces (experts, stretches of copied tensors) run on a thread pool (``workers``,
  ``pipeline.py``); each writes its own byte ranges at offsets fixed by the plan, so the bytes do
  not depend on the number of threads or the order pieces finish in;
* source shards are fetched in the order units first need them (:class:`Stager`), at most a few
  ahead when the source is not kept, and released when their last unit is done;
* every source file is hashed once, on background threads, as soon as it is available (for a
  Hub download the hash is checked against the LFS sha256 the Hub published);
* output shards are hashed as they fill; each finished one is fsynced and renamed in the
  background, then recorded in the progress journal (``resume.py``); the index, written last,
  marks the folder complete.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tqdm.auto import tqdm

from nvfp4_megamoe import __version__
from nvfp4_megamoe.input_files import file_kind
from nvfp4_megamoe.runtime.format import (FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, MANIFEST_FILE,
                                          ROW_TILES_FORMAT_VERSION)

from .errors import ConvertError, OutputError
from .hub import HubSource
from .locate import open_source
from .options import DEFAULT_DENSE, DEFAULT_SHARD_SIZE, Options, default_workers
from .output_config import write_extra_files
from .output_folder import check_output
from .plan import Plan, make_plan
from .resume import JOURNAL_FILE, Journal, checked_progress, identity_differences, restore_unit, unit_results, write_atomic
from .source import LocalSource
from .source_hashes import SourceHashes
from .staging import Stager
from .hashing import hash_threads, sha256_file
from . import timing
from .timing import phase, stage

if TYPE_CHECKING:  # torch: imported to make the plan (the output-folder checks come first, without it)
    import torch

    from .writer import ShardWriter

__all__ = ["ConvertResult", "convert_checkpoint", "open_source", "write_atomic", "DEFAULT_WORKERS"]

TARGET = {
    "layout": "blackwell-k-major",
    "fp4": "e2m1, two per byte, low nibble = even element",
    "block_scale": "e4m3 per 16 along K, 128x4 swizzle (rows padded to 128, scale columns to 4, zeros)",
    "global_scale": "float32 alpha, value = e2m1 * e4m3 * alpha",
    "gate_up_interleave": 8,
}
ROW_TILES_TARGET = {
    "routed_weight_layout": "hopper row tiles: [E, M/16, K/128, 16 rows, 64 bytes], each 4-byte word in hopper nibble "
                            "order (nvfp4_megamoe.kernels.row_tiles)",
}
STAGING_DIR = ".nvfp4_source"
DEFAULT_WORKERS = default_workers()
# Source shards held on disk at once when the source is not kept (beyond those in use).
STAGED_AHEAD = 2

Source = LocalSource | HubSource


@dataclass
class ConvertResult:
    """What a conversion did."""

    out: Path
    plan: Plan
    manifest: dict
    skipped_shards: int = 0
    timings: dict | None = None  # where the run's time went (``timing.report``), for a run that converted


# ---------------------------------------------------------------------------------------- output folder


@dataclass
class Prepared:
    journal: Journal
    done: dict[str, tuple[int, str]]


def _create(out: Path, journal: Journal) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{out}: cannot create the output folder ({exc.strerror or exc}); choose a folder you can "
                          "write to.", path=out) from None
    journal.save()


def prepare_output(out: Path, src: Source, plan: Plan, resume: bool) -> Prepared:
    """Create ``out``, or check the unfinished run in it (``resume``); ``out`` has passed
    :func:`~.output_folder.check_output`."""
    identity = Journal.identity_for(src.record(), {f: src.stamp(f) for f in src.files}, plan)
    journal = Journal(out, identity)
    data = Journal.load(out) if out.is_dir() else None
    if data is None:
        _create(out, journal)
        return Prepared(journal, {})
    reasons = identity_differences(data["identity"], identity)
    if reasons:
        raise OutputError(f"{out}: --resume refused: the unfinished conversion there is not this run: "
                          + "; ".join(reasons) + f". To start over, remove {out} (or choose another folder) and "
                          "convert without --resume.", path=out)
    progress = checked_progress(data, out / JOURNAL_FILE, plan, src.files)
    recorded = progress["shards"]
    names = list(recorded)
    with ThreadPoolExecutor(2, thread_name_prefix="verify") as pool:
        actual = list(pool.map(lambda n: _shard_state(out / n, recorded[n]["size"]), names))
    done = {}
    for name, sha in zip(names, actual):
        if sha is not None and sha == recorded[name]["sha256"]:
            done[name] = (recorded[name]["size"], sha)
        else:
            (out / name).unlink(missing_ok=True)  # one of this run's shard names (checked_progress), inside out
    for p in out.glob(".*.partial"):
        if file_kind(p) == "a regular file":
            p.unlink()
    journal.shards = {n: {"size": s, "sha256": h} for n, (s, h) in done.items()}
    journal.units = dict(progress["units"])
    journal.source_sha256 = dict(progress["source_sha256"])
    journal.save()
    return Prepared(journal, done)


def _shard_state(path: Path, size: int) -> str | None:
    try:
        if path.stat().st_size != size:
            return None
    except OSError:
        return None
    return sha256_file(path)


# ---------------------------------------------------------------------------------------- manifest


def build_manifest(src: Source, plan: Plan, writer: ShardWriter, source_files: dict) -> dict:
    shards = {}
    for name, shard in zip(writer.names, plan.shards):
        shards[name] = {"size": writer.sizes[name], "sha256": writer.hashes[name].result(),
                        "tensors": [o.name for o in shard]}
    tensors = {}
    for o in plan.outputs:
        entry = {"sources": o.sources, "transform": o.transform, "lossless": o.lossless}
        if o.error is not None:
            entry["error"] = o.error
        entry.update(o.notes)
        tensors[o.name] = entry
    return {
        "format": FORMAT_NAME,
        "format_version": ROW_TILES_FORMAT_VERSION if plan.options.target == "sm90" else FORMAT_VERSION,
        "converter_version": __version__,
        "source": {**src.record(), "files": source_files},
        "options": plan.options.as_dict(),
        "options_sha256": plan.options.digest(),
        "target": {**TARGET, **(ROW_TILES_TARGET if plan.options.target == "sm90" else {})},
        "rule_counts": dict(sorted(plan.rule_counts.items())),
        "shards": shards,
        "tensors": tensors,
    }


# ---------------------------------------------------------------------------------------- the run


def _execute(src: Source, plan: Plan, out: Path, prep: Prepared, *, workers: int, keep_source: bool,
             progress: bool, direct_io: bool, device: torch.device) -> tuple[ShardWriter, dict, int]:
    from .pipeline import run_units
    from .writer import ShardWriter

    journal = prep.journal
    # Hashing threads: for source files (ahead of the conversion, which they also warm the page cache for), and
    # for output shards as they fill (so a digest is ready when its shard is).
    hash_pool = ThreadPoolExecutor(max_workers=hash_threads(), thread_name_prefix="sha256-out")
    source_pool = ThreadPoolExecutor(max_workers=hash_threads(), thread_name_prefix="sha256-src")
    hashes = SourceHashes(src, journal, source_pool)

    def shard_finished(name: str, size: int, future: Future) -> None:
        future.add_done_callback(lambda f: f.exception() is None and journal.add_shard(name, size, f.result()))

    writer = ShardWriter(out, plan.shards, hash_pool, done=prep.done, on_finish=shard_finished, direct_io=direct_io)
    run: list = []
    for unit in plan.units:
        if all(writer.is_done(o.name) for o in unit.outputs) and unit.key in journal.units:
            restore_unit(unit, journal.units[unit.key])
        else:
            run.append(unit)
    needs = [sorted({src.tensors[n].file for n in u.sources}) for u in run]
    todo = sum(o.nbytes for u in run for o in u.outputs)
    bar = tqdm(total=todo, unit="B", unit_scale=True, unit_divisor=1000, desc="convert", disable=not progress,
               smoothing=0.1)
    stager = Stager(src, needs, ahead=None if keep_source else STAGED_AHEAD, threads=2,
                    on_fetched=hashes.start, before_release=hashes.wait)

    def unit_done(i: int, unit) -> None:
        journal.add_unit(unit.key, unit_results(unit))
        writer.written([o.name for o in unit.outputs])
        stager.done(i)

    try:
        run_units(src, run, writer, stager, workers=workers, device=device, unit_done=unit_done, tick=bar.update)
        with stage("wait:shards"):
            writer.close()
        with stage("wait:source-hash"):
            source_files = hashes.result()
        with stage("wait:output-hash"):
            for name in writer.names:
                writer.hashes[name].result()
    except BaseException:
        writer.abort()
        raise
    finally:
        stager.stop()
        bar.close()
        source_pool.shutdown(wait=True, cancel_futures=True)
        hash_pool.shutdown(wait=True)
    return writer, source_files, len(prep.done)


def _after_refusal(out: Path, journal: Journal, exc: ConvertError) -> None:
    """Leave ``out`` so that the next run knows what to do, and say it: finished shards stay for ``--resume``;
    with none, the journal goes too (nothing to resume), so the same command simply runs again."""
    if journal.shards:
        exc.add_hint(f"{out} keeps {len(journal.shards)} finished shards and the progress journal: once the cause is "
                     "fixed, run the same command with --resume to continue (if the fix changes the source files, "
                     f"--resume refuses them: then remove {out} to start over).")
        return
    journal.remove()
    shutil.rmtree(out / STAGING_DIR, ignore_errors=True)
    exc.add_hint(f"Nothing was kept in {out}: run the same command again once the cause is fixed.")


def _finish(src: Source, plan: Plan, out: Path, writer: ShardWriter, source_files: dict, journal: Journal) -> dict:
    """Copy the non-tensor files, write the manifest, then the index (the completion marker); drop the journal."""
    manifest = build_manifest(src, plan, writer, source_files)
    try:
        text = json.dumps(manifest, indent=1, allow_nan=False)
    except ValueError as exc:
        raise ConvertError(f"{out}: the manifest would hold a non-finite number ({exc}); a value check missed a "
                           "corrupt source value. Nothing complete was written; report this.") from None
    try:
        write_extra_files(src, out, plan)
        write_atomic(out / MANIFEST_FILE, text.encode())
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {o.name: writer.names[writer.where[o.name][0]] for o in plan.outputs}}
        write_atomic(out / INDEX_FILE, json.dumps(index, indent=2).encode())
    except OSError as exc:
        raise OutputError(f"{exc.filename or out}: cannot write ({exc.strerror or exc}). Every shard is finished and "
                          f"kept: fix the cause and run the same command with --resume to finish {out}.",
                          path=exc.filename or out) from None
    journal.remove()
    shutil.rmtree(out / STAGING_DIR, ignore_errors=True)
    return manifest


def convert_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *, dense: str = DEFAULT_DENSE,
                       target: str = "sm100", shard_size: int = DEFAULT_SHARD_SIZE, dry_run: bool = False,
                       progress: bool = True, on_plan: Callable[[Plan], None] | None = None,
                       revision: str | None = None,
                       resume: bool = False, keep_source: bool = True, workers: int = DEFAULT_WORKERS,
                       cache_dir: str | os.PathLike | None = None, direct_io: bool = True,
                       device: str | torch.device = "cpu") -> ConvertResult:
    """Convert a DeepSeek-V4 checkpoint (a folder, or a Hub repo id ``owner/name``) to format 1 in ``out``.

    ``dense``: ``"keep"`` passes the dense FP8 linears through as the source has them, ``"nvfp4"`` requantises them
    (``docs/cli.md`` says what each costs). ``target``: ``"sm100"`` (format 1's canonical layout) or ``"sm90"``
    (routed experts' packed weights in Hopper row tiles, ``kernels/row_tiles.py``). Everything is validated
    (headers, index, rule matching, siblings, shapes) before the output folder is created; tensor values (NaN/Inf, NaN scale bytes) are checked as they are read.
    ``resume`` continues an interrupted run in ``out`` (refusing one made from another source or
    options); ``keep_source=False`` deletes each downloaded Hub shard once converted; ``workers``
    threads convert the plan's pieces in parallel (default: one per CPU; the bytes written do not depend on it);
    ``direct_io`` writes the shards with ``O_DIRECT`` where the file system allows it, bypassing the page cache
    (same bytes); ``device="cuda"`` runs the FP8 -> NVFP4 requantisation and the MXFP4 -> NVFP4 cast on a GPU
    (same bytes as on the CPU). ``ConvertResult.timings`` says where the run's time went. Raises
    :class:`~nvfp4_megamoe.convert.errors.ConvertError` subclasses whose messages name the tensor
    or file. With ``dry_run`` only the plan is made (no shard is downloaded).
    """
    out = Path(out)
    timing.begin_run()
    with phase("open-source"):
        src = open_source(source, revision=revision, cache_dir=cache_dir,
                          staging_dir=None if keep_source else out / STAGING_DIR, progress=progress)
    try:
        options = Options(dense=dense, shard_size=shard_size, target=target)
        with phase("check-output"):
            finished = None if dry_run else check_output(out, src, options, resume)
        with phase("import-torch"):  # the plan's units are torch code: torch from here on
            from .pipeline import conversion_device, threads_for_run
        with phase("plan"):
            plan = make_plan(src, options)
        if on_plan is not None:
            on_plan(plan)
        if dry_run:
            return ConvertResult(out, plan, {})
        if finished is not None:
            return ConvertResult(out, plan, finished, skipped_shards=len(plan.shards))
        run_device = conversion_device(device)  # refused (no GPU) before anything is written
        with phase("prepare-output"):
            prep = prepare_output(out, src, plan, resume)
        timing.start()
        try:
            with threads_for_run():
                writer, source_files, skipped = _execute(src, plan, out, prep, workers=workers,
                                                         keep_source=keep_source, progress=progress,
                                                         direct_io=direct_io, device=run_device)
        except ConvertError as exc:
            _after_refusal(out, prep.journal, exc)
            raise
        with stage("finish"):
            manifest = _finish(src, plan, out, writer, source_files, prep.journal)
        return ConvertResult(out, plan, manifest, skipped_shards=skipped, timings=timing.report())
    finally:
        src.close()
