"""Reading and validating safetensors headers before a byte of tensor data is trusted.

Goes beyond the safetensors crate's own rules: the header length is bounded, every tensor's
offsets lie inside the file, no two tensors overlap, each byte range matches its dtype and
shape, and the file is exactly as long as its header says (a truncated shard is caught here).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SourceError

MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype string -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
}
TORCH_TO_ST = {t: name for name, (t, _) in DTYPES.items()}


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
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"{path}: the safetensors header is not valid JSON ({exc}); the file is corrupt, "
                          "download it again") from None
    return header_from_object(obj, path, data_start, file_size)


def header_from_object(obj: object, path: str, data_start: int, file_size: int) -> Header:
    """Validate a decoded header (``{name: {dtype, shape, data_offsets}}``) whose data starts at ``data_start``.

    Used directly for headers read through ``huggingface_hub`` (which hands back the decoded JSON).
    """
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: the safetensors header must be a JSON object")
    obj = dict(obj)
    metadata = obj.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SourceError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}") from None
        if dtype not in DTYPES:
            raise SourceError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * DTYPES[dtype][1]
        if not (0 <= begin <= end) or end - begin != want:
            raise SourceError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) needs {want} bytes but its "
                              f"offsets [{begin}, {end}] give {end - begin}")
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    spans = sorted((t.start, t.end, n) for n, t in tensors.items() if t.nbytes)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SourceError(f"{path}: tensors {n0!r} and {n1!r} overlap in the file")
    end = max((t.end for t in tensors.values()), default=data_start)
    if end != file_size:
        what = "truncated" if file_size < end else "longer than its header says"
        raise SourceError(f"{path}: the file is {what}: the header says {end} bytes, the file has {file_size}. "
                          "Download or copy this shard again.")
    return Header(path, tensors, dict(metadata), data_start, file_size)


def read_header(path: str | Path) -> Header:
    """Read and validate the header of a local safetensors file."""
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceError(f"{path}: {size} bytes is too short for a safetensors file (needs an 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SourceError(f"{path}: header length {n} is larger than the file ({size} bytes) or the "
                              f"{MAX_HEADER_BYTES}-byte limit; the file is corrupt or truncated")
        raw = f.read(n)
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
    dtype = DTYPES[info.dtype][0]
    if not info.nbytes:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(info.shape)
