"""Reading a format-1 checkpoint: manifest, index, shard headers and partial tensor reads.

:class:`Checkpoint` trusts the converter's layout (no conversion happens at load) but checks what
it relies on: the manifest's format and version, that every shard the index names exists and
carries the format-1 header metadata, and (optionally) the shards' sha256 against the manifest.
Tensors are read with ``safe_open(...).get_slice`` so that a caller asking for a range of
experts gets only those rows' bytes; :attr:`Checkpoint.bytes_read` counts what was materialised. A tensor bound for
a GPU is instead located as a byte range of its shard (:meth:`Checkpoint.byte_range`, from the header that
``safe_open`` accepted), which ``gpu_upload`` reads into pinned memory.

What the folder says is input: the index and manifest are read strictly (``input_files``), every
shard file they name must be a format-1 shard name (so no path leads outside the folder) and a
regular file (a FIFO would block the reader).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nvfp4_megamoe.errors import shown
from nvfp4_megamoe.input_files import file_kind, not_regular, open_regular, read_json_object

from .format import FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, FormatError, check_shard_name, read_manifest


# safetensors dtype names -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


@dataclass(frozen=True)
class ByteRange:
    """Where a tensor's bytes (or a range of its rows) lie in its shard file, and what they are."""

    path: Path
    offset: int
    nbytes: int
    shape: list[int]
    dtype: torch.dtype


class Checkpoint:
    """A converted checkpoint folder opened for reading (shards opened lazily, once)."""

    def __init__(self, path: str | Path, *, verify_hashes: bool = False):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FormatError(f"{self.path}: not a directory")
        self.manifest = read_manifest(self.path)
        index_file = self.path / INDEX_FILE
        if file_kind(index_file) is None:
            raise FormatError(f"{index_file}: missing; the checkpoint is incomplete (re-run the conversion)")
        weight_map = read_json_object(index_file, "the index is corrupt; convert again", FormatError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise FormatError(f"{index_file}: no 'weight_map' object; the index is corrupt (convert again)")
        self.weight_map: dict[str, str] = {t: check_shard_name(f, f"{index_file} (tensor {t!r})")
                                           for t, f in weight_map.items()}
        for shard in sorted(set(self.weight_map.values())):
            kind = file_kind(self.path / shard)
            if kind is None:
                raise FormatError(f"{self.path / shard}: shard named by {INDEX_FILE} is missing")
            if kind != "a regular file":
                raise not_regular(self.path / shard, kind, FormatError)
        if verify_hashes:
            self.verify_hashes()
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}   # shard -> (its data's offset, its header's entries)
        self.bytes_read = 0

    # -- shard access -------------------------------------------------------------------------
    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            try:
                handle = safe_open(str(self.path / shard), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise FormatError(f"{self.path / shard}: the shard cannot be read as safetensors ({exc}); it is "
                                  "corrupt or truncated: copy it again, or convert again.", path=self.path / shard) from None
            meta = handle.metadata() or {}
            if meta.get("nvfp4_format") != FORMAT_NAME or meta.get("nvfp4_format_version") != str(FORMAT_VERSION):
                raise FormatError(f"{self.path / shard}: header metadata {meta} is not {FORMAT_NAME} "
                                  f"version {FORMAT_VERSION}; re-convert or upgrade nvfp4-megamoe")
            held = set(handle.keys())
            absent = sorted(t for t, f in self.weight_map.items() if f == shard and t not in held)
            if absent:
                raise FormatError(f"{self.path / shard}: holds no tensor {shown(absent[0])!r}, which {INDEX_FILE} maps "
                                  f"to it ({len(absent)} such); the index and the shard disagree: convert again.",
                                  path=self.path / shard, tensor=absent[0])
            self._handles[shard] = handle
        return handle

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _shard_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise FormatError(f"{self.path}: tensor {name!r} is not in {INDEX_FILE}") from None

    def shape(self, name: str) -> list[int]:
        return list(self._open(self._shard_of(name)).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._open(self._shard_of(name)).get_slice(name).get_dtype()

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or only rows ``[start, stop)`` of its first dimension), as stored."""
        view = self._open(self._shard_of(name)).get_slice(name)
        if rows is None:
            tensor = view[:] if view.get_shape() else self._open(self._shard_of(name)).get_tensor(name)
        else:
            self._rows(name, rows, view.get_shape())
            tensor = view[rows[0]:rows[1]]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _rows(self, name: str, rows: tuple[int, int] | None, shape: list[int]) -> list[int]:
        """The shape of ``rows`` of tensor ``name`` (all of it for None), the range checked."""
        if rows is None:
            return list(shape)
        start, stop = rows
        n = shape[0] if shape else 0
        if not (0 <= start <= stop <= n):
            raise ValueError(f"{name}: rows [{start}, {stop}) outside its first dimension of {n}")
        return [stop - start, *shape[1:]]

    def byte_range(self, name: str, rows: tuple[int, int] | None = None) -> ByteRange:
        """Where tensor ``name`` (or its rows ``[start, stop)``) lies in its shard file (not counted in
        :attr:`bytes_read`: whoever reads the range counts it)."""
        shard = self._shard_of(name)
        self._open(shard)   # the header checks of safe_open, once
        if shard not in self._headers:
            with open(self.path / shard, "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
            self._headers[shard] = (8 + length, header)
        data, header = self._headers[shard]
        entry = header[name]
        shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
        part = self._rows(name, rows, shape)
        if rows is not None:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
        return ByteRange(self.path / shard, data + begin, end - begin, part, SAFETENSORS_DTYPES[entry["dtype"]])

    # -- integrity ----------------------------------------------------------------------------
    def verify_hashes(self) -> None:
        """Check every shard's size and sha256 against the manifest; raise :class:`FormatError` on mismatch."""
        shards = _manifest_shards(self.manifest)
        if not shards:
            raise FormatError(f"{self.path}: the manifest records no shard hashes to verify")
        for shard, record in shards.items():
            file = self.path / check_shard_name(shard, f"{self.path}/nvfp4_manifest.json")
            if file_kind(file) is None:
                raise FormatError(f"{file}: shard recorded in the manifest is missing")
            fd = open_regular(file, FormatError)
            size = record.get("size")
            digest = hashlib.sha256()
            with os.fdopen(fd, "rb") as fh:
                if size is not None and os.fstat(fd).st_size != size:
                    raise FormatError(f"{file}: size {os.fstat(fd).st_size} != {size} recorded in the manifest")
                for block in iter(lambda: fh.read(1 << 24), b""):
                    digest.update(block)
            if digest.hexdigest() != record.get("sha256"):
                raise FormatError(f"{file}: sha256 {digest.hexdigest()} does not match the manifest "
                                  f"({record.get('sha256')}); the file is corrupt or was modified")


def _manifest_shards(manifest: dict) -> dict[str, dict]:
    """The manifest's per-shard records as ``{file name: {"sha256": ..., "size": ...}}``."""
    shards = manifest.get("shards") or manifest.get("output_shards") or {}
    if isinstance(shards, list):
        shards = {s.get("name") or s.get("file"): s for s in shards}
    return dict(shards)
