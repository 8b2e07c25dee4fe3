"""O_DIRECT shard files: pieces at any offsets, in any order, from several threads, make the exact file, and
hashing reads it back (blocks still waiting in memory included) to the sha256 of its bytes."""

from __future__ import annotations

import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from nvfp4_megamoe.convert.direct_io import ALIGN, BOUNCE, DirectFile, open_direct


def _tiling(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """Pieces (start, end) covering [0, size): tiny ones inside a block, and ones spanning many blocks."""
    cuts, at = [0], 0
    while at < size:
        at = min(size, at + rng.choice([1, 7, 100, ALIGN - 3, ALIGN, 3 * ALIGN + 5, 40_000, 300_000]))
        cuts.append(at)
    return list(zip(cuts, cuts[1:]))


def _open(tmp_path, size):
    fd = open_direct(tmp_path / "shard", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    if fd is None:
        pytest.skip("this file system does not take O_DIRECT")
    os.posix_fallocate(fd, 0, size)
    return fd, DirectFile(fd, size)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_in_any_order_from_threads_make_the_file_and_its_hash(tmp_path, seed):
    rng = random.Random(seed)
    size = rng.randrange(1, 5) * 1_000_003 + rng.randrange(ALIGN)
    data = rng.randbytes(size)
    pieces = _tiling(size, rng)
    fd, f = _open(tmp_path, size)
    head, tail = pieces[:len(pieces) // 2], pieces[len(pieces) // 2:]
    for s, e in head:  # the first half in order, so a prefix is complete while the rest is not written
        f.pwrite(memoryview(data)[s:e], s)
    end = head[-1][1]
    sha = hashlib.sha256()
    f.hash_range(sha, fd, 0, end)                   # its last block is still waiting in memory
    assert sha.hexdigest() == hashlib.sha256(data[:end]).hexdigest()
    rng.shuffle(tail)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: f.pwrite(memoryview(data)[p[0]:p[1]], p[0]), tail))
    f.hash_range(sha, fd, end, size)
    f.close()
    os.close(fd)
    assert (tmp_path / "shard").read_bytes() == data    # the padding of the last block is cut
    assert sha.hexdigest() == hashlib.sha256(data).hexdigest()


def test_hashing_reads_ahead_across_chunks(tmp_path):
    """Ranges of several read chunks (the next one is read while one is hashed), starting and ending off block
    boundaries; a hash that fails part way lets its read in flight end, and the next hash is right."""
    rng = random.Random(7)
    size = 2 * BOUNCE + 3 * ALIGN + 5
    data = rng.randbytes(size)
    fd, f = _open(tmp_path, size)
    for s, e in _tiling(size, rng):
        f.pwrite(memoryview(data)[s:e], s)

    class Failing:
        def update(self, _):
            raise RuntimeError("hash failed")

    with pytest.raises(RuntimeError, match="hash failed"):
        f.hash_range(Failing(), fd, 0, size)      # fails on the first chunk, with the second being read
    whole, parts = hashlib.sha256(), hashlib.sha256()
    f.hash_range(whole, fd, 0, size)
    for lo, hi in ((0, 123), (123, BOUNCE + 77), (BOUNCE + 77, size)):
        f.hash_range(parts, fd, lo, hi)
    f.close()
    os.close(fd)
    assert whole.hexdigest() == parts.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_block_never_completed_is_an_error(tmp_path):
    size = 3 * ALIGN + 10
    fd, f = _open(tmp_path, size)
    f.pwrite(memoryview(bytes(size - 20)), 0)       # 20 bytes of the last block never come
    with pytest.raises(OSError, match="never completed"):
        f.close()
    os.close(fd)
    with pytest.raises(ValueError, match="outside"):
        f.pwrite(memoryview(b"x" * 11), size - 10)


def test_a_failed_background_write_is_raised(tmp_path):
    """Whole blocks are written on the file's I/O threads: a write that fails there (here: a read-only
    descriptor) is raised by the writer's next call, not lost."""
    size = 4 * (8 << 20)
    path = tmp_path / "shard"
    path.write_bytes(bytes(size))
    fd = open_direct(path, os.O_RDONLY)
    if fd is None:
        pytest.skip("this file system does not take O_DIRECT")
    f = DirectFile(fd, size)
    with pytest.raises(OSError):
        f.pwrite(memoryview(bytes(size)), 0)   # its later chunks see the first ones fail ...
        f.close()                              # ... or the wait for the last ones does
    f.abandon()
    os.close(fd)


def test_a_source_shorter_than_its_copy_is_refused(tmp_path):
    """A source file that ends before the bytes a copied tensor's piece asks for (truncated under the converter) is
    a SourceError naming the file and the tensor, not a loop that never ends."""
    from nvfp4_megamoe.convert.errors import SourceError
    from nvfp4_megamoe.convert.safetensors_header import TensorInfo
    from nvfp4_megamoe.convert.source import FileReader, SourceTensor
    from nvfp4_megamoe.convert.units import Passthrough

    (tmp_path / "shard.safetensors").write_bytes(b"x" * 1000)

    class Truncated(FileReader):
        tensors = {"t": SourceTensor("t", "shard.safetensors", TensorInfo("U8", (2000,), 0, 2000))}

        def file_path(self, file):
            return tmp_path / file

    reader = Truncated()
    try:
        with pytest.raises(SourceError, match="shard.safetensors: short read of tensor t .*truncated"):
            Passthrough("t", "U8", (2000,)).run_piece(reader, None, 0, None)
    finally:
        reader.close()
