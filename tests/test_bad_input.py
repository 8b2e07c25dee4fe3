"""Bad input is refused clearly and nothing is lost.

For every case: a one-paragraph error (no traceback) naming the file or tensor and what was
expected, a non-zero exit, the source byte-for-byte unchanged (hashed before and after), and no
complete-looking output (no ``model.safetensors.index.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.safetensors_header import read_header
from nvfp4_megamoe.convert.errors import SourceError
from nvfp4_megamoe.convert.value_screen import check_values

from synth_checkpoints import writable_copy

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(synth_checkpoints) -> dict[str, Path]:
    return {"flash": synth_checkpoints.source("flash"), "base": synth_checkpoints.source("base")}


@pytest.fixture
def src(pristine, tmp_path) -> Path:
    return writable_copy(pristine["flash"], tmp_path / "src")


def _tree_hash(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _shard_of(root: Path, tensor: str) -> Path:
    return root / json.loads((root / INDEX).read_text())["weight_map"][tensor]


def _poke(root: Path, tensor: str, data: bytes, at: int = 0) -> Path:
    """Overwrite bytes of one tensor's data in place."""
    shard = _shard_of(root, tensor)
    info = read_header(shard).tensors[tensor]
    with open(shard, "r+b") as f:
        f.seek(info.start + at)
        f.write(data)
    return shard


def _refused(src: Path, out: Path, *must_name: str, args: tuple[str, ...] = ()) -> str:
    """Run the CLI on a bad source; check the refusal contract; return the message."""
    before = _tree_hash(src)
    result = CliRunner().invoke(main, ["convert", str(src), str(out), "--no-progress", *args])
    output = result.output
    assert result.exit_code != 0, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output and "\nerror: " in "\n" + output, output
    msg = output[output.index("error: ") if output.startswith("error: ") else output.index("\nerror: ") + 1:]
    for name in must_name:
        assert name in msg, (name, msg)
    assert _tree_hash(src) == before, "the source was modified"
    assert not (out / INDEX).exists(), "a refused run must not look complete"
    return msg


def test_truncated_shard(src, tmp_path):
    shard = sorted(src.glob("model-*.safetensors"))[2]
    os.truncate(shard, shard.stat().st_size - 1000)
    msg = _refused(src, tmp_path / "out", shard.name, "truncated")
    assert "header says" in msg
    assert not (tmp_path / "out").exists()  # refused before the output folder is created


def test_corrupted_header(src, tmp_path):
    shard = sorted(src.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"{\"x\": nonsense")
    _refused(src, tmp_path / "out", shard.name, "not valid JSON")


def test_oversized_header(src, tmp_path):
    shard = sorted(src.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 2**40))
    _refused(src, tmp_path / "out", shard.name, "header length 1099511627776")


@pytest.mark.parametrize("target, expect", [("model-00042-of-00099.safetensors", "missing"),
                                            ("../elsewhere/model.safetensors", "outside the checkpoint folder")])
def test_index_naming_missing_or_outside_file(src, tmp_path, target, expect):
    index = json.loads((src / INDEX).read_text())
    index["weight_map"]["layers.1.attn.wkv.weight"] = target
    (src / INDEX).write_text(json.dumps(index))
    _refused(src, tmp_path / "out", target, expect)


def test_shapes_contradicting_config(src, tmp_path):
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] *= 2
    (src / "config.json").write_text(json.dumps(config))
    msg = _refused(src, tmp_path / "out", "layers.0.ffn.experts.0.w1.weight", "contradicts config.json")
    assert "expected [256, 128]" in msg  # [2 * 128, 256 / 2]


def test_dtype_contradicting_the_format(src, tmp_path):
    from safetensors.torch import load_file, save_file

    name = "layers.2.ffn.experts.3.w1.scale"
    shard = _shard_of(src, name)
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].view(torch.uint8).float()  # E8M0 scale stored as F32: no rule accepts it
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _refused(src, tmp_path / "out", name, "F32", shard.name)


@pytest.mark.parametrize("variant, tensor, data, what", [
    ("flash", "layers.1.ffn.experts.5.w3.scale", b"\xff", "E8M0 scale bytes 0xFF"),
    ("flash", "layers.3.attn.wo_b.weight", b"\x7f", "E4M3 NaN"),
    ("base", "layers.2.attn.wq_a.scale", struct.pack("<f", float("inf")), "NaN/Inf"),
])
def test_nan_and_inf_found_while_converting(pristine, tmp_path, variant, tensor, data, what):
    src = writable_copy(pristine[variant], tmp_path / "src")
    shard = _poke(src, tensor, data, at=4)
    out = tmp_path / "out"
    _refused(src, out, tensor, what, shard.name, "expected finite values")
    assert out.exists()  # found while converting, after the output folder was made ...
    assert not list(out.glob(".*.partial"))  # ... and unfinished shards were removed


@pytest.mark.parametrize("dtype, is_bad", [("F8_E4M3", lambda b: (b & 0x7F) == 0x7F), ("F8_E5M2", lambda b: (b & 0x7C) == 0x7C),
                                           ("F8_E8M0", lambda b: b == 0xFF)])
def test_nan_screen_agrees_with_the_format_on_every_byte(dtype, is_bad):
    for byte in range(256):
        data = torch.tensor([0x00, byte, 0x01], dtype=torch.uint8)
        if is_bad(byte):
            with pytest.raises(SourceError, match="at flat index 1"):
                check_values("t", "f", dtype, data)
        else:
            check_values("t", "f", dtype, data)


def test_full_disk_is_reported_as_efbig(src, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) makes writes fail with EFBIG, as a full disk fails with ENOSPC."""
    out = tmp_path / "out"
    before = _tree_hash(src)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # otherwise the kernel kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    proc = subprocess.run([sys.executable, "-m", "nvfp4_megamoe.convert.cli", "convert", str(src), str(out),
                           "--no-progress", "--shard-size", "3MB"],
                          preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    err = proc.stderr
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert "File too large" in err and "model-0000" in err and "--resume" in err, err
    assert _tree_hash(src) == before
    assert not (out / INDEX).exists() and not list(out.glob(".*.partial"))


def test_output_folder_holding_a_different_conversion(src, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(src), str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    finished = _tree_hash(out)
    before = _tree_hash(src)
    for args in ((), ("--dense", "nvfp4"), ("--dense", "nvfp4", "--resume")):
        result = CliRunner().invoke(main, ["convert", str(src), str(out), "--no-progress", *args])
        assert result.exit_code != 0 and "already holds a finished conversion" in result.output, result.output
        assert str(out) in result.output
    assert _tree_hash(out) == finished and _tree_hash(src) == before  # nothing lost on either side
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["convert", str(src), str(other), "--no-progress"])
    assert result.exit_code != 0 and "not empty" in result.output
    assert (other / "notes.txt").read_text() == "mine" and len(list(other.iterdir())) == 1
