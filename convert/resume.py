"""The progress journal that makes ``--resume`` safe.

An unfinished output folder holds ``.nvfp4_progress.json``, rewritten atomically (temporary
file, fsync, rename) each time a shard is finished. It records what the run was (source
identity and per-file size/sha256 or mtime, ``options_sha256``, the converter version and a
digest of the output layout) and what it finished: each shard's size and sha256, and each
completed unit's measured results (lossless flag, error statistics, notes) so that a resumed
run writes the same manifest as an uninterrupted one.

``--resume`` refuses a folder whose journal describes another run (different source commit or
file hashes, different options, another layout), re-hashes every finished shard and redoes any
that does not match. The journal is removed once the index (the completion marker) is written.

The journal is input like any other: before ``--resume`` acts on it (hashing, deleting or keeping a
shard), :func:`checked_progress` checks every entry: shard names must be this run's own shard file
names (nothing outside the folder can be named), sizes and digests of the right types, units and
their outputs the plan's. A journal that fails is refused as a whole and nothing is deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

from nvfp4_megamoe import __version__
from nvfp4_megamoe.input_files import file_kind, read_json_object
from nvfp4_megamoe.runtime.format import shard_name

from .errors import ConvertError, OutputError, shown
from .plan import Plan
from .timing import stage

JOURNAL_FILE = ".nvfp4_progress.json"
# 2: --target sm90 shards hold Hopper-order words; a journal of 1 may list shards of the first row-tile layout
JOURNAL_VERSION = 2


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename (never a half-written file)."""
    from .writer import fsync_dir  # the writer imports torch; the output-folder checks import this module

    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def source_identity(record: dict) -> dict:
    """What the output bytes depend on: the source (path, or repo + resolved commit), without the files
    (compared separately) or the endpoint (a mirror serves the same commit) or the branch name."""
    return {k: v for k, v in record.items() if k not in ("endpoint", "ref", "files")}


def layout_digest(plan: Plan) -> str:
    """Hash of the output layout: shard count and every tensor's name, dtype, shape, in order."""
    h = hashlib.sha256()
    for shard in plan.shards:
        h.update(b"|shard|")
        for o in shard:
            h.update(f"{o.name}:{o.dtype}:{list(o.shape)};".encode())
    return h.hexdigest()


def unit_results(unit) -> dict:
    """What running a unit measured, per output tensor (restored when a resumed run skips it)."""
    return {o.name: {"lossless": o.lossless, "error": o.error, "notes": o.notes} for o in unit.outputs}


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unit_record_problem(unit, results: object) -> str | None:
    """Why a journal's record of ``unit`` cannot be restored (not its outputs, or wrong types), or None."""
    if not isinstance(results, dict) or set(results) != {o.name for o in unit.outputs}:
        return "does not list this unit's outputs"
    for name, r in results.items():
        if (not isinstance(r, dict) or not isinstance(r.get("lossless"), bool) or not isinstance(r.get("notes"), dict)
                or not (r.get("error") is None or isinstance(r.get("error"), dict))):
            return f"has a malformed record of {shown(name)}"
    return None


def checked_progress(data: dict, path: Path, plan: Plan, source_files: list[str]) -> dict:
    """The journal's progress (``shards``, ``units``, ``source_sha256``) after checking every entry against this
    run; :class:`OutputError` naming the first bad one (nothing is deleted or trusted before this returns)."""
    names = {shard_name(i + 1, len(plan.shards)) for i in range(len(plan.shards))}
    units = {u.key: u for u in plan.units}
    progress = {k: data.get(k, {}) for k in ("shards", "units", "source_sha256")}

    def refuse(what: str) -> OutputError:
        return OutputError(f"{path}: the progress journal {what}; it was edited or is corrupt, so --resume cannot "
                           f"trust it. Nothing was deleted. To start over, remove {path.parent} (or choose another "
                           "folder) and convert again.", path=path)

    for key, value in progress.items():
        if not isinstance(value, dict):
            raise refuse(f"holds {type(value).__name__} under {key!r}, expected an object")
    for name, rec in progress["shards"].items():
        if name not in names:
            raise refuse(f"names the shard {shown(name)!r}, which is not one of this run's {len(names)} shard files")
        if not isinstance(rec, dict) or not _count(rec.get("size")) or not isinstance(rec.get("sha256"), str) \
                or not _SHA256.fullmatch(rec["sha256"]):
            raise refuse(f"has a malformed record of {name}: {rec!r}")
    for key, results in progress["units"].items():
        if key not in units:
            raise refuse(f"records a unit {shown(key)!r} that this run's plan does not have")
        why = _unit_record_problem(units[key], results)
        if why is not None:
            raise refuse(f"record of unit {key} {why}")
    for file, sha in progress["source_sha256"].items():
        if file not in source_files or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise refuse(f"has a malformed source hash entry {shown(file)!r}: {sha!r}")
    for name in progress["shards"]:
        kind = file_kind(path.parent / name)
        if kind not in (None, "a regular file"):
            raise OutputError(f"{path.parent / name}: is {kind}, not a regular file; --resume will not read or remove "
                              "it. Remove it yourself and run again with --resume.", path=path.parent / name)
    return progress


def restore_unit(unit, results: dict) -> None:
    for o in unit.outputs:
        r = results[o.name]
        o.lossless, o.error, o.notes = r["lossless"], r["error"], dict(r["notes"])


class Journal:
    """The run's identity and progress; thread-safe; saved atomically on every change that matters."""

    def __init__(self, out: Path, identity: dict):
        self.path = out / JOURNAL_FILE
        self.identity = identity
        self.shards: dict[str, dict] = {}
        self.units: dict[str, dict] = {}
        self.source_sha256: dict[str, str] = {}
        self.lock = threading.Lock()

    @staticmethod
    def identity_for(source_record: dict, source_files: dict, plan: Plan) -> dict:
        return {"journal_version": JOURNAL_VERSION, "converter_version": __version__,
                "source": source_identity(source_record),
                "source_files": source_files, "options": plan.options.as_dict(),
                "options_sha256": plan.options.digest(), "layout_sha256": layout_digest(plan)}

    def save(self) -> None:
        with self.lock:
            data = {"identity": self.identity, "source_sha256": dict(sorted(self.source_sha256.items())),
                    "shards": dict(sorted(self.shards.items())), "units": self.units}
            text = json.dumps(data, indent=1, allow_nan=False)  # key order kept: the manifest repeats it
            try:
                with stage("journal"):
                    write_atomic(self.path, text.encode())
            except OSError as exc:
                raise OutputError(f"{self.path}: cannot write the progress journal ({exc.strerror or exc})",
                                  path=self.path) from None

    def add_unit(self, key: str, results: dict) -> None:
        with self.lock:
            self.units[key] = results

    def add_shard(self, name: str, size: int, sha256: str) -> None:
        with self.lock:
            self.shards[name] = {"size": size, "sha256": sha256}
        self.save()

    def add_source_hash(self, file: str, sha256: str) -> None:
        with self.lock:
            self.source_sha256[file] = sha256

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    @classmethod
    def load(cls, out: Path) -> dict | None:
        """The journal in ``out`` (None when there is none); its entries are checked by :func:`checked_progress`."""
        path = out / JOURNAL_FILE
        if file_kind(path) is None:
            return None
        hint = "the folder cannot be resumed. Remove the folder (or choose another) and convert again."
        try:
            data = read_json_object(path, hint, OutputError)
        except ConvertError as exc:
            exc.args = (str(exc).replace(f"{path}: ", f"{path}: the progress journal is unreadable: ", 1),)
            raise
        if not isinstance(data.get("identity"), dict):
            raise OutputError(f"{path}: the progress journal has no 'identity' object; {hint}", path=path)
        return data


def identity_differences(old: dict, new: dict) -> list[str]:
    """Human-readable reasons why a journal's run is not this run (empty when it is)."""
    reasons = []
    if old.get("journal_version") != new["journal_version"] or old.get("converter_version") != new["converter_version"]:
        reasons.append(f"converter version {old.get('converter_version')} (journal {old.get('journal_version')}) vs "
                       f"{new['converter_version']} (journal {new['journal_version']})")
    if old.get("source") != new["source"]:
        reasons.append(f"source {old.get('source')} vs {new['source']}")
    if old.get("options_sha256") != new["options_sha256"]:
        reasons.append(f"options {old.get('options')} vs {new['options']} (options_sha256 differs)")
    if old.get("layout_sha256") != new["layout_sha256"]:
        reasons.append("the output layout (tensor names, shapes or shard split) differs")
    old_files, new_files = old.get("source_files"), new["source_files"]
    old_files = old_files if isinstance(old_files, dict) else {}
    changed = sorted(f for f in set(old_files) | set(new_files) if old_files.get(f) != new_files.get(f))
    if changed:
        listed = ", ".join(f"{shown(f)} ({old_files.get(f)} vs {new_files.get(f)})" for f in changed[:5])
        reasons.append(f"source files changed: {listed}" + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""))
    return reasons
