"""sha256 of an output shard while it is being filled, so its digest is ready soon after the last write.

Units fill a shard's tensors out of order (two workers, each at its own offsets), but a shard's
sha256 must run front to back. :class:`PrefixHash` tracks which tensors are complete and hashes
the file's complete prefix as it grows, on the hash thread, reading the bytes back from the page
cache through its own descriptor (so it outlives the writer's, and the rename). The pieces it
is told about are final when marked complete (a unit marks its outputs only once all are
written), so the digest is exactly that of the finished file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

HASH_CHUNK = 8 * 1024 * 1024


class PrefixHash:
    """sha256 of the file behind ``fd`` (duplicated here), whose byte ranges ``pieces`` [(start, end), ...]
    tile it front to back; the first piece (the header) is complete from the start."""

    def __init__(self, fd: int, pieces: list[tuple[int, int]], pool: ThreadPoolExecutor):
        self.fd = os.dup(fd)
        self.ends = dict(pieces)
        self.order = [start for start, _ in pieces]
        self.complete_starts = {self.order[0]} if self.order else set()
        self.next = 1 if self.order else 0  # index of the first piece not yet known complete
        self.pool = pool
        self.sha = hashlib.sha256()
        self.pos = 0
        self.buf: memoryview | None = None
        self.marks = threading.Lock()  # completion bookkeeping (worker threads)
        self.io = threading.Lock()  # the descriptor and the hash state (hash thread; close)

    def complete(self, start: int) -> None:
        """The piece starting at ``start`` is final; hash whatever prefix that completes (in the background)."""
        with self.marks:
            self.complete_starts.add(start)
            advanced = False
            while self.next < len(self.order) and self.order[self.next] in self.complete_starts:
                self.next += 1
                advanced = True
            if not advanced:
                return
            end = self.ends[self.order[self.next - 1]]
        self.pool.submit(self._hash_to, end)

    def finish(self, size: int) -> Future:
        """Hash to ``size`` (the whole file) and release the descriptor: a future of the hex digest."""
        return self.pool.submit(self._digest, size)

    def close(self) -> None:
        """Release the descriptor without a digest (the shard is abandoned)."""
        with self.io:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.buf = None

    def _digest(self, size: int) -> str:
        try:
            self._hash_to(size)
            with self.io:
                if self.pos != size:
                    raise OSError(errno.EBADF, "shard abandoned before its hash was complete")
                return self.sha.hexdigest()
        finally:
            self.close()

    def _hash_to(self, end: int) -> None:
        # Runs on the one hash thread, so calls happen in submission order; the lock guards against close().
        with self.io:
            if self.fd < 0 or self.pos >= end:
                return
            if self.buf is None:
                self.buf = memoryview(bytearray(HASH_CHUNK))
            buf = self.buf
            while self.pos < end:
                n = os.preadv(self.fd, [buf[:end - self.pos]], self.pos)
                if n <= 0:
                    raise OSError(errno.EIO, f"shard ended at {self.pos} bytes while hashing to {end}")
                self.sha.update(buf[:n])
                self.pos += n
