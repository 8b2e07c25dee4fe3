"""The output shard's running sha256 (convert/hashing.py): pieces completed in any order give the file's
sha256, from the page cache or, for an O_DIRECT shard, from the kept copies of its writes and the disk; an
abandoned shard gives no digest and hands its kept bytes back."""

from __future__ import annotations

import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from nvfp4_megamoe.convert import hashing
from nvfp4_megamoe.convert.direct_io import ALIGN, DirectFile, open_direct
from nvfp4_megamoe.convert.hashing import KeptBytes, PrefixHash


@pytest.mark.parametrize("seed", range(4))
def test_prefix_hash_equals_the_file_hash_whatever_the_completion_order(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(hashing, "HASH_CHUNK", 1000)  # many reads per piece
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, 50_000), 30))
    pieces = list(zip([0] + cuts, cuts + [50_001]))
    path = tmp_path / "shard"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 50_001)
    data = rng.randbytes(50_001)
    os.pwrite(fd, data[:pieces[0][1]], 0)  # the header, complete from the start
    with ThreadPoolExecutor(3) as pool:  # catch-up tasks of one file may run on several threads
        h = PrefixHash(fd, pieces[0][1], pool)
        for start, end in rng.sample(pieces[1:], len(pieces) - 1):
            os.pwrite(fd, data[start:end], start)
            h.complete(start, end)
        assert h.front == 50_001 and not h.ahead  # every range joined the complete prefix
        os.close(fd)  # the writer's descriptor goes; the hash keeps its own
        os.rename(path, tmp_path / "final")
        assert h.finish(50_001).result() == hashlib.sha256(data).hexdigest()


def _direct_shard(tmp_path, size):
    fd = open_direct(tmp_path / "shard", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    if fd is None:
        pytest.skip("this file system does not take O_DIRECT")
    os.posix_fallocate(fd, 0, size)
    return fd, DirectFile(fd, size)


@pytest.mark.parametrize("budget", [0, 60_000, 10**9])
def test_direct_shard_hashes_kept_copies_and_reads_back_the_rest(tmp_path, monkeypatch, budget):
    """Writes from threads in any order, each kept while the budget allows: the digest is the file's, only what was
    not kept is read back from the disk, and the budget is whole again at the end."""
    rng = random.Random(budget)
    size = 400_003
    data = rng.randbytes(size)
    cuts = sorted(rng.sample(range(1, size), 40))
    pieces = list(zip([0] + cuts, cuts + [size]))
    fd, direct = _direct_shard(tmp_path, size)
    read_back = []
    hash_range = direct.hash_range
    monkeypatch.setattr(direct, "hash_range", lambda sha, f, lo, hi: (read_back.append(hi - lo),
                                                                      hash_range(sha, f, lo, hi)))
    kept = KeptBytes(budget)
    with ThreadPoolExecutor(3) as pool:
        h = PrefixHash(fd, pieces[0][1], pool, direct=direct, kept=kept)
        direct.pwrite(memoryview(data)[:pieces[0][1]], 0)
        h.keep(0, memoryview(data)[:pieces[0][1]])

        def write(piece):
            lo, hi = piece
            direct.pwrite(memoryview(data)[lo:hi], lo)
            h.keep(lo, memoryview(data)[lo:hi])
            h.complete(lo, hi)

        with ThreadPoolExecutor(4) as writers:
            list(writers.map(write, rng.sample(pieces[1:], len(pieces) - 1)))
        assert h.finish(size).result() == hashlib.sha256(data).hexdigest()
    direct.close()
    os.close(fd)
    assert kept.free == budget
    if budget >= size:
        assert read_back == []  # all of it from memory
    elif budget == 0:
        assert sum(read_back) == size
    else:
        assert 0 < sum(read_back) < size


def test_abandoned_direct_shard_hands_its_kept_bytes_back(tmp_path):
    fd, direct = _direct_shard(tmp_path, 3 * ALIGN)
    kept = KeptBytes(10 * ALIGN)
    with ThreadPoolExecutor(1) as pool:
        h = PrefixHash(fd, 0, pool, direct=direct, kept=kept)
        direct.pwrite(memoryview(b"y" * ALIGN), ALIGN)
        h.keep(ALIGN, memoryview(b"y" * ALIGN))
        assert kept.free == 9 * ALIGN
        h.close()
        assert kept.free == 10 * ALIGN
        with pytest.raises(OSError, match="abandoned"):
            h.finish(3 * ALIGN).result()
    direct.abandon()
    os.close(fd)


def test_abandoned_shard_has_no_digest(tmp_path):
    path = tmp_path / "shard"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"x" * 100, 0)
    with ThreadPoolExecutor(1) as pool:
        h = PrefixHash(fd, 10, pool)
        h.close()
        with pytest.raises(OSError, match="abandoned"):
            h.finish(100).result()
    os.close(fd)


def test_hashed_ahead_only_while_the_file_is_unchanged(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.safetensors", "b.safetensors", "c.safetensors"))
    for p, data in ((a, b"alpha" * 1000), (b, b"beta" * 1000), (c, b"gamma")):
        p.write_bytes(data)
    hashing.hash_ahead([a, b])
    assert hashing.hashed_ahead(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert hashing.hashed_ahead(a) is None  # handed out once
    assert hashing.hashed_ahead(c) is None  # never started
    while not hashing._ahead[str(b.resolve())].done():
        pass
    st = b.stat()
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed since it was hashed
    assert hashing.hashed_ahead(b) is None


def test_hash_ahead_twice_starts_each_file_once(tmp_path):
    a = tmp_path / "a.safetensors"
    a.write_bytes(b"x" * 5000)
    hashing.hash_ahead([a])
    hashing.hash_ahead([a])  # e.g. a second in-process CLI call before the first took its result
    assert hashing.hashed_ahead(a) == hashlib.sha256(b"x" * 5000).hexdigest()
