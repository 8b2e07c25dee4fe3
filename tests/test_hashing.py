"""The output shard's running sha256 (convert/hashing.py): pieces completed in any order give the file's
sha256; an abandoned shard gives no digest."""

from __future__ import annotations

import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from nvfp4_megamoe.convert import hashing
from nvfp4_megamoe.convert.hashing import PrefixHash


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
