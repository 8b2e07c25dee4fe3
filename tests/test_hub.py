"""Hub sources end to end: the real ``huggingface_hub`` client against a Hub-protocol server on 127.0.0.1.

The server (tests/hub_server.py) serves a synthetic checkpoint as a model repository. Nothing
here mocks the client: requests go over HTTP through ``HfApi.model_info``,
``parse_safetensors_file_metadata`` (ranged reads) and ``hf_hub_download``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import huggingface_hub.constants as hf_constants
from nvfp4_megamoe.convert.api import STAGED_AHEAD, STAGING_DIR, convert_checkpoint
from nvfp4_megamoe.convert.errors import SourceError
from nvfp4_megamoe.convert.hub import HubSource
from nvfp4_megamoe.convert.inspect import inspect_checkpoint
from nvfp4_megamoe.convert.output_config import source_config

sys.path.insert(0, str(Path(__file__).parent))
from cli_process import answers  # noqa: E402
from hub_server import HubServer  # noqa: E402
from synth_checkpoints import writable_copy  # noqa: E402

SHARD = 1_500_000  # small output shards: several per run


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _shards(out: Path) -> dict[str, str]:
    return {p.name: _sha(p) for p in sorted(out.glob("model-*.safetensors"))}


@pytest.fixture(scope="module")
def ckpt(synth_checkpoints) -> Path:
    return synth_checkpoints.source("flash")


@pytest.fixture(scope="module")
def local_out(synth_checkpoints) -> Path:
    return synth_checkpoints.converted("flash", shard_size=SHARD).output


@pytest.fixture(scope="module")
def hub(ckpt):
    with HubServer() as server:
        server.add("org/tiny", ckpt)
        server.add("org/private", ckpt, token="secret-token")
        yield server


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    """Point huggingface_hub at the test server (env vars, and the constants it read at import)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    hub.log.clear()
    return cache


def test_dry_run_reads_only_index_and_headers(hub, hub_env, tmp_path, ckpt):
    result = convert_checkpoint("org/tiny", tmp_path / "out", dry_run=True, progress=False, shard_size=SHARD)
    gets = hub.downloads()
    assert gets, "the headers are read from the server"
    for path, rng in gets:  # only ranged reads of the first bytes, never a whole shard
        assert rng is not None and rng.startswith("bytes=0-") or rng.startswith("bytes=8-"), (path, rng)
    assert not (tmp_path / "out").exists()
    assert not list(hub_env.rglob("*.safetensors"))
    local = convert_checkpoint(ckpt, tmp_path / "unused", dry_run=True, progress=False, shard_size=SHARD)
    assert [[o.name for o in s] for s in result.plan.shards] == [[o.name for o in s] for s in local.plan.shards]


def test_hub_conversion_is_byte_identical_to_local(hub, hub_env, tmp_path, ckpt, local_out):
    repo = hub.repos["org/tiny"]
    out = tmp_path / "out"
    result = convert_checkpoint("org/tiny", out, shard_size=SHARD, progress=False)
    assert _shards(out) == _shards(local_out)
    src = result.manifest["source"]
    assert src["kind"] == "hub" and src["repo_id"] == "org/tiny" and src["ref"] == "main"
    assert src["revision"] == repo.commit and len(src["revision"]) == 40  # docs/format.md: the resolved commit
    for name, entry in src["files"].items():
        assert entry == {"size": (ckpt / name).stat().st_size, "sha256": _sha(ckpt / name)}
        assert entry["sha256"] == repo.sha256(name)
    assert source_config(json.loads((out / "config.json").read_text())) == json.loads((ckpt / "config.json").read_text())
    assert (out / "tokenizer.json").exists()
    # Every request after the model info is pinned to the resolved commit (config.json is fetched by the
    # branch name, so the cache learns refs/main, and checked to come from that commit).
    resolves = [p for m, p, _ in hub.log if "/resolve/" in p and not p.endswith("/config.json")]
    assert resolves and all(f"/resolve/{repo.commit}/" in p for p in resolves)
    # Shards were downloaded into the (kept) Hugging Face cache.
    assert len(list(hub_env.rglob("model-*.safetensors"))) == len(src["files"])


def test_revision_is_pinned_and_checked(hub, hub_env, tmp_path):
    repo = hub.repos["org/tiny"]
    r = convert_checkpoint("org/tiny", tmp_path / "a", revision=repo.commit, dry_run=True, progress=False)
    assert r.plan.units
    with pytest.raises(SourceError, match="no such revision"):
        convert_checkpoint("org/tiny", tmp_path / "b", revision="v9-does-not-exist", dry_run=True, progress=False)
    with pytest.raises(SourceError, match="no such model repository"):
        convert_checkpoint("org/absent", tmp_path / "c", dry_run=True, progress=False)


def test_hub_errors_name_a_revision_only_when_one_was_given(hub, hub_env, tmp_path):
    with pytest.raises(SourceError) as missing:
        convert_checkpoint("org/absent", tmp_path / "a", progress=False)
    assert str(missing.value).startswith(f"org/absent on {hub.endpoint}: no such model repository")
    assert "@" not in str(missing.value).split(" on ")[0] and "read as a Hub repo id" in str(missing.value)
    with pytest.raises(SourceError) as wrong:
        convert_checkpoint("org/tiny", tmp_path / "b", revision="v9", progress=False)
    assert str(wrong.value).startswith(f"org/tiny@v9 on {hub.endpoint}: no such revision")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_owner_folder_here_makes_owner_name_a_local_path(hub, hub_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()  # ``org/tiny`` is now a mistyped local path, not the Hub repository
    for call in (lambda: convert_checkpoint("org/tiny", tmp_path / "out", progress=False),
                 lambda: inspect_checkpoint("org/tiny")):
        with pytest.raises(SourceError, match=r"org/tiny: no such folder\. 'org' exists here"):
            call()
    assert not hub.log, "no request reaches the Hub"
    assert not (tmp_path / "out").exists()


def test_inspect_reads_a_hub_repository_by_its_headers(hub, hub_env, tmp_path, ckpt, local_out):
    hub.add("org/converted", local_out)
    for repo, local in (("org/tiny", ckpt), ("org/converted", local_out)):
        remote = inspect_checkpoint(repo)
        assert remote.pop("path") == f"{repo}@{hub.repos[repo].commit}"
        mine = inspect_checkpoint(local)
        mine.pop("path")
        assert remote == mine
    assert not list(hub_env.rglob("*.safetensors")), "no shard is downloaded"
    for path, rng in hub.downloads():
        assert rng is not None and rng.startswith(("bytes=0-", "bytes=8-")), (path, rng)
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(hub_env), "HF_HUB_OFFLINE": "0"}
    run, missing = answers(["inspect", "org/converted"], ["inspect", "org/tiny", "--revision", "v9"], env=env)
    assert run["exit_code"] == 0 and "converted" in run["output"] and not run["torch"], run
    assert missing["exit_code"] == 1 and missing["output"].startswith("error: org/tiny@v9 on "), missing
    assert not missing["torch"]


def test_token_comes_from_hf_token(hub, hub_env, tmp_path, monkeypatch):
    with pytest.raises(SourceError, match="HF_TOKEN"):
        convert_checkpoint("org/private", tmp_path / "a", dry_run=True, progress=False)
    monkeypatch.setenv("HF_TOKEN", "secret-token")
    r = convert_checkpoint("org/private", tmp_path / "b", dry_run=True, progress=False)
    assert r.plan.units


def test_no_keep_source_holds_a_few_shards(hub, hub_env, tmp_path, local_out, monkeypatch):
    out = tmp_path / "out"
    staged_counts = []
    fetch = HubSource.fetch

    def counting_fetch(self, file):
        fetch(self, file)
        staged_counts.append(len(list((out / STAGING_DIR).glob("*.safetensors"))))

    monkeypatch.setattr(HubSource, "fetch", counting_fetch)
    result = convert_checkpoint("org/tiny", out, shard_size=SHARD, progress=False, keep_source=False)
    n_files = len(result.manifest["source"]["files"])
    assert n_files >= 6 and len(staged_counts) == n_files
    assert max(staged_counts) <= STAGED_AHEAD + 2 < n_files  # a few shards, not the checkpoint
    assert not (out / STAGING_DIR).exists()
    assert not list(hub_env.rglob("*.safetensors"))  # nothing in the HF cache either
    assert _shards(out) == _shards(local_out)


def test_interrupted_hub_run_resumes_without_redownloading(hub, hub_env, tmp_path, local_out, monkeypatch):
    out = tmp_path / "out"
    fetch = HubSource.fetch
    calls = []

    def failing_fetch(self, file):
        calls.append(file)
        if len(calls) == 6:
            raise SourceError(f"{file}: simulated network failure")
        fetch(self, file)

    monkeypatch.setattr(HubSource, "fetch", failing_fetch)
    with pytest.raises(SourceError, match="simulated"):
        convert_checkpoint("org/tiny", out, shard_size=SHARD, progress=False, keep_source=False, workers=1)
    assert not (out / "model.safetensors.index.json").exists()
    finished = _shards(out)
    assert finished, "some output shards were finished before the failure"
    monkeypatch.setattr(HubSource, "fetch", fetch)
    hub.log.clear()
    result = convert_checkpoint("org/tiny", out, shard_size=SHARD, progress=False, keep_source=False, resume=True)
    assert result.skipped_shards == len(finished)
    assert _shards(out) == _shards(local_out)
    local_manifest = json.loads((local_out / "nvfp4_manifest.json").read_text())
    assert result.manifest["shards"] == local_manifest["shards"]
    assert result.manifest["tensors"] == local_manifest["tensors"]
    full_gets = [p for p, r in hub.downloads() if r is None]
    assert len(full_gets) < len(result.manifest["source"]["files"])  # finished work was not fetched again


def test_offline_mode_uses_the_cache(hub, hub_env, tmp_path, local_out, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        with pytest.raises(SourceError, match="HF_HUB_OFFLINE"):
            convert_checkpoint("org/tiny", tmp_path / "a", dry_run=True, progress=False)
    convert_checkpoint("org/tiny", tmp_path / "online", shard_size=SHARD, progress=False)  # fills the cache
    hub.log.clear()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    result = convert_checkpoint("org/tiny", tmp_path / "offline", shard_size=SHARD, progress=False)
    assert hub.log == []  # not a single request
    assert _shards(tmp_path / "offline") == _shards(local_out)
    assert result.manifest["source"]["revision"] == hub.repos["org/tiny"].commit
    online = json.loads((tmp_path / "online" / "nvfp4_manifest.json").read_text())
    assert result.manifest["source"]["files"] == online["source"]["files"]


def test_corrupt_download_is_refused(hub, hub_env, tmp_path, ckpt):
    folder = writable_copy(ckpt, tmp_path / "repo")
    repo = hub.add("org/corrupt", folder)
    bad = sorted(folder.glob("model-*.safetensors"))[2].name
    repo.lfs_sha256_override[bad] = "0" * 64
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=f"{bad}.*sha256") as info:
        convert_checkpoint("org/corrupt", out, shard_size=SHARD, progress=False)
    assert "0" * 64 in str(info.value)
    assert not (out / "model.safetensors.index.json").exists()


def test_index_naming_missing_or_outside_files_is_refused_before_download(hub, hub_env, tmp_path, ckpt):
    for i, target in enumerate(["model-00099-of-00099.safetensors", "../secrets.safetensors"]):
        folder = writable_copy(ckpt, tmp_path / f"repo{i}")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"]["embed.weight"] = target
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        hub.add(f"org/bad{i}", folder)
        hub.log.clear()
        with pytest.raises(SourceError, match=target.replace(".", r"\.")):
            convert_checkpoint(f"org/bad{i}", tmp_path / f"out{i}", progress=False)
        assert not hub.downloads(), "no shard byte is requested"
        assert not (tmp_path / f"out{i}").exists()


def test_cli_reads_hf_endpoint_from_the_environment(hub, hub_env, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(hub_env), "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-m", "nvfp4_megamoe.convert.cli", "convert", "org/tiny",
                           str(tmp_path / "out"), "--dry-run", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "shard" in proc.stdout and "dry run" in proc.stdout
    assert any(m == "GET" and p.startswith("/api/models/org/tiny") for m, p, _ in hub.log)


def test_unit_spanning_two_shards_keeps_both_until_done(hub, hub_env, tmp_path, ckpt, local_out, monkeypatch):
    """Move one expert of layer 1 into the last shard: the layer's expert unit reads two files, so the
    last file is fetched early and must stay staged until the MTP units (its other readers) finish."""
    from safetensors.torch import load_file, save_file

    folder = writable_copy(ckpt, tmp_path / "repo")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    moved = [n for n in index["weight_map"] if n.startswith("layers.1.ffn.experts.3.")]
    src_file, dst_file = index["weight_map"][moved[0]], sorted(set(index["weight_map"].values()))[-1]
    a, b = load_file(str(folder / src_file)), load_file(str(folder / dst_file))
    for n in moved:
        b[n] = a.pop(n)
        index["weight_map"][n] = dst_file
    save_file(a, str(folder / src_file), metadata={"format": "pt"})
    save_file(b, str(folder / dst_file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    hub.add("org/spanning", folder)

    released = []
    release = HubSource.release

    def spy_release(self, file):
        released.append(file)
        release(self, file)

    monkeypatch.setattr(HubSource, "release", spy_release)
    out = tmp_path / "out"
    convert_checkpoint("org/spanning", out, shard_size=SHARD, progress=False, keep_source=False, workers=3)
    assert _shards(out) == _shards(local_out)  # same tensors, so the same output
    assert sorted(released) == sorted(set(index["weight_map"].values()))  # each released once, all released
    assert released[-1] == dst_file  # kept while any unit still needed it
