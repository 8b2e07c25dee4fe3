"""Reading and validating safetensors headers before a byte of tensor data is trusted.

One strict reading, which refuses at least everything ``safetensors.safe_open`` refuses, and more:

* the header length is at most :data:`MAX_HEADER_BYTES` (safetensors' own limit) and fits the file;
* the header is UTF-8 JSON holding one object, with no duplicate key at any level (``json`` would keep
  the last silently) and no ``NaN``/``Infinity``;
* ``__metadata__`` is absent, null or an object of strings;
* each tensor entry is an object with a known ``dtype`` string, a ``shape`` list of non-negative
  integers (not floats, strings or booleans) and ``data_offsets``, two non-negative integers whose
  span is exactly the bytes of its dtype and shape;
* the tensors tile the data section: in offset order each starts where the previous one ends, from 0
  to the end of the file, with no hole and no overlap (a truncated or padded shard is caught here).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nvfp4_megamoe.input_files import loads_strict, open_regular

from .errors import SourceError, shown

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE

# safetensors dtype string -> (name of the torch dtype, bytes per element). Names, not torch dtypes: reading and
# checking headers needs no torch (the command line answers before torch is imported); see :func:`torch_dtype`.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string (one of :data:`DTYPES`)."""
    import torch

    return getattr(torch, DTYPES[dtype][0])


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype string, shape, absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A validated safetensors header."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def parse_header(raw: bytes, path: str, file_size: int) -> Header:
    """Validate header bytes (JSON after the 8-byte length) against a file of ``file_size`` bytes."""
    data_start = 8 + len(raw)
    try:
        obj = loads_strict(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SourceError(f"{path}: the safetensors header is not valid JSON ({exc}); the file is corrupt, "
                          "download it again", path=path) from None
    return header_from_object(obj, path, data_start, file_size)


def _count(value: object) -> bool:
    """A JSON non-negative integer (``bool`` is an ``int`` in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(name: str, entry: object, path: str) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked."""
    def bad(what: str) -> SourceError:
        return SourceError(f"{path}: tensor {shown(name)} has a malformed header entry: {what}; the file is corrupt "
                           "(download or copy it again)", path=path, tensor=name)

    if not isinstance(entry, dict):
        raise bad(f"expected an object, found {type(entry).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise bad(f"no {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise bad(f"data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[dtype][1]
    if end < begin or end - begin != want:
        raise bad(f"{dtype} {shape} needs {want} bytes but data_offsets [{begin}, {end}] give {end - begin}")
    return dtype, tuple(shape), begin, end


def header_from_object(obj: object, path: str, data_start: int, file_size: int) -> Header:
    """Validate a decoded header (``{name: {dtype, shape, data_offsets}}``) whose data starts at ``data_start``.

    Used directly for headers read through ``huggingface_hub`` (which hands back the decoded JSON).
    """
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: the safetensors header must be a JSON object, found {type(obj).__name__}",
                          path=path)
    obj = dict(obj)
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SourceError(f"{path}: the header's __metadata__ must be an object of strings, found {metadata!r}; the "
                          "file is corrupt (download or copy it again)", path=path)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        dtype, shape, begin, end = _entry(name, entry, path)
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    position, previous = data_start, None
    for name, t in sorted(tensors.items(), key=lambda nt: (nt[1].start, nt[1].end)):
        if t.start != position:
            what = "a hole of" if t.start > position else "an overlap of"
            after = f"tensor {shown(previous)} ends" if previous is not None else "the data section starts"
            raise SourceError(f"{path}: tensor {shown(name)} starts at data byte {t.start - data_start} but {after} at "
                              f"{position - data_start} ({what} {abs(t.start - position)} bytes); safetensors tensors "
                              "must follow each other without gaps. The file is corrupt (download or copy it again).",
                              path=path, tensor=name)
        position, previous = t.end, name
    if position != file_size:
        what = "truncated" if file_size < position else "longer than its header says"
        raise SourceError(f"{path}: the file is {what}: the header says {position} bytes, the file has {file_size}. "
                          "Download or copy this shard again.", path=path)
    return Header(path, tensors, dict(metadata), data_start, file_size)


def read_header(path: str | Path) -> Header:
    """Read and validate the header of a local safetensors file (which must be a regular file)."""
    path = str(path)
    fd = open_regular(path, SourceError)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise SourceError(f"{path}: {size} bytes is too short for a safetensors file (needs an 8-byte header "
                              "length)", path=path)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SourceError(f"{path}: header length {n} is larger than the file ({size} bytes) or the "
                              f"{MAX_HEADER_BYTES}-byte limit; the file is corrupt or truncated", path=path)
        raw = os.pread(fd, n, 8)
    except OSError as exc:
        raise SourceError(f"{path}: cannot be read ({exc.strerror})", path=path) from None
    finally:
        os.close(fd)
    if len(raw) != n:
        raise SourceError(f"{path}: the file changed while its header was read; read it again", path=path)
    return parse_header(raw, path, size)


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Lay out a header for ``(name, dtype, shape, nbytes)`` entries in order.

    Returns the header bytes (length prefix, JSON padded with spaces to 8 bytes) and each
    tensor's absolute offset in the file.
    """
    obj: dict[str, object] = {"__metadata__": metadata}
    offset, rel = 0, []
    for name, dtype, shape, nbytes in entries:
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        rel.append(offset)
        offset += nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, [len(head) + r for r in rel]


def tensor_from_bytes(buf: bytes | bytearray | memoryview, info: TensorInfo) -> torch.Tensor:
    """Bytes of one tensor -> a torch tensor of its dtype and shape (owns its memory)."""
    import torch

    dtype = torch_dtype(info.dtype)
    if not info.nbytes:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(info.shape)
