"""What a user reads: one set of nouns across convert, inspect, verify and demo; a progress bar in the units of the
sizes beside it that ends at 100 %; Ctrl-C that says how to resume; a converted checkpoint named as the README
names it; the README's Python snippet, run as written."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hostile_inputs import cli, converted, pristine
from nvfp4_megamoe.convert import api
from nvfp4_megamoe.convert.verify import verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _readme_python() -> str:
    """The README's Python snippet (the first ``python`` block after "Run a converted checkpoint in Python")."""
    after = README[README.index("Run a converted checkpoint in Python"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_the_readme_python_snippet_runs_as_written(tmp_path_factory, tmp_path, monkeypatch):
    (tmp_path / "out").symlink_to(converted(tmp_path_factory, "flash"))  # the snippet loads "out"
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(_readme_python(), "README.md", "exec"), names)  # noqa: S102 - the documented code, as a user runs it
    vocab = names["model"].config.vocab_size
    logits, next_logits = names["logits"], names["next_logits"]
    assert tuple(logits.shape) == (*names["input_ids"].shape, vocab)
    assert tuple(next_logits.shape) == (len(names["next_ids"]), vocab)
    assert bool(logits.isfinite().all()) and bool(next_logits.isfinite().all())


def test_convert_inspect_and_verify_count_in_the_same_words(tmp_path_factory, tmp_path):
    out = tmp_path / "out"
    words = cli("convert", pristine(tmp_path_factory, "flash"), out, "--no-progress", "--dense", "nvfp4").output
    kinds = "(lossless 36, lossy 138, passthrough 112)"
    tensors = f"286 tensors {kinds}"
    matrices = "NVFP4 matrices: 58 (12 routed-expert stacks, 46 dense; lossless 12, lossy 46)"
    assert f"wrote 1 shard, {tensors}" in words and matrices in words, words
    inspected = cli("inspect", out).output
    assert tensors in inspected and matrices in inspected, inspected
    assert f"tensors: 286 {kinds}" in cli("verify", out, "--no-progress", "--fast").output


def test_the_demo_prints_the_rule_table_once(tmp_path):
    result = cli("demo", "--workdir", tmp_path / "demo")
    assert result.exit_code == 0, result.output
    assert result.output.count("per rule:") == 1 and result.output.count("passthrough.norm") == 1, result.output
    # the conversion's result, and inspect's: the routed experts' stacks alone (the default keeps the dense FP8)
    assert result.output.count("NVFP4 matrices: 12 (12 routed-expert stacks, 0 dense;") == 2, result.output


def test_a_converted_checkpoint_is_named_as_the_readme_names_it(tmp_path_factory):
    assert "format 1, Hopper layout" in README
    for target, words in (("sm100", "format 1, canonical layout (--target sm100)"),
                          ("sm90", "format 1, Hopper layout (--target sm90)")):
        out = converted(tmp_path_factory, "flash", **({"target": target} if target != "sm100" else {}))
        assert cli("inspect", out).output.splitlines()[0] == f"{out}: converted, {words}"


def test_the_progress_bar_counts_in_mb_and_ends_at_100_percent(tmp_path_factory, tmp_path, monkeypatch):
    bars = {}

    class Recorded(api.tqdm):
        def close(self):  # tqdm closes a bar again when it is collected: the first close counts
            bars.setdefault(id(self), (self.n, self.total, self.unit_divisor))
            super().close()

    monkeypatch.setattr(api, "tqdm", Recorded)
    api.convert_checkpoint(pristine(tmp_path_factory, "flash"), tmp_path / "out", shard_size=2_000_000,
                           target="sm90", progress=True)
    (n, total, divisor), = bars.values()
    assert n == total > 0 and divisor == 1000  # MB, like the sizes the plan prints


def test_ctrl_c_says_how_to_resume(tmp_path_factory, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "nvfp4_megamoe.convert.cli", "convert", str(pristine(tmp_path_factory, "flash")),
           str(out), "--shard-size", "500KB", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(5):  # a tiny conversion can finish before the signal lands: then it was not interrupted, again
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 120
        # the progress journal is made just before the first unit runs: from then on the run is under way
        while not (out / ".nvfp4_progress.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)  # as Ctrl-C does
        stderr = proc.communicate(timeout=120)[1]
        if proc.returncode != 0:
            break
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted:" in stderr and "--resume" in stderr, stderr
    assert not (out / "model.safetensors.index.json").exists()
    resumed = cli("convert", pristine(tmp_path_factory, "flash"), out, "--shard-size", "500KB", "--no-progress",
                  "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert verify_checkpoint(out, progress=False, fast=True).ok


def test_ctrl_c_in_any_command_exits_130(monkeypatch, tmp_path_factory):
    from nvfp4_megamoe.convert import verify

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify, "verify_checkpoint", interrupted)
    result = cli("verify", converted(tmp_path_factory, "flash"))
    assert result.exit_code == 130 and "interrupted" in result.output and "Aborted" not in result.output


def test_warmup_says_what_it_needs(tmp_path_factory, tmp_path, monkeypatch):
    """``nvfp4-convert warmup`` builds the kernel cache ahead of a serving start: refused clearly where it cannot
    (a folder that is no conversion, the cache turned off, no H100/H200 here)."""
    from hostile_inputs import refused

    from nvfp4_megamoe.runtime.hopper import hopper_available
    out = converted(tmp_path_factory, "flash")
    refused(cli("warmup", tmp_path / "missing"), "missing")
    monkeypatch.setenv("NVFP4_MEGAMOE_KERNEL_CACHE", "0")
    refused(cli("warmup", out), "cache is off")
    monkeypatch.setenv("NVFP4_MEGAMOE_KERNEL_CACHE", str(tmp_path / "kc"))
    if not hopper_available("cuda"):
        refused(cli("warmup", out), "sm_90")
