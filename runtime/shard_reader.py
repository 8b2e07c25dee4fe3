"""Reading tensors' bytes from a safetensors shard with positional reads in parallel threads.

``safe_open(...).get_slice(name)[:]`` copies a tensor out of the shard's memory map in one thread, page fault by
page fault: about 1 GB/s, which made reading the weights most of a warm ``load_model``. Here each tensor (or a range
of its rows) is one byte range of the file, read with ``os.preadv`` straight into the tensor's memory, in chunks
that a thread pool reads side by side (the call releases the GIL, so the threads copy from the page cache, or
wait for the disk, at once).

The shard's header says where each tensor's bytes are; :class:`ShardReader` takes it from a shard that
``safe_open`` has already accepted (its offsets checked against the file), so only the header's JSON is parsed here.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# safetensors dtype names -> torch dtypes (those a format-1 checkpoint can hold, and the plain ones)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
CHUNK_BYTES = 32 << 20   # one thread's read: large enough for few syscalls, small enough to spread a tensor out
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="shard-read")
    return _POOL


class ShardReader:
    """The tensors of one shard, read by byte range (module docstring). Opened once; the file stays open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        header = json.loads(os.pread(self._fd, length, 8))
        self._data = 8 + length
        self._entries = {name: e for name, e in header.items() if name != "__metadata__"}

    def close(self) -> None:
        os.close(self._fd)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` as stored, or rows ``[start, stop)`` of its first dimension (the caller checked them)."""
        entry = self._entries[name]
        shape, dtype = list(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if rows is not None:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        out = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            self._read_into(out, self._data + begin)
        return out.view(dtype).reshape(shape)

    def _read_into(self, out: torch.Tensor, offset: int) -> None:
        view = memoryview(out.numpy())
        n = len(view)
        chunks = [(i, min(i + CHUNK_BYTES, n)) for i in range(0, n, CHUNK_BYTES)]
        if len(chunks) == 1:
            self._read_range(view, offset, 0, n)
            return
        for done in [_pool().submit(self._read_range, view, offset, a, b) for a, b in chunks]:
            done.result()

    def _read_range(self, view: memoryview, offset: int, a: int, b: int) -> None:
        while a < b:  # a short read (a signal, a network file system) goes on where it stopped
            got = os.preadv(self._fd, [view[a:b]], offset + a)
            if got <= 0:
                raise OSError(f"{self.path}: the file ended {b - a} bytes early at offset {offset + a} "
                              "(it shrank after it was opened)")
            a += got

