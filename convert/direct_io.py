"""Output shards written and read back with ``O_DIRECT``: no page cache between the converter and the disk.

Why: filling page-cache pages can be most of a conversion's CPU time (``docs/design/conversion.md``: 15.9 s of
system time in an 18.8 s run on a 2-vCPU VM, where buffered ``pwrite`` of 4 GiB costs 3-10 s of CPU and
``O_DIRECT`` 0.04 s), and nothing reads a freshly converted shard from the cache.

``O_DIRECT`` moves whole aligned blocks between aligned memory and aligned file offsets; shard pieces
(header, tensors) are neither. A write is copied into an aligned bounce buffer: its whole blocks go to
disk on the file's I/O threads (the writer goes on converting; at most ``IN_FLIGHT`` buffers are out, and
a failed write is raised by the next call), its partial first and last blocks wait in memory
(:attr:`DirectFile.edges`) until the neighbouring pieces fill them. Every byte of a shard is written
exactly once, so every block fills; the file's last block is written whole and the file cut back to its
size by :meth:`DirectFile.close`. Reads (the shard's hash) take the blocks still waiting from memory and
the rest from disk.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .timing import stage

ALIGN = 4096  # a multiple of every logical block size O_DIRECT asks alignment to
BOUNCE = 8 << 20
# Writes on their way per file: on the 2-vCPU VM's virtio disk 4 threads and 8 buffers took a 2-worker conversion
# 8 % less time than 2 and 4 (three interleaved rounds each); 16 buffers gained nothing more.
IO_THREADS = 4
IN_FLIGHT = 8  # bounce buffers per file (the bytes a file may have on their way to disk: IN_FLIGHT * BOUNCE)


def open_direct(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int | None:
    """``os.open`` with ``O_DIRECT``, or None where the file system refuses it (tmpfs, some FUSE)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


class ThreadBuffer(threading.local):
    """One buffer of ``size`` bytes per thread, made on first use; page-aligned (an anonymous mapping)."""

    def __init__(self, size: int):
        self.size, self.view = size, None

    def get(self) -> memoryview:
        if self.view is None:
            self.view = memoryview(mmap.mmap(-1, self.size))
        return self.view


_read_buffers = (ThreadBuffer(BOUNCE), ThreadBuffer(BOUNCE))  # the chunk being hashed, the one being read
_block_buffers = ThreadBuffer(ALIGN)
# Reads the next chunk while one is hashed (one reader per hash thread: ``hashing.hash_threads``).
_reader = ThreadPoolExecutor(4, thread_name_prefix="odirect-read")


def pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    """``os.pwrite`` until every byte is written (OSError as it raises)."""
    while data:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


class DirectFile:
    """A file of ``size`` bytes opened with ``O_DIRECT`` (descriptor ``fd``), written in pieces at any offset
    by any thread (disjoint ranges); :meth:`hash_range` reads it back in order."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.edges: dict[int, list] = {}  # block -> [bytearray(ALIGN), bytes filled]
        self.lock = threading.Lock()
        self.padded = False
        self.io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="odirect")
        self.slots = threading.Semaphore(IN_FLIGHT)
        self.spare: list[memoryview] = []
        self.inflight: set[Future] = set()
        self.failed: BaseException | None = None

    def _block_len(self, block: int) -> int:
        return min(ALIGN, self.size - block * ALIGN)

    def pwrite(self, data: memoryview, pos: int) -> None:
        """Write ``data`` at ``pos``; raises OSError (ENOSPC, EFBIG, ...) as ``os.pwrite`` does."""
        end = pos + len(data)
        if end > self.size or pos < 0:
            raise ValueError(f"write of {len(data)} bytes at {pos} outside a {self.size}-byte file")
        lo, hi = -(-pos // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if lo >= hi:  # no whole block inside: all of it goes to the edge blocks
            self._edge(data, pos)
            return
        self._edge(data[:lo - pos], pos)
        self._edge(data[hi - pos:], hi)
        for at in range(lo, hi, BOUNCE):
            n = min(BOUNCE, hi - at)
            self._raise_failed()
            with stage("wait:io-buffer"):
                self.slots.acquire()
            with self.lock:
                buf = self.spare.pop() if self.spare else memoryview(mmap.mmap(-1, BOUNCE))
            # numpy copies without the GIL (a memoryview copy holds it), so the other workers go on meanwhile
            np.frombuffer(buf, np.uint8, n)[:] = np.frombuffer(data[at - pos:at - pos + n], np.uint8)
            self._submit(self._write_out, buf, n, at)

    def _submit(self, fn, *args) -> None:
        future = self.io.submit(fn, *args)
        with self.lock:
            self.inflight.add(future)
        future.add_done_callback(self._written)

    def _write_out(self, buf: memoryview, n: int, at: int) -> None:
        try:
            with stage("io-write"):
                pwrite_all(self.fd, buf[:n], at)
        finally:
            with self.lock:
                self.spare.append(buf)
            self.slots.release()

    def _written(self, future: Future) -> None:
        with self.lock:
            self.inflight.discard(future)
            if future.exception() is not None and self.failed is None:
                self.failed = future.exception()

    def _raise_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    def drain(self) -> None:
        """Wait for the writes on their way; raise the first that failed."""
        with self.lock:
            pending = list(self.inflight)
        for future in pending:  # a waiter may wake before the done-callback has recorded the failure
            if future.exception() is not None:
                raise future.exception()
        self._raise_failed()

    def _edge(self, data: memoryview, pos: int) -> None:
        """Bytes inside blocks that other pieces share: kept until their block is full, then written (on the I/O
        threads; the block stays in :attr:`edges`, where reads find it, until it is on disk)."""
        while data:
            block, off = divmod(pos, ALIGN)
            n = min(len(data), ALIGN - off)
            with self.lock:
                entry = self.edges.setdefault(block, [bytearray(ALIGN), 0])
                entry[0][off:off + n] = data[:n]
                entry[1] += n
                full = bytes(entry[0]) if entry[1] == self._block_len(block) else None
            if full is not None:
                self._raise_failed()
                self._submit(self._write_block, full, block)
            data, pos = data[n:], pos + n

    def _write_block(self, data: bytes, block: int) -> None:
        buf = _block_buffers.get()
        buf[:ALIGN] = data
        with stage("io-write"):
            pwrite_all(self.fd, buf[:ALIGN], block * ALIGN)  # the last block: padding past the size
        with self.lock:
            self.padded |= (block + 1) * ALIGN > self.size
            del self.edges[block]

    def hash_range(self, sha: "hashlib._Hash", fd: int, start: int, end: int) -> None:
        """Feed bytes [start, end) to ``sha``: from disk through ``fd`` (an O_DIRECT descriptor of this file), and
        from memory for blocks still waiting. Every byte in the range must have been written already. The
        next chunk is read on a reader thread while this one is hashed (the tail of a conversion is this hash)."""
        with stage("wait:drain"):
            self.drain()
        first = start // ALIGN * ALIGN
        last = -(-end // ALIGN) * ALIGN
        chunks = [(at, min(BOUNCE, last - at)) for at in range(first, last, BOUNCE)]
        bufs = [b.get() for b in _read_buffers]
        pending = _reader.submit(self._read_chunk, fd, *chunks[0], bufs[0]) if chunks else None
        try:
            for i, (at, n) in enumerate(chunks):
                with stage("wait:read-back"):
                    buf, pending = pending.result(), None
                if i + 1 < len(chunks):
                    pending = _reader.submit(self._read_chunk, fd, *chunks[i + 1], bufs[(i + 1) % 2])
                with stage("hash-output"):
                    sha.update(buf[max(start, at) - at:min(end, at + n) - at])
        finally:
            if pending is not None:  # a failure: let the read in flight end before its buffer is used again
                pending.exception()

    def _read_chunk(self, fd: int, at: int, n: int, buf: memoryview) -> memoryview:
        """Bytes [at, at + n) into ``buf``: the blocks still waiting from memory, the rest from disk."""
        with self.lock:
            waiting = {b: bytes(self.edges[b][0]) for b in range(at // ALIGN, (at + n) // ALIGN) if b in self.edges}
        got = 0
        with stage("read-back"):
            while got < n:
                k = os.preadv(fd, [buf[got:n]], at + got)
                if k <= 0:
                    break  # past the end of the file (its last block before the padding is written)
                got += k
        for b, data in waiting.items():
            buf[b * ALIGN - at:(b + 1) * ALIGN - at] = data
        return buf

    def close(self) -> None:
        """Every block must have been written; cut the padding of the last block. The descriptor stays open."""
        self.drain()
        self.io.shutdown(wait=True)
        if self.edges:
            raise OSError(errno.EIO, f"{len(self.edges)} blocks of the file were never completed")
        if self.padded:
            os.ftruncate(self.fd, self.size)

    def abandon(self) -> None:
        """Let the writes on their way end (failed or not) and stop the I/O threads: the file is given up."""
        self.io.shutdown(wait=True)
