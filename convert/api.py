"""``convert_checkpoint``: the converter's Python entry point (the CLI is a thin layer over it)."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from nvfp4_megamoe import __version__
from nvfp4_megamoe.runtime.format import FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, MANIFEST_FILE

from .errors import OutputError
from .plan import DEFAULT_SHARD_SIZE, Options, Plan, make_plan
from .source import LocalSource
from .writer import ShardWriter, sha256_file

TARGET = {
    "layout": "blackwell-k-major",
    "fp4": "e2m1, two per byte, low nibble = even element",
    "block_scale": "e4m3 per 16 along K, 128x4 swizzle (rows padded to 128, scale columns to 4, zeros)",
    "global_scale": "float32 alpha, value = e2m1 * e4m3 * alpha",
    "gate_up_interleave": 8,
}


@dataclass
class ConvertResult:
    """What a conversion did."""

    out: Path
    plan: Plan
    manifest: dict


def open_source(source: str | os.PathLike) -> LocalSource:
    """A source from a local folder path."""
    return LocalSource(source)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename (never a half-written file)."""
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_output(out: Path, source_root: Path | None) -> None:
    """Create ``out``; refuse a folder that holds another conversion or anything else."""
    if source_root is not None and out.resolve() == source_root.resolve():
        raise OutputError(f"{out}: the output folder is the source folder; choose another (the source is never modified)")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{out}: exists and is not a folder")
        if (out / MANIFEST_FILE).exists() or (out / INDEX_FILE).exists():
            raise OutputError(f"{out}: already holds a conversion. Choose another folder, or remove it first.")
        if any(out.iterdir()):
            raise OutputError(f"{out}: is not empty; refusing to mix a conversion with other files. Choose an empty folder.")
    out.mkdir(parents=True, exist_ok=True)


def build_manifest(src: LocalSource, plan: Plan, writer: ShardWriter, source_hashes: dict) -> dict:
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
        "format_version": FORMAT_VERSION,
        "converter_version": __version__,
        "source": {"kind": "local", "path": str(src.root.resolve()),
                   "files": {f: {"size": os.path.getsize(src.file_path(f)), "sha256": h.result()}
                             for f, h in source_hashes.items()}},
        "options": plan.options.as_dict(),
        "options_sha256": plan.options.digest(),
        "target": TARGET,
        "rule_counts": dict(sorted(plan.rule_counts.items())),
        "shards": shards,
        "tensors": tensors,
    }


def convert_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *, dense: str = "nvfp4",
                       shard_size: int = DEFAULT_SHARD_SIZE, dry_run: bool = False,
                       progress: bool = True, on_plan: Callable[[Plan], None] | None = None) -> ConvertResult:
    """Convert a DeepSeek-V4 checkpoint folder to format 1 in ``out``.

    Everything is validated (headers, index, rule matching, siblings, shapes) before the output
    folder is created. Raises :class:`~nvfp4_megamoe.convert.errors.ConvertError` subclasses
    with messages that name the tensor or file. With ``dry_run`` only the plan is made.
    """
    src = open_source(source)
    out = Path(out)
    try:
        plan = make_plan(src, Options(dense=dense, shard_size=shard_size))
        if on_plan is not None:
            on_plan(plan)
        if dry_run:
            return ConvertResult(out, plan, {})
        prepare_output(out, getattr(src, "root", None))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as pool:
            source_hashes = {f: pool.submit(sha256_file, src.file_path(f)) for f in src.files}
            writer = ShardWriter(out, plan.shards, pool)
            bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="convert", disable=not progress)
            try:
                for unit in plan.units:
                    unit.run(src, writer, bar.update)
                    writer.written([o.name for o in unit.outputs])
            except BaseException:
                writer.abort()
                raise
            finally:
                bar.close()
            for name in src.extra_files():
                shutil.copyfile(src.file_path(name), out / name)
            manifest = build_manifest(src, plan, writer, source_hashes)
        write_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        index = {"metadata": {"total_size": plan.total_bytes},
                 "weight_map": {o.name: writer.names[writer.where[o.name][0]] for o in plan.outputs}}
        write_atomic(out / INDEX_FILE, json.dumps(index, indent=2).encode())
        return ConvertResult(out, plan, manifest)
    finally:
        src.close()
