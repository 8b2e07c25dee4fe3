"""Moving a checkpoint's tensors from its shard files to a GPU at the speed of the host's memory and PCIe link.

``safe_open(...).get_slice(name)[:]`` copies a tensor out of the shard's memory map in one thread, page fault by page
fault, and ``.to("cuda")`` then copies that pageable memory again through the driver's own staging buffers, waiting
for each copy: together most of a warm ``load_model``. Here a tensor bound for a GPU is one byte range of its shard
file (``Checkpoint.byte_range``), cut into chunks that a pool of threads reads with ``os.preadv`` straight into
pinned host buffers and copies to the tensor's device memory asynchronously, on a stream of their own, while the
next chunks are read. The file reads release the GIL, so the threads read from the page cache (or wait for the disk)
at once; each thread owns two pinned buffers, reading into one while the other is copied.

:meth:`GpuUploader.upload` returns the device tensor at once; :meth:`GpuUploader.finish` waits for every copy (and
raises what a reading thread raised, a file that shrank for one) and orders the caller's stream after them.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

CHUNK_BYTES = 16 << 20   # one read and one copy: large enough for a fast DMA, small enough to spread over threads
MAX_THREADS = 8          # reading threads (each with two pinned buffers of CHUNK_BYTES)


class GpuUploader:
    """Uploads byte ranges of files into new tensors on ``device`` (module docstring). Use as a context manager, or
    call :meth:`finish` (always, also after an error: it releases the threads)."""

    def __init__(self, device: torch.device, threads: int | None = None):
        self.device = device
        self.threads = max(1, min(MAX_THREADS, threads or os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpu-upload")
        self._stream = torch.cuda.Stream(device)
        self._local = threading.local()    # a thread's pinned buffers and their copy-done events
        self._fds: dict[Path, int] = {}
        self._pending: list[Future] = []
        self.bytes = 0

    def __enter__(self) -> GpuUploader:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def upload(self, path: Path, offset: int, nbytes: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on the device holding bytes ``[offset, offset + nbytes)`` of ``path`` as ``shape`` and
        ``dtype`` (the copy is in flight until :meth:`finish`)."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self.upload_into(out, path, offset)
        return out

    def upload_into(self, out: torch.Tensor, path: Path, offset: int) -> None:
        """Fill the contiguous device tensor ``out`` with its size in bytes of ``path`` from ``offset`` on."""
        if not out.is_contiguous():
            raise ValueError("upload_into needs a contiguous tensor")
        flat = out.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        fd = self._fds.get(path)
        if fd is None and nbytes:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        for a in range(0, nbytes, CHUNK_BYTES):
            b = min(a + CHUNK_BYTES, nbytes)
            self._pending.append(self._pool.submit(self._copy, path, fd, offset + a, flat[a:b]))
        self.bytes += nbytes

    def _copy(self, path: Path, fd: int, offset: int, dst: torch.Tensor) -> None:
        local = self._local
        if not hasattr(local, "buffers"):   # this thread's first chunk: its buffers, events and stream
            local.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            local.events = [torch.cuda.Event(), torch.cuda.Event()]
            local.used = [False, False]
            local.turn = 0
            torch.cuda.set_stream(self._stream)   # this thread's current stream (per thread): the copies go there
        i = local.turn
        local.turn ^= 1
        if local.used[i]:
            local.events[i].synchronize()   # this buffer's previous copy has left it
        n = dst.numel()
        view = memoryview(local.buffers[i].numpy())[:n]
        done = 0
        while done < n:  # a short read (a signal, a network file system) goes on where it stopped
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{path}: the file ended {n - done} bytes early at offset {offset + done} "
                              "(it shrank after it was opened)")
            done += got
        dst.copy_(local.buffers[i][:n], non_blocking=True)
        local.events[i].record(self._stream)
        local.used[i] = True

    def finish(self) -> None:
        """Wait for every upload; the caller's current stream is then ordered after them. Raises the first error."""
        try:
            for job in self._pending:
                job.result()
        finally:
            for job in self._pending:
                job.cancel()
            self._pending = []
            self._pool.shutdown(wait=True)
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._stream.synchronize()   # the pinned buffers go back to torch's cache: no copy may still read them
