"""Source checkpoints: where each tensor lives and how to read it, validated before use.

A source is a folder laid out as on the Hub: ``config.json``, ``model.safetensors.index.json``
(or a single ``model.safetensors``) and shards. :class:`LocalSource` reads one on disk; the Hub
source (``hub.py``) has the same surface and fetches shards as the plan needs them.

The surface the converter uses (both sources):

* ``config``, ``tensors`` (name -> :class:`SourceTensor`), ``files`` (shard files, sorted),
  ``headers`` (file -> validated header), ``description``;
* ``record()``: what the manifest says about the source (kind, path or repo + commit);
* ``file_size(f)``, ``known_sha256(f)`` (the Hub's LFS sha256, or None when it must be computed),
  ``stamp(f)`` (what ``--resume`` compares to see that a local file did not change);
* ``fetch(f)`` (make a shard readable: a no-op locally, a pinned download from the Hub) and
  ``release(f)`` (a shard is no longer needed: the Hub source may delete its download);
* ``read(name)`` / ``read_piece(name, at, count)`` / ``fd_and_range(name)``: tensor data, thread-safe.
  ``read`` refuses values a checkpoint cannot hold (NaN/Inf floats, NaN E4M3 bytes, the E8M0 NaN byte
  0xFF, block scales whose products overflow float32), naming the tensor and its file; ``read_piece``
  (a tensor read in pieces, on several threads) returns what the piece holds for the caller to refuse.

Every file is opened as a regular file only (``nvfp4_megamoe.input_files``): a FIFO or device in a
checkpoint folder is reported as such, never read (a read could block forever).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from nvfp4_megamoe.input_files import file_kind, folder_problem, not_regular, open_regular, read_json_object

from .errors import SourceError, shown
from .safetensors_header import DTYPES, Header, TensorInfo, read_header, torch_dtype
from .timing import stage

if TYPE_CHECKING:
    import torch

    from .value_screen import ValueScreen

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the source: its name, the shard file (relative) holding it, and its header entry."""

    name: str
    file: str
    info: TensorInfo


def check_relative_file(name: str, where: str) -> str:
    """Reject file names that would escape the checkpoint folder (absolute, ``..``, backslashes)."""
    p = PurePosixPath(name)
    if (not name or p.is_absolute() or ".." in p.parts or "\\" in name or name.startswith("~")
            or not name.isprintable()):
        raise SourceError(f"{where} names the file {name!r}, which is outside the checkpoint folder; "
                          "refusing to read it. Fix the index so every file is a plain name inside the folder.")
    return name


def weight_map_from_index(index: dict, where: str) -> dict[str, str]:
    """The validated ``weight_map`` of an index.json (tensor -> relative shard file)."""
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise SourceError(f"{where}: no 'weight_map' object; this is not a safetensors index")
    bad = next(((t, f) for t, f in wm.items() if not isinstance(f, str)), None)
    if bad is not None:
        raise SourceError(f"{where}: weight_map maps tensor {bad[0]!r} to {bad[1]!r}, which is not a file name; "
                          "the index is corrupt")
    return {t: check_relative_file(f, f"{where} (tensor {t!r})") for t, f in wm.items()}


def locate_tensors(weight_map: dict[str, str], headers: dict[str, Header], where: str) -> dict[str, SourceTensor]:
    """Cross-check an index against the shard headers: both must name the same tensors."""
    tensors: dict[str, SourceTensor] = {}
    problems: list[str] = []
    for name, file in weight_map.items():
        info = headers[file].tensors.get(name)
        if info is None:
            problems.append(f"{where} maps {name!r} to {shown(file)}, but that file has no such tensor")
        else:
            tensors[name] = SourceTensor(name, file, info)
    for file, header in headers.items():
        for name in header.tensors:
            if weight_map.get(name) != file:
                problems.append(f"{shown(file)} holds {name!r}, which the index "
                                + ("does not list" if name not in weight_map else f"maps to {shown(weight_map[name])}"))
    if problems:
        raise SourceError(f"{where} and the shards disagree:\n  " + "\n  ".join(problems[:50]))
    return tensors


def read_json(path: Path, what: str) -> dict:
    """A source JSON file that must hold an object (strict: no duplicate keys, regular files only)."""
    return read_json_object(path, what, SourceError)


# The largest magnitude an element of each block-scaled weight format holds (the scales multiply it).
E2M1_MAX, E4M3_MAX = 6.0, 448.0


class FileReader:
    """Tensor reads from local shard files, thread-safe (``pread`` on shared descriptors)."""

    tensors: dict[str, SourceTensor]

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()

    def file_path(self, file: str) -> Path:  # pragma: no cover - overridden
        raise NotImplementedError

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = open_regular(self.file_path(file), SourceError)
        return fd

    def _close_file(self, file: str) -> None:
        with self._fd_lock:
            fd = self._fds.pop(file, None)
            if fd is not None:
                os.close(fd)

    def _pread_into(self, t: SourceTensor, buf: torch.Tensor, at: int) -> None:
        """Fill ``buf`` (uint8) with the tensor's bytes from ``at`` on, straight into its memory (``preadv``)."""
        view, done, fd = memoryview(buf.numpy()), 0, self._fd(t.file)
        with stage("read"):
            while done < buf.numel():
                try:
                    n = os.preadv(fd, [view[done:]], t.info.start + at + done)
                except OSError as exc:
                    raise SourceError(f"{shown(t.file)}: cannot read tensor {shown(t.name)} ({exc.strerror})",
                                      path=t.file, tensor=t.name) from None
                if n <= 0:
                    raise SourceError(f"{shown(t.file)}: short read of tensor {shown(t.name)} ({at + done} of "
                                      f"{t.info.nbytes} bytes); the file changed or is truncated. Copy or download "
                                      "it again.", path=t.file, tensor=t.name)
                done += n

    def read(self, name: str, element_max: float | None = None) -> torch.Tensor:
        """One tensor, as its own dtype and shape, with its values checked (``element_max``: it holds block
        scales of elements up to that magnitude, ``value_screen.ValueScreen``)."""
        import torch

        from .value_screen import check_values

        t = self.tensors[name]
        buf = torch.empty(t.info.nbytes, dtype=torch.uint8)
        self._pread_into(t, buf, 0)
        tensor = buf.view(torch_dtype(t.info.dtype)).reshape(t.info.shape)
        with stage("check"):
            check_values(name, t.file, t.info.dtype, tensor, element_max)
        return tensor

    def read_piece(self, name: str, at: int, count: int, *, element_max: float | None = None,
                   index_limit: int | None = None) -> tuple[torch.Tensor, ValueScreen]:
        """Bytes ``[at, at + count)`` of a tensor (uint8; whole elements), and what their values hold: a
        ``value_screen.ValueScreen`` not yet finished (a tensor read in pieces merges its pieces' screens first)."""
        import torch

        from .value_screen import ValueScreen

        t = self.tensors[name]
        dtype, size = torch_dtype(t.info.dtype), DTYPES[t.info.dtype][1]
        buf = torch.empty(count, dtype=torch.uint8)
        self._pread_into(t, buf, at)
        screen = ValueScreen(name, t.file, t.info.dtype, t.info.shape, element_max=element_max,
                             index_limit=index_limit)
        with stage("check"):
            screen.update(buf.view(dtype), at // size)
        return buf, screen

    def fd_and_range(self, name: str) -> tuple[int, int, int]:
        """(file descriptor, start offset, byte count) of a tensor, for zero-copy passthrough."""
        t = self.tensors[name]
        return self._fd(t.file), t.info.start, t.info.nbytes

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class LocalSource(FileReader):
    """A checkpoint folder on local disk. All headers are read and validated on construction."""

    kind = "local"

    def __init__(self, path: str | Path):
        super().__init__()
        self.root = Path(path)
        problem = folder_problem(self.root)
        if problem is not None:
            raise SourceError(f"{self.root}: {problem}. Give a checkpoint folder or a Hub repo id (owner/name).",
                              path=self.root)
        config_path = self.root / "config.json"
        if file_kind(config_path) is None:
            raise SourceError(f"{self.root}: no config.json; a DeepSeek-V4 checkpoint folder has one", path=config_path)
        self.config = read_json(config_path, "a DeepSeek-V4 checkpoint's config.json is a JSON object")
        index_path = self.root / INDEX_FILE
        if file_kind(index_path) is not None:
            weight_map = weight_map_from_index(read_json(index_path, "the safetensors index is corrupt"), str(index_path))
        elif file_kind(self.root / SINGLE_FILE) is not None:
            weight_map = {n: SINGLE_FILE for n in read_header(self.root / SINGLE_FILE).tensors}
        else:
            raise SourceError(f"{self.root}: neither {INDEX_FILE} nor {SINGLE_FILE} found; not a safetensors checkpoint")
        self.files = sorted(set(weight_map.values()))
        kinds = {f: file_kind(self.root / f) for f in self.files}
        missing = [shown(f) for f, kind in kinds.items() if kind is None]
        if missing:
            raise SourceError(f"{index_path}: names shard files that are missing from {self.root}: {', '.join(missing)}. "
                              "Download them again (a checkpoint with missing shards would silently lose tensors).")
        odd = next((f for f, kind in kinds.items() if kind != "a regular file"), None)
        if odd is not None:
            raise not_regular(self.root / odd, kinds[odd], SourceError)
        self.headers = {f: read_header(self.root / f) for f in self.files}
        self.tensors = locate_tensors(weight_map, self.headers, str(index_path))

    description = property(lambda self: str(self.root))

    def record(self) -> dict:
        return {"kind": "local", "path": str(self.root.resolve())}

    def file_path(self, file: str) -> Path:
        """Local path of a source file (relative name as in the index)."""
        return self.root / file

    def file_size(self, file: str) -> int:
        return self.headers[file].file_size

    def known_sha256(self, file: str) -> str | None:
        return None

    def stamp(self, file: str) -> dict:
        st = os.stat(self.file_path(file))
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def fetch(self, file: str) -> None:
        """Local files are always there (and were validated on construction)."""

    def release(self, file: str) -> None:
        """Local files are never removed."""

    def extra_files(self) -> list[str]:
        """Non-tensor files present in the folder (config, tokenizer, ...)."""
        return sorted(p.name for p in self.root.iterdir() if p.is_file() and not p.name.endswith(".safetensors")
                      and p.name != INDEX_FILE)

    def extra_file_path(self, name: str) -> Path:
        return self.root / name
