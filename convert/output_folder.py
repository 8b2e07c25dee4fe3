"""The output folder a conversion may write into, checked before the plan is made.

Only names, headers and JSON are read here (no torch), so the command line refuses a wrong folder in a fraction
of a second: one inside or holding the source, a file, a folder holding other files, a finished conversion (of
this source and options: accepted with ``--resume``; of others: the refusal says what differs), an unfinished one
without ``--resume``. What ``--resume`` then does with an unfinished run (its journal against the plan) is
``api.prepare_output``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nvfp4_megamoe.input_files import file_kind, inside, read_json_object
from nvfp4_megamoe.runtime.format import INDEX_FILE, MANIFEST_FILE

from .errors import ConvertError, OutputError, shown
from .options import Options
from .resume import JOURNAL_FILE, source_identity
from .source import LocalSource

if TYPE_CHECKING:
    from .hub import HubSource

    Source = LocalSource | HubSource


def check_places(out: Path, src: Source) -> None:
    """Refuse an output folder that is, or lies inside, the source folder, or holds it (the source is never
    modified, and a conversion must not mix with it)."""
    if not isinstance(src, LocalSource):
        return
    if inside(out, src.root):
        where = "is the source folder" if out.resolve() == src.root.resolve() else f"lies inside the source folder {src.root}"
        raise OutputError(f"{out}: the output folder {where}; choose a folder outside the source (the source is never "
                          "modified, and a checkpoint folder must not hold another).", path=out)
    if inside(src.root, out):
        raise OutputError(f"{out}: the output folder holds the source folder {src.root}; choose a folder outside it.",
                          path=out)


def _manifest_of(out: Path) -> dict | None:
    try:
        return read_json_object(out / MANIFEST_FILE, "", OutputError)
    except ConvertError:
        return None


def _where(identity: dict) -> str:
    return str(identity.get("path") or f"{identity.get('repo_id')}@{identity.get('revision')}")


def finished_differences(manifest: dict | None, src: Source, options: Options) -> list[str]:
    """What makes the finished conversion ``manifest`` describes another one than converting ``src`` with ``options``
    (empty when it is the same conversion)."""
    if manifest is None:
        return [f"its {MANIFEST_FILE} is missing or unreadable"]
    record = manifest.get("source")
    record = record if isinstance(record, dict) else {}
    theirs, ours = source_identity(record), source_identity(src.record())
    reasons = []
    if theirs != ours:
        reasons.append(f"another source ({shown(_where(theirs))}, this run converts {_where(ours)})")
    elif not isinstance(record.get("files"), dict) or record["files"].keys() != set(src.files):
        reasons.append("the source's shard files have changed since")
    if manifest.get("options_sha256") != options.digest():
        old = manifest.get("options")
        old = old if isinstance(old, dict) else {}
        changed = [f"--{k.replace('_', '-')} {shown(old.get(k))} there, {v} here" for k, v in options.as_dict().items()
                   if old.get(k) != v]
        reasons.append("other options (" + ("; ".join(changed) or "the recorded options do not match") + ")")
    return reasons


def check_output(out: Path, src: Source, options: Options, resume: bool) -> dict | None:
    """Refuse an output folder this conversion must not write into; returns the manifest of a finished conversion of
    the same source and options when ``resume`` accepts it as done, else None (``out`` is missing, empty, or holds
    an unfinished run that ``resume`` asks to continue)."""
    check_places(out, src)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder", path=out)
    if file_kind(out / INDEX_FILE) is not None:
        old = _manifest_of(out)
        reasons = finished_differences(old, src, options)
        if not reasons:
            if resume:
                return old
            raise OutputError(f"{out}: already holds a finished conversion of the same source and options. Choose "
                              "another folder, or remove it first (or pass --resume to accept it as done).", path=out)
        raise OutputError(f"{out}: already holds a finished conversion that differs from this one: "
                          + "; ".join(reasons) + ". Choose another folder, or remove it first.", path=out)
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if file_kind(out / JOURNAL_FILE) is None:
        if file_kind(out / MANIFEST_FILE) is not None:
            raise OutputError(f"{out}: already holds a conversion manifest. Choose another folder, or remove it "
                              "first.", path=out)
        hint = " (there is no progress journal, so there is nothing to resume)" if resume else ""
        raise OutputError(f"{out}: is not empty{hint}; refusing to mix a conversion with other files. "
                          "Choose an empty folder.", path=out)
    if not resume:
        raise OutputError(f"{out}: holds an unfinished conversion ({JOURNAL_FILE}). Run again with --resume to finish "
                          f"it; to start over, remove {out} or choose an empty folder.", path=out)
    return None
