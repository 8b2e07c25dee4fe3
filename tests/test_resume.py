"""Resume and determinism: a run killed at any point (SIGKILL) and re-run with ``--resume`` gives the
bytes of an uninterrupted run; ``--resume`` refuses another run's folder; any number of threads
gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.errors import OutputError
from nvfp4_megamoe.convert.resume import JOURNAL_FILE
from nvfp4_megamoe.convert.writer import ShardWriter

SHARD = 700_000  # ~10 output shards for the tiny preset


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(out: Path) -> dict[str, str]:
    """sha256 of every file a finished conversion holds (shards, index, manifest, copied files)."""
    return {p.name: _sha(p) for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt(synth_checkpoints) -> Path:
    return synth_checkpoints.source("flash")


@pytest.fixture(scope="module")
def clean(synth_checkpoints) -> Path:
    return synth_checkpoints.converted("flash", shard_size=SHARD, workers=1).output


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "nvfp4_megamoe.convert.cli", "convert", *args, "--shard-size", str(SHARD),
            "--no-progress"]


def _kill_when(cmd: list[str], ready, timeout: float = 120) -> None:
    """Start ``cmd``; SIGKILL it as soon as ``ready()`` holds (polled every few ms)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the conversion finished before it could be killed: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("timed out waiting for the kill point")
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()


def _journal_shards(out: Path) -> int:
    try:
        return len(json.loads((out / JOURNAL_FILE).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.parametrize("kill_point", ["first-shard", "two-journaled"])
def test_sigkill_then_resume_is_byte_identical(ckpt, clean, tmp_path, kill_point):
    out = tmp_path / "out"
    ready = {"first-shard": lambda: any(out.glob("model-*.safetensors")),
             "two-journaled": lambda: _journal_shards(out) >= 2}[kill_point]
    _kill_when(_cli(str(ckpt), str(out), "--workers", "2"), ready)
    assert not (out / "model.safetensors.index.json").exists(), "a killed run must not look complete"
    assert (out / JOURNAL_FILE).exists()
    proc = subprocess.run(_cli(str(ckpt), str(out), "--resume", "--workers", "3"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if kill_point == "two-journaled":
        assert "resumed:" in proc.stdout
    assert _files(out) == _files(clean)  # every shard, the index and the manifest
    assert not (out / JOURNAL_FILE).exists() and not list(out.glob(".*"))


class Interrupt(RuntimeError):
    pass


def _interrupted_run(ckpt: Path, out: Path, monkeypatch, after: int, **kwargs) -> None:
    """Run until ``after`` calls of ShardWriter.written, then fail as a crash would (in-process)."""
    written = ShardWriter.written
    calls = []

    def flaky(self, names):
        calls.append(1)
        if len(calls) > after:
            raise Interrupt("simulated crash")
        written(self, names)

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "written", flaky)
        with pytest.raises(Interrupt):
            convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, workers=1, **kwargs)
    assert not (out / "model.safetensors.index.json").exists()


def test_resume_refuses_other_options_and_changed_source(ckpt, synth_checkpoints, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted_run(ckpt, out, monkeypatch, after=60)
    with pytest.raises(OutputError, match="--resume"):  # not without --resume
        convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False)
    with pytest.raises(OutputError, match="options.*dense"):
        convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, resume=True, dense="nvfp4")
    with pytest.raises(OutputError, match="options.*shard_size"):
        convert_checkpoint(ckpt, out, shard_size=SHARD * 2, progress=False, resume=True)
    other = synth_checkpoints.source("flash", seed=1)
    with pytest.raises(OutputError, match="source"):
        convert_checkpoint(other, out, shard_size=SHARD, progress=False, resume=True)
    before = _files(out)
    shard = sorted(ckpt.glob("model-*.safetensors"))[3]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the file "changed"
    try:
        with pytest.raises(OutputError, match=f"source files changed: {shard.name}"):
            convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, resume=True)
    finally:
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns - 10**9))
    assert _files(out) == before  # refusing changed nothing


def test_damaged_finished_shard_is_redone(ckpt, clean, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted_run(ckpt, out, monkeypatch, after=120)
    finished = sorted(out.glob("model-*.safetensors"))
    assert len(finished) >= 2
    data = bytearray(finished[0].read_bytes())
    data[-1] ^= 0xFF
    finished[0].write_bytes(bytes(data))
    (out / f".{finished[1].name}.partial").write_bytes(b"left over")
    result = convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, resume=True, workers=2)
    assert result.skipped_shards == len(finished) - 1
    assert _files(out) == _files(clean)


def test_resume_of_a_finished_folder_is_a_no_op(ckpt, clean, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    result = convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, resume=True)
    assert result.skipped_shards == len(result.plan.shards)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(OutputError, match=r"differs from this one: other options \(--dense keep there, nvfp4 here\)"):
        convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, resume=True, dense="nvfp4")
    with pytest.raises(OutputError, match=r"differs from this one: another source \(.*, this run converts "):
        convert_checkpoint(clean, out, shard_size=SHARD, progress=False, resume=True)


@pytest.mark.parametrize("workers", [2, 5])
def test_bytes_do_not_depend_on_the_number_of_threads(ckpt, clean, tmp_path, workers):
    out = tmp_path / "out"
    convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, workers=workers)
    assert _files(out) == _files(clean)


@pytest.mark.parametrize("direct_io", [True, False])
def test_bytes_do_not_depend_on_direct_io(ckpt, clean, tmp_path, direct_io):
    """O_DIRECT shards (where tmp_path's file system takes them) and page-cache shards are the same files,
    with the same hashes in the manifest."""
    out = tmp_path / "out"
    convert_checkpoint(ckpt, out, shard_size=SHARD, progress=False, direct_io=direct_io)
    assert _files(out) == _files(clean)
