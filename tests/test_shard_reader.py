"""``runtime/shard_reader.py``: tensors read by byte range in parallel chunks equal what safetensors reads."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nvfp4_megamoe.runtime import shard_reader
from nvfp4_megamoe.runtime.shard_reader import ShardReader


@pytest.fixture()
def shard(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randint(0, 256, (64, 300), dtype=torch.uint8, generator=gen),
        "bf": torch.randn(7, 33, generator=gen).bfloat16(),
        "f32": torch.randn(5, generator=gen),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "i64": torch.arange(11, dtype=torch.int64),
        "fp8": torch.randn(16, 16, generator=gen).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "model-00001-of-00001.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 7])   # one read, and chunks spread over the thread pool
def test_reads_equal_safetensors(shard, monkeypatch, chunk):
    path, tensors = shard
    monkeypatch.setattr(shard_reader, "CHUNK_BYTES", chunk)
    reader = ShardReader(path)
    with safe_open(str(path), framework="pt") as f:
        for name, want in tensors.items():
            got = reader.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), f.get_tensor(name).reshape(-1).view(torch.uint8))
        for name, rows in (("w", (3, 41)), ("w", (10, 10)), ("bf", (6, 7)), ("i64", (0, 11))):
            want = f.get_slice(name)[rows[0]:rows[1]]
            got = reader.read(name, rows)
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    reader.close()


def test_a_shard_cut_short_after_opening_is_an_error(shard):
    path, _ = shard
    reader = ShardReader(path)
    last = max(reader._entries, key=lambda name: reader._entries[name]["data_offsets"][1])
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1)
    with pytest.raises(OSError, match="ended 1 bytes early"):
        reader.read(last)
    reader.close()
