"""The streaming shard writer: headers laid out from the plan, tensors filled in place.

Each shard is written under a temporary name (``.NAME.partial``) with its full size allocated up
front (so a full disk fails early, not at the last byte), filled piece by piece at known offsets,
fsynced and only then renamed to its final name. A folder with partial files and no index never
looks like a finished conversion.

The sha256 of a shard is computed while it fills (:mod:`.hashing`: each byte range joins it once
:meth:`ShardWriter.filled` says it is final); on a thread of its own, the writeback of completed ranges
is started at once and a finished shard is fsynced and renamed, so none of this holds up the
conversion of what follows. Shards fill side by side where the pieces under way write to several.

Shards are written with ``O_DIRECT`` where the file system takes it (:mod:`.direct_io`; ``direct_io=False``
writes through the page cache).
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from nvfp4_megamoe.runtime.format import SHARD_METADATA, shard_name

from .direct_io import DirectFile, open_direct, pwrite_all
from .errors import OutputError
from .safetensors_header import encode_header
from .hashing import PrefixHash
from .timing import stage
from .units import Filled, OutputSpec

# Completed tensors at least this large have their writeback started at once (small ones wait for the fsync).
WRITEBACK_MIN = 1 << 20


def _writeback_starter() -> Callable[[int, int, int], None]:
    """Linux ``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``: start writing a byte range to disk
    without waiting, so the disk works while conversion goes on and the fsync that finishes a shard
    has little left to do. A no-op where it is not available."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        return lambda fd, offset, n: fn(fd, offset, n, 2)  # SYNC_FILE_RANGE_WRITE
    except (OSError, AttributeError):
        return lambda fd, offset, n: None


start_writeback = _writeback_starter()


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _disk_error(exc: OSError, path: Path) -> OutputError:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return OutputError(f"{path}: cannot write: {exc.strerror}. Free space (or raise the file-size limit) for the "
                           "output and run again with --resume; the source is untouched.")
    return OutputError(f"{path}: cannot write: {exc}")


def _pwrite_all(fd: int, data: memoryview, pos: int, path: Path) -> None:
    try:
        pwrite_all(fd, data, pos)
    except OSError as exc:
        raise _disk_error(exc, path) from None


class ShardWriter:
    """Writes the plan's shards into ``out``; call :meth:`filled` as byte ranges of outputs are final and
    :meth:`written` as outputs complete.

    Thread-safe: pieces running in parallel write disjoint byte ranges. Shards
    named in ``done`` (finished by an earlier run, verified by ``--resume``) are not written
    again: writes to them are dropped. ``on_finish(name, size, sha256_future)`` is called
    when a shard has been fsynced and renamed to its final name (on the writer's finishing
    thread; :meth:`close` returns once every shard is finished, raising what went wrong).
    ``direct_io``: write shards with ``O_DIRECT`` where the file system allows it.
    """

    def __init__(self, out: Path, shards: list[list[OutputSpec]], hash_pool: ThreadPoolExecutor,
                 done: dict[str, tuple[int, str]] | None = None,
                 on_finish: Callable[[str, int, Future], None] | None = None, direct_io: bool = True):
        self.out = out
        self.direct_io = direct_io
        self.direct: dict[int, DirectFile] = {}  # open shards written with O_DIRECT
        self.names = [shard_name(i + 1, len(shards)) for i in range(len(shards))]
        self.layout: list[tuple[bytes, int]] = []
        self.where: dict[str, tuple[int, int, int]] = {}
        self.pending: list[set[str]] = []
        for i, shard in enumerate(shards):
            head, offsets = encode_header([(o.name, o.dtype, o.shape, o.nbytes) for o in shard], dict(SHARD_METADATA))
            size = (offsets[-1] + shard[-1].nbytes) if shard else len(head)
            self.layout.append((head, size))
            for o, off in zip(shard, offsets):
                self.where[o.name] = (i, off, o.nbytes)
            self.pending.append({o.name for o in shard})
        self.fds: dict[int, int] = {}
        # One writer per buffered shard at a time: concurrent pwrites to one file contend on its inode lock, where
        # the kernel spins and burns the CPU another thread could use; waiting on a Python lock sleeps instead.
        self.write_locks = [threading.Lock() for _ in shards]
        self.streams: dict[int, PrefixHash] = {}
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync")
        self.finishing: list[Future] = []
        self.hashes: dict[str, Future] = {}
        self.sizes: dict[str, int] = {}
        self.pool = hash_pool
        self.on_finish = on_finish
        self.lock = threading.Lock()
        self.done_shards: set[int] = set()
        for i, name in enumerate(self.names):
            if done and name in done:
                size, sha = done[name]
                self.done_shards.add(i)
                self.pending[i] = set()
                self.sizes[name] = size
                self.hashes[name] = _done_future(sha)

    def is_done(self, name: str) -> bool:
        """Whether output tensor ``name`` lies in a shard finished by an earlier run."""
        return self.where[name][0] in self.done_shards

    def tmp_path(self, i: int) -> Path:
        return self.out / f".{self.names[i]}.partial"

    def _fd(self, i: int) -> int:
        fd = self.fds.get(i)
        if fd is not None:
            return fd
        with self.lock:
            return self._open(i)

    def _open(self, i: int) -> int:
        fd = self.fds.get(i)
        if fd is None:
            head, size = self.layout[i]
            path = self.tmp_path(i)
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
            fd = open_direct(path, flags) if self.direct_io else None
            direct = DirectFile(fd, size) if fd is not None else None
            if fd is None:
                fd = os.open(path, flags, 0o644)
            try:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    os.ftruncate(fd, size)
                if direct is not None:
                    direct.pwrite(memoryview(head), 0)
                    self.direct[i] = direct
                else:
                    _pwrite_all(fd, memoryview(head), 0, path)
                self.streams[i] = PrefixHash(fd, len(head), self.pool, direct=direct)
            except (OSError, OutputError) as exc:
                if direct is not None:
                    self.direct.pop(i, None)
                    direct.abandon()
                os.close(fd)
                path.unlink(missing_ok=True)
                if isinstance(exc, OutputError):
                    raise
                raise _disk_error(exc, path) from None
            self.fds[i] = fd
        return fd

    def _target(self, name: str, offset: int, count: int) -> tuple[int, int, int] | None:
        """(shard, its descriptor, file position) of ``count`` bytes at ``offset`` into output ``name``."""
        i, base, nbytes = self.where[name]
        if offset < 0 or offset + count > nbytes:
            raise AssertionError(f"write of {count} bytes at {offset} overruns {name} ({nbytes} bytes)")
        if i in self.done_shards:
            return None
        return i, self._fd(i), base + offset

    def write(self, name: str, offset: int, data: torch.Tensor) -> None:
        """Write a tensor's bytes at ``offset`` bytes into output tensor ``name``."""
        with stage("write"):
            self._write(name, offset, data)

    def _write(self, name: str, offset: int, data: torch.Tensor) -> None:
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        target = self._target(name, offset, raw.nbytes)
        if target is not None:
            i, fd, pos = target
            direct = self.direct.get(i)
            if direct is None:
                with self.write_locks[i]:
                    _pwrite_all(fd, memoryview(raw), pos, self.tmp_path(i))
                return
            try:  # no lock: O_DIRECT writes of disjoint ranges go on side by side
                direct.pwrite(memoryview(raw), pos)
            except OSError as exc:
                raise _disk_error(exc, self.tmp_path(i)) from None

    def filled(self, ranges: list[Filled]) -> None:
        """Byte ranges of outputs are written and final: they join their shard's running hash, and the writeback
        of large ones starts (buffered shards)."""
        self._raise_finish_error()
        marks, flush = [], []
        with self.lock:
            for name, offset, count in ranges:
                i, base, _ = self.where[name]
                if i in self.done_shards or count <= 0:
                    continue
                self._open(i)
                marks.append((self.streams[i], base + offset, base + offset + count))
                if count >= WRITEBACK_MIN and i not in self.direct:  # O_DIRECT leaves nothing to write back
                    flush.append((i, base + offset, count))
            self.finishing += [self.finisher.submit(self._writeback, *f) for f in flush]
        for stream, start, end in marks:
            stream.complete(start, end)

    def written(self, names: list[str]) -> None:
        """Outputs are complete (every range :meth:`filled`): a shard whose outputs all are is handed to the
        finishing thread (fsync, rename), after the writeback started before."""
        self._raise_finish_error()
        finished = []
        with self.lock:
            for name in names:
                i = self.where[name][0]
                if i in self.done_shards or name not in self.pending[i]:
                    continue
                self._open(i)
                self.pending[i].discard(name)
                if not self.pending[i]:
                    finished.append(i)
            self.finishing += [self.finisher.submit(self._finish, i) for i in finished]

    def _writeback(self, i: int, start: int, nbytes: int) -> None:
        with self.lock:
            fd = self.fds.get(i)
        if fd is not None:
            with stage("writeback"):
                start_writeback(fd, start, nbytes)

    def _raise_finish_error(self) -> None:
        for f in self.finishing:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def close(self) -> None:
        """Block until every handed-over shard is fsynced and renamed, and stop the finishing thread;
        raise the first failure."""
        self.finisher.shutdown(wait=True)
        for f in self.finishing:
            f.result()

    def _finish(self, i: int) -> None:
        name, size = self.names[i], self.layout[i][1]
        with self.lock:
            fd = self._open(i)
            stream = self.streams.pop(i)
        # The last stretch is hashed (from the page cache) while fsync waits on the disk; the journal
        # hears of the shard only after the rename (on_finish).
        future = stream.finish(size)
        path = self.tmp_path(i)
        with stage("fsync"):
            self._sync_and_rename(i, fd, path, name)
        self.sizes[name] = size
        self.hashes[name] = future
        if self.on_finish is not None:
            self.on_finish(name, size, future)

    def _sync_and_rename(self, i: int, fd: int, path: Path, name: str) -> None:
        try:
            with self.lock:
                direct = self.direct.pop(i, None)
            if direct is not None:
                direct.close()
            os.fsync(fd)
        except OSError as exc:
            raise _disk_error(exc, path) from None
        finally:
            with self.lock:
                os.close(fd)
                del self.fds[i]
        os.rename(path, self.out / name)
        fsync_dir(self.out)

    def abort(self) -> None:
        """Close and remove unfinished temporary shards (finished ones stay for --resume)."""
        self.finisher.shutdown(wait=True)
        with self.lock:
            for stream in self.streams.values():
                stream.close()
            self.streams.clear()
            for direct in self.direct.values():
                direct.abandon()
            self.direct.clear()
            for i, fd in list(self.fds.items()):
                os.close(fd)
                self.tmp_path(i).unlink(missing_ok=True)
            self.fds.clear()


def _done_future(value: str) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
