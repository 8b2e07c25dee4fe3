"""Reading input files without blocking on them and without trusting their JSON.

A file is opened with ``O_NONBLOCK`` and checked with ``fstat`` to be a regular file before a byte is
read: opening a FIFO for reading would otherwise wait for a writer forever, and a folder, device or
socket is not a checkpoint file. The check is made on the open descriptor, so a path swapped after a
``stat`` cannot slip through. JSON is parsed strictly: a duplicate key (which ``json`` resolves
silently to its last value) and the non-standard constants ``NaN``, ``Infinity`` and ``-Infinity`` are
refused.

Every function raises ``error`` (a :class:`~nvfp4_megamoe.errors.Nvfp4MegamoeError` subclass the
caller picks) with a message naming the path.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from nvfp4_megamoe.errors import Nvfp4MegamoeError, NotRegularFileError

PathLike = str | os.PathLike
ErrorType = type[Nvfp4MegamoeError]

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_kind(path: PathLike) -> str | None:
    """None when nothing is at ``path`` (symbolic links followed), else what is there (:func:`kind_of`)."""
    try:
        return kind_of(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: a parent is a file
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def folder_problem(path: PathLike) -> str | None:
    """None when ``path`` is a folder (symbolic links followed), else what is wrong, in words: "no such folder",
    "is a regular file, not a folder"."""
    kind = file_kind(path)
    if kind == "a folder":
        return None
    return "no such folder" if kind is None else f"is {kind}, not a folder"


def not_regular(path: PathLike, kind: str, error: ErrorType = NotRegularFileError) -> Nvfp4MegamoeError:
    """The error for ``path`` being ``kind`` where a regular file is needed."""
    return error(f"{path}: is {kind}, not a regular file; refusing to read it (a FIFO or device could block "
                 "forever). Replace it with the real file.", path=path)


def open_regular(path: PathLike, error: ErrorType = NotRegularFileError) -> int:
    """A read-only descriptor of the regular file at ``path`` (never blocks on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{path}: no such file", path=path) from None
    except OSError as exc:
        kind = file_kind(path)
        if kind not in (None, "a regular file") and not kind.startswith("unreadable"):
            raise not_regular(path, kind, error) from None
        raise error(f"{path}: cannot be opened ({exc.strerror})", path=path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, kind_of(mode), error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: PathLike, error: ErrorType = NotRegularFileError) -> bytes:
    """The bytes of the regular file at ``path``."""
    fd = open_regular(path, error)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror})", path=path) from None
    finally:
        os.close(fd)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str | bytes) -> object:
    """``json.loads`` that refuses duplicate keys and NaN/Infinity (raises ``ValueError`` saying which)."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def read_json(path: PathLike, what: str, error: ErrorType = NotRegularFileError) -> object:
    """The strictly parsed JSON of the regular file at ``path``; ``what`` ends the message of a bad one
    (what the file should be)."""
    raw = read_regular(path, error)
    try:
        return loads_strict(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{path}: not valid JSON ({exc}); {what}", path=path) from None


def read_json_object(path: PathLike, what: str, error: ErrorType = NotRegularFileError) -> dict:
    """:func:`read_json` for a file that must hold a JSON object."""
    obj = read_json(path, what, error)
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, found {type(obj).__name__}; {what}", path=path)
    return obj


def inside(path: PathLike, folder: PathLike) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (both resolved: symbolic links and ``..`` followed)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents
