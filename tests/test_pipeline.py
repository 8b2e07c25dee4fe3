"""The converter's pieces on several workers (convert/pipeline.py): the same bytes, shards and manifest, whatever
the number of workers, and the timings of a run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.synth import write_synthetic
from nvfp4_megamoe.convert.timing import format_run


@pytest.mark.parametrize("variant,extra", [("modelopt", {}), ("flash", {"out_of_range_blocks": 3})])
def test_conversion_is_deterministic_whatever_the_workers(tmp_path, variant, extra):
    """Shards and manifest (error figures summed over experts converted on several threads included) are byte for
    byte the same with one worker and with several."""
    src = write_synthetic(tmp_path / "src", preset="tiny", variant=variant, **extra)
    a = convert_checkpoint(src, tmp_path / "a", progress=False, workers=1, shard_size=400_000)
    b = convert_checkpoint(src, tmp_path / "b", progress=False, workers=5, shard_size=400_000)
    assert len(a.manifest["shards"]) > 1 and a.manifest["shards"] == b.manifest["shards"]
    for name in list(a.manifest["shards"]) + ["nvfp4_manifest.json"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert extra == {} or any(not e["lossless"] and "error" in e for e in a.manifest["tensors"].values())


def test_timings_say_where_the_time_went(tmp_path):
    """``--timings`` writes wall and CPU seconds per stage and per thread group, and the run's serial steps around
    the pipeline; a worker's busy time fits in the run; a folder that does not exist is refused before anything is
    converted."""
    src = write_synthetic(tmp_path / "src", preset="tiny", variant="flash")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--no-progress", "--workers", "3",
                                  "--timings", str(tmp_path / "t.json")])
    assert r.exit_code == 0, r.output
    t = json.loads((tmp_path / "t.json").read_text())
    assert {"read", "check", "convert", "write", "piece", "hash-output"} <= set(t["stages"])
    workers = t["threads"]["convert"]
    assert 1 <= workers["threads"] <= 3 and all(0 < b <= t["wall_s"] for b in workers["busy_s"])
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert t["stages"]["read"]["calls"] >= len(index["weight_map"])  # every source tensor, copies in pieces
    run = t["run"]  # the whole run: the serial steps before the pipeline, one after the other, then the pipeline
    assert {"open-source", "check-output", "import-torch", "plan", "prepare-output"} <= set(run["phases"])
    assert run["pipeline_s"] == t["wall_s"] and 0 < run["began_s"] < run["reported_s"]
    unaccounted = run["reported_s"] - run["began_s"] - sum(run["phases"].values()) - run["pipeline_s"]
    assert -0.01 < unaccounted < 0.25, run
    line = format_run(t, run["reported_s"] + 0.5)
    assert line.startswith("run (s): start and imports") and "output and exit 0.50" in line, line
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out2"), "--timings",
                                  str(tmp_path / "missing" / "t.json")])
    assert r.exit_code == 2 and "does not exist" in r.output and not (tmp_path / "out2").exists()


def test_shards_hashed_side_by_side_give_each_file_its_sha256(tmp_path, monkeypatch):
    """Several shards fill and hash at once (four hash threads, whatever this machine's CPUs): every shard's
    recorded sha256 is hashlib's over the finished file, and the bytes are those of a run hashing on one thread."""
    import hashlib

    from nvfp4_megamoe.convert import api

    src = write_synthetic(tmp_path / "src", preset="tiny", variant="flash")
    one = convert_checkpoint(src, tmp_path / "one", progress=False, workers=1, shard_size=300_000)
    monkeypatch.setattr(api, "hash_threads", lambda: 4)
    four = convert_checkpoint(src, tmp_path / "four", progress=False, workers=4, shard_size=300_000)
    assert len(four.manifest["shards"]) > 4 and four.manifest == one.manifest
    for name, entry in four.manifest["shards"].items():
        data = (tmp_path / "four" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and data == (tmp_path / "one" / name).read_bytes()
