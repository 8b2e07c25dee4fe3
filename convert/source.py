"""Source checkpoints: where each tensor lives and how to read it, validated before use.

A source is a folder laid out as on the Hub: ``config.json``, ``model.safetensors.index.json``
(or a single ``model.safetensors``) and shards. :class:`LocalSource` reads one on disk; the Hub
source (``hub.py``) has the same surface and fetches shards as the plan needs them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from .errors import SourceError
from .safetensors_header import Header, TensorInfo, read_header, tensor_from_bytes

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


class LocalSource:
    """A checkpoint folder on local disk. All headers are read and validated on construction."""

    def __init__(self, path: str | Path):
        self.root = Path(path)
        if not self.root.is_dir():
            raise SourceError(f"{self.root}: no such folder. Give a checkpoint folder or a Hub repo id (owner/name).")
        self.config = self._read_config()
        index_path = self.root / INDEX_FILE
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except json.JSONDecodeError as exc:
                raise SourceError(f"{index_path}: not valid JSON ({exc})") from None
            weight_map = weight_map_from_index(index, str(index_path))
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
        self._fds: dict[str, int] = {}

    description = property(lambda self: str(self.root))

    def _read_config(self) -> dict:
        path = self.root / "config.json"
        if not path.is_file():
            raise SourceError(f"{self.root}: no config.json; a DeepSeek-V4 checkpoint folder has one")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}: not valid JSON ({exc})") from None

    def file_path(self, file: str) -> Path:
        """Local path of a source file (relative name as in the index)."""
        return self.root / file

    def extra_files(self) -> list[str]:
        """Non-tensor files present in the folder (config, tokenizer, ...)."""
        return sorted(p.name for p in self.root.iterdir() if p.is_file() and not p.name.endswith(".safetensors")
                      and p.name != INDEX_FILE)

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(self.file_path(file), os.O_RDONLY)
        return fd

    def read_bytes(self, name: str) -> bytes:
        """The raw bytes of one tensor."""
        t = self.tensors[name]
        data = os.pread(self._fd(t.file), t.info.nbytes, t.info.start)
        if len(data) != t.info.nbytes:
            raise SourceError(f"{t.file}: short read of tensor {name!r}; the file changed or is truncated")
        return data

    def read(self, name: str) -> torch.Tensor:
        """One tensor, as its own dtype and shape."""
        return tensor_from_bytes(self.read_bytes(name), self.tensors[name].info)

    def fd_and_range(self, name: str) -> tuple[int, int, int]:
        """(file descriptor, start offset, byte count) of a tensor, for zero-copy passthrough."""
        t = self.tensors[name]
        return self._fd(t.file), t.info.start, t.info.nbytes

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
