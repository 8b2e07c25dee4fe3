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
* ``read(name)`` / ``fd_and_range(name)``: tensor data, thread-safe. ``read`` refuses values a
  checkpoint cannot hold (NaN/Inf floats, NaN E4M3 bytes, the E8M0 NaN byte 0xFF), naming the
  tensor and its file.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from .errors import SourceError
from .safetensors_header import DTYPES, Header, TensorInfo, read_header

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
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or name.startswith("~"):
        raise SourceError(f"{where} names the file {name!r}, which is outside the checkpoint folder; "
                          "refusing to read it. Fix the index so every file is a plain name inside the folder.")
    return name


def weight_map_from_index(index: dict, where: str) -> dict[str, str]:
    """The validated ``weight_map`` of an index.json (tensor -> relative shard file)."""
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise SourceError(f"{where}: no 'weight_map' object; this is not a safetensors index")
    return {str(t): check_relative_file(str(f), f"{where} (tensor {t!r})") for t, f in wm.items()}


def locate_tensors(weight_map: dict[str, str], headers: dict[str, Header], where: str) -> dict[str, SourceTensor]:
    """Cross-check an index against the shard headers: both must name the same tensors."""
    tensors: dict[str, SourceTensor] = {}
    problems: list[str] = []
    for name, file in weight_map.items():
        info = headers[file].tensors.get(name)
        if info is None:
            problems.append(f"{where} maps {name!r} to {file}, but that file has no such tensor")
        else:
            tensors[name] = SourceTensor(name, file, info)
    for file, header in headers.items():
        for name in header.tensors:
            if weight_map.get(name) != file:
                problems.append(f"{file} holds {name!r}, which the index "
                                + ("does not list" if name not in weight_map else f"maps to {weight_map[name]}"))
    if problems:
        raise SourceError(f"{where} and the shards disagree:\n  " + "\n  ".join(problems[:50]))
    return tensors


def read_json(path: Path, what: str) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: not valid JSON ({exc}); {what}") from None
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: expected a JSON object; {what}")
    return obj


# 8-bit float formats whose bytes of magnitude (byte & 0x7F) from this value up are NaN or Inf
# (E4M3fn: S.1111.111; E5M2: S.11111.xx). In E8M0 only the byte 0xFF is (NaN).
_NAN_MAGNITUDE = {"F8_E4M3": 0x7F, "F8_E5M2": 0x7C}


def _bad_values(t: torch.Tensor, dtype: str) -> torch.Tensor | None:
    """Boolean mask of values a checkpoint must not hold, or None when it holds none.

    8-bit formats are screened first by two max reductions, which need no temporaries and are
    exact: a positive byte of magnitude >= m is a signed byte >= m, a negative one an unsigned
    byte >= m | 0x80. The mask is formed only when something is there to report.
    """
    if dtype == "F8_E8M0":
        b = t.view(torch.uint8)
        return b == 0xFF if b.numel() and int(b.max()) == 0xFF else None
    if dtype in _NAN_MAGNITUDE:
        m, b = _NAN_MAGNITUDE[dtype], t.view(torch.uint8)
        if not b.numel() or (int(b.view(torch.int8).max()) < m and int(b.max()) < m | 0x80):
            return None
        return (b & 0x7F) >= m
    if dtype in ("F64", "F32", "F16", "BF16"):
        return ~torch.isfinite(t)
    return None


def check_values(name: str, file: str, dtype: str, t: torch.Tensor) -> None:
    """Refuse NaN/Inf floats and NaN 8-bit float codes (found while converting), naming the tensor."""
    bad = _bad_values(t, dtype)
    if bad is None or not bool(bad.any()):
        return
    flat = bad.reshape(-1)
    first = int(flat.nonzero()[0])
    what = {"F8_E8M0": "E8M0 scale bytes 0xFF (NaN)", "F8_E4M3": "E4M3 NaN bytes (0x7F/0xFF)",
            "F8_E5M2": "E5M2 Inf/NaN bytes"}.get(dtype, "NaN/Inf values")
    raise SourceError(f"{file}: tensor {name!r} ({dtype} {list(t.shape)}) holds {int(flat.sum())} {what}, the first "
                      f"at flat index {first}; expected finite values. The shard is corrupt (download or copy it "
                      "again); the conversion stopped and left no complete output.")


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
                    fd = self._fds[file] = os.open(self.file_path(file), os.O_RDONLY)
        return fd

    def _close_file(self, file: str) -> None:
        with self._fd_lock:
            fd = self._fds.pop(file, None)
            if fd is not None:
                os.close(fd)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, as its own dtype and shape, with its values checked.

        Read straight into the tensor's memory (``preadv``): no intermediate bytes objects.
        """
        t = self.tensors[name]
        buf = torch.empty(t.info.nbytes, dtype=torch.uint8)
        view, done, fd = memoryview(buf.numpy()), 0, self._fd(t.file)
        while done < t.info.nbytes:
            n = os.preadv(fd, [view[done:]], t.info.start + done)
            if n <= 0:
                raise SourceError(f"{t.file}: short read of tensor {name!r} ({done} of {t.info.nbytes} bytes); "
                                  "the file changed or is truncated. Copy or download it again.")
            done += n
        tensor = buf.view(DTYPES[t.info.dtype][0]).reshape(t.info.shape)
        check_values(name, t.file, t.info.dtype, tensor)
        return tensor

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
        if not self.root.is_dir():
            raise SourceError(f"{self.root}: no such folder. Give a checkpoint folder or a Hub repo id (owner/name).")
        config_path = self.root / "config.json"
        if not config_path.is_file():
            raise SourceError(f"{self.root}: no config.json; a DeepSeek-V4 checkpoint folder has one")
        self.config = read_json(config_path, "a DeepSeek-V4 checkpoint's config.json is a JSON object")
        index_path = self.root / INDEX_FILE
        if index_path.is_file():
            weight_map = weight_map_from_index(read_json(index_path, "the safetensors index is corrupt"), str(index_path))
        elif (self.root / SINGLE_FILE).is_file():
            weight_map = {n: SINGLE_FILE for n in read_header(self.root / SINGLE_FILE).tensors}
        else:
            raise SourceError(f"{self.root}: neither {INDEX_FILE} nor {SINGLE_FILE} found; not a safetensors checkpoint")
        self.files = sorted(set(weight_map.values()))
        missing = [f for f in self.files if not (self.root / f).is_file()]
        if missing:
            raise SourceError(f"{index_path}: names shard files that are missing from {self.root}: {', '.join(missing)}. "
                              "Download them again (a checkpoint with missing shards would silently lose tensors).")
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
