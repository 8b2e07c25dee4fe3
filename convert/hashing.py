"""sha256 of checkpoint files: whole files (:func:`sha256_file`), output shards while they fill
(:class:`PrefixHash`), and a local source's shards from the moment the CLI starts (:func:`hash_ahead`).

hashlib releases the GIL on large buffers, so all of these run beside the conversion.

Output shards. Workers fill a shard out of order (each piece at its own offsets), but a shard's
sha256 must run front to back. :class:`PrefixHash` tracks which byte ranges are final and hashes
the file's complete prefix as it grows, on a hash thread, straight from the page cache through
a read-only mapping of its own descriptor (so it outlives the writer's, and the rename; no copy), or,
for a shard written with ``O_DIRECT`` (:mod:`.direct_io`), by direct reads of its descriptor.
The writer gives a shard its full size before the first byte, so the mapping covers it all. The ranges it
is told about are final when marked complete (a piece marks its ranges once it has written them),
so the digest is exactly that of the finished file.

Source shards. Importing torch keeps one core busy for over a second before the converter can
start; the CLI calls :func:`hash_ahead` first, so the source hashes the manifest records are under
way meanwhile. A result is used (:func:`hashed_ahead`) only if the file's size and mtime did not
change while it was hashed and still match when it is taken.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from .direct_io import DirectFile
from .timing import stage

HASH_CHUNK = 8 * 1024 * 1024


def hash_threads() -> int:
    """Threads that hash files side by side: a quarter of the CPUs, 1 to 4 (sha256 runs at 1.3-2 GB/s a core, so
    four outrun a fast disk; on a small machine the conversion needs the cores)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus // 4))


def sha256_file(path: str | Path, chunk: int = 16 * 1024 * 1024) -> str:
    """Hex sha256 of a file, read in chunks into one buffer (a fresh buffer per chunk costs page faults).

    Read, not mapped: a file truncated meanwhile then ends the hash early instead of killing the process (SIGBUS).
    """
    h = hashlib.sha256()
    view = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f, stage("hash-file"):
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


Stamp = tuple[int, int]  # (size, mtime_ns): what tells that a file did not change
_ahead: dict[str, Future] = {}


def file_stamp(path: str | Path) -> Stamp:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def hash_ahead(paths: list[Path]) -> None:
    """Start hashing ``paths``, in this order, on :func:`hash_threads` daemon threads (they never hold up the
    interpreter's exit).

    A path already started (and not yet taken) is not started again.
    """
    jobs = []
    for p in paths:
        key = str(p.resolve())
        if key not in _ahead:
            _ahead[key] = Future()
            jobs.append((p, _ahead[key]))
    queue = iter(jobs)  # shared by the threads: next() on a list iterator is atomic
    for k in range(min(hash_threads(), len(jobs))):
        threading.Thread(target=_hash_all, args=(queue,), name=f"sha256-ahead_{k}", daemon=True).start()


def _hash_all(jobs: Iterator[tuple[Path, Future]]) -> None:
    for path, future in jobs:
        if not future.set_running_or_notify_cancel():
            continue
        try:
            before = file_stamp(path)
            sha = sha256_file(path)
            future.set_result((before if file_stamp(path) == before else None, sha))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the result
            future.set_exception(exc)


def hashed_ahead(path: str | Path) -> str | None:
    """The sha256 :func:`hash_ahead` computed for ``path`` (waiting for it), or None: none was started, it
    failed, or the file changed during or since."""
    future = _ahead.pop(str(Path(path).resolve()), None)
    if future is None or future.cancel():
        return None
    try:
        stamp, sha = future.result()
    except OSError:
        return None
    return sha if stamp is not None and stamp == file_stamp(path) else None


class PrefixHash:
    """sha256 of the file behind ``fd`` (duplicated here), whose first ``header`` bytes are final from the start
    and whose other bytes become final in ranges (:meth:`complete`) that tile the rest of it, in any order.

    At most one catch-up task per file waits in ``pool`` (it hashes to wherever the complete prefix has got
    when it runs), so a pool of several threads hashes several files side by side."""

    def __init__(self, fd: int, header: int, pool: ThreadPoolExecutor, direct: DirectFile | None = None):
        self.fd = os.dup(fd)
        self.direct = direct  # an O_DIRECT file: read back through it (no page cache to map)
        self.front = header  # end of the complete prefix
        self.ahead: dict[int, int] = {}  # complete ranges beyond the front: start -> end
        self.queued = False  # a catch-up task waits in the pool
        self.pool = pool
        self.sha = hashlib.sha256()
        self.pos = 0
        self.view: memoryview | None = None  # of the mapping, made on first use
        self.marks = threading.Lock()  # completion bookkeeping (worker threads)
        self.io = threading.Lock()  # the descriptor and the hash state (hash threads; close)

    def complete(self, start: int, end: int) -> None:
        """Bytes [start, end) are final; hash whatever prefix that completes (in the background)."""
        if end <= start:
            return
        with self.marks:
            self.ahead[start] = end
            front = self.front
            while front in self.ahead:
                front = self.ahead.pop(front)
            if front == self.front:
                return
            self.front = front
            if self.queued:
                return
            self.queued = True
        self.pool.submit(self._catch_up)

    def _catch_up(self) -> None:
        with self.marks:
            self.queued = False
            end = self.front
        self._hash_to(end)

    def finish(self, size: int) -> Future:
        """Hash to ``size`` (the whole file) and release the descriptor: a future of the hex digest."""
        return self.pool.submit(self._digest, size)

    def close(self) -> None:
        """Release the descriptor without a digest (the shard is abandoned)."""
        with self.io:
            if self.view is not None:
                mapping = self.view.obj
                self.view.release()
                mapping.close()
                self.view = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

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
        # Calls may come in any order (several hash threads): each hashes on from wherever the last one stopped.
        with self.io:
            if self.fd < 0 or self.pos >= end:
                return
            if self.direct is not None:
                self.direct.hash_range(self.sha, self.fd, self.pos, end)
                self.pos = end
                return
            if self.view is None:
                self.view = memoryview(mmap.mmap(self.fd, 0, prot=mmap.PROT_READ))
            if end > len(self.view):
                raise OSError(errno.EIO, f"shard is {len(self.view)} bytes, hashing to {end}")
            with stage("hash-output"):
                while self.pos < end:
                    n = min(HASH_CHUNK, end - self.pos)
                    self.sha.update(self.view[self.pos:self.pos + n])
                    self.pos += n
