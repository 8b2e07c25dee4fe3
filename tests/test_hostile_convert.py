"""Hostile and broken input to ``convert`` and ``verify``, tried as a careful user and as an attacker would.

Every case runs the real command line (in-process) on a tiny synthetic checkpoint edited on disk and
holds the refusal contract: a non-zero exit with one ``error:`` paragraph naming the file or tensor, no
traceback, the source unchanged, nothing written or deleted outside the output folder, and nothing left
there that looks complete (no index).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hostile_inputs import (INDEX, MANIFEST, cli, converted, copy_tree, edit_json, header_text, poke, pristine, refused,
                            replace_header, rewrite_shard, shard_of, tree_hash, within)
from nvfp4_megamoe.convert.resume import JOURNAL_FILE
from nvfp4_megamoe.input_files import loads_strict

SMALL_SHARDS = "700KB"  # about ten output shards for the tiny preset


@pytest.fixture
def src(tmp_path_factory, tmp_path) -> Path:
    return copy_tree(pristine(tmp_path_factory, "flash"), tmp_path / "src")


def _convert_refused(src: Path, out: Path, *must_name: str, args: tuple = ()) -> str:
    """``convert SRC OUT`` refused: the contract, the source unchanged, no index in OUT."""
    before = tree_hash(src)
    msg = refused(cli("convert", src, out, "--no-progress", *args), *must_name)
    assert tree_hash(src) == before, "the source was modified"
    assert not (out / INDEX).exists(), "a refused run must not look complete"
    return msg


def _unfinished(src: Path, out: Path) -> str:
    """A run refused part-way, with finished shards kept: NaN in the last source shard (the MTP block)."""
    poke(src, "mtp.0.attn_norm.weight", b"\xc0\x7f", at=2)
    msg = _convert_refused(src, out, "mtp.0.attn_norm.weight", "NaN", args=("--shard-size", SMALL_SHARDS,
                                                                             "--workers", "1"))
    assert json.loads((out / JOURNAL_FILE).read_text())["shards"], "the run should have finished some shards"
    return msg


# ---------------------------------------------------------------------------------- 1. the journal is input


@pytest.mark.parametrize("name", ["../victim.safetensors", "{victim}", "model-00001-of-00002.safetensors/../../victim",
                                  ".nvfp4_progress.json", "model-00001-of-00001.safetensors"])
def test_resume_never_touches_what_the_journal_names_outside_the_run(src, tmp_path, name):
    out = tmp_path / "out"
    _unfinished(src, out)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    name = name.format(victim=victim)
    journal = out / JOURNAL_FILE
    edit_json(journal, lambda j: j["shards"].__setitem__(name, {"size": 8, "sha256": "0" * 64}))
    before_out = tree_hash(out)
    msg = _convert_refused(src, out, "progress journal", "Nothing was deleted", "remove",
                           args=("--shard-size", SMALL_SHARDS, "--resume"))
    assert "not one of this run's" in msg
    assert victim.read_bytes() == b"precious"
    assert tree_hash(out) == before_out, "a refused --resume changed the output folder"


@pytest.mark.parametrize("edit", [
    lambda j: j.__setitem__("shards", ["model-00001-of-00010.safetensors"]),
    lambda j: j["shards"].__setitem__(next(iter(j["shards"])), "done"),
    lambda j: j["shards"].__setitem__(next(iter(j["shards"])), {"size": "12", "sha256": "0" * 64}),
    lambda j: j["units"].__setitem__("layers.9.ffn.experts.w13", {}),
    lambda j: j["units"].__setitem__(next(iter(j["units"])), {"x": 1}),
    lambda j: j["source_sha256"].__setitem__("../../etc/passwd", "0" * 64),
    lambda j: j["identity"].__setitem__("source_files", ["model-00001-of-00008.safetensors"]),
    "wrap",
])
def test_resume_refuses_a_journal_of_wrong_types(src, tmp_path, edit):
    out = tmp_path / "out"
    _unfinished(src, out)
    edit_json(out / JOURNAL_FILE, edit)
    before_out = tree_hash(out)
    _convert_refused(src, out, str(out), args=("--shard-size", SMALL_SHARDS, "--resume"))
    assert tree_hash(out) == before_out


def test_resume_refuses_a_fifo_where_a_finished_shard_should_be(src, tmp_path):
    out = tmp_path / "out"
    _unfinished(src, out)
    shard = out / next(iter(json.loads((out / JOURNAL_FILE).read_text())["shards"]))
    shard.unlink()
    os.mkfifo(shard)
    result = within(60, lambda: cli("convert", src, out, "--no-progress", "--shard-size", SMALL_SHARDS, "--resume"))
    refused(result, shard.name, "FIFO")
    assert shard.exists()


# ---------------------------------------------------------------------------------- 2. canonical indices


def _add_tensors(root: Path, tensors: dict[str, torch.Tensor], shard: str = "model-extra.safetensors") -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    edit_json(root / INDEX, lambda i: i["weight_map"].update({n: shard for n in tensors}))


def _impostor(root: Path, expert: str, layer: str = "1") -> dict[str, torch.Tensor]:
    """A copy of expert 3's w2 (codes changed), named with another spelling of layer ``layer``, expert ``expert``."""
    with safe_open(str(shard_of(root, "layers.1.ffn.experts.3.w2.weight")), "pt") as f:
        w, s = f.get_tensor("layers.1.ffn.experts.3.w2.weight"), f.get_tensor("layers.1.ffn.experts.3.w2.scale")
    return {f"layers.{layer}.ffn.experts.{expert}.w2.weight": (w ^ 0x11).contiguous(),
            f"layers.{layer}.ffn.experts.{expert}.w2.scale": s}


@pytest.mark.parametrize("layer, expert, canonical_hint", [("1", "03", True), ("1", "\u0663", True), ("01", "3", True),
                                                           ("1", "3 ", False), ("1", "+3", False)])
def test_an_impostor_expert_spelled_another_way_is_refused(src, tmp_path, layer, expert, canonical_hint):
    _add_tensors(src, _impostor(src, expert, layer))
    name = f"layers.{layer}.ffn.experts.{expert}.w2.weight"
    msg = _convert_refused(src, tmp_path / "out", name, "matches no rule")
    assert ("not canonical" in msg) == canonical_hint


def test_verify_refuses_a_source_holding_an_impostor(tmp_path_factory, tmp_path):
    src = copy_tree(pristine(tmp_path_factory, "flash"), tmp_path / "src")
    out = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "out")
    _add_tensors(src, _impostor(src, "03"))
    result = cli("verify", out, "--source", src, "--no-progress", "--fast")
    assert result.exit_code == 1 and "experts.03" in result.output and "FAILED" in result.output, result.output


@pytest.mark.parametrize("field, value, expect", [
    ("num_hidden_layers", 4, "layers 4 is beyond what config.json declares (num_hidden_layers = 4)"),
    ("num_hidden_layers", 6, "layers.5"),
    ("num_nextn_predict_layers", 0, "mtp 0 is beyond what config.json declares (num_nextn_predict_layers = 0)"),
])
def test_layers_the_config_does_not_declare_or_misses(src, tmp_path, field, value, expect):
    edit_json(src / "config.json", lambda c: c.__setitem__(field, value))
    msg = _convert_refused(src, tmp_path / "out", expect)
    assert not (tmp_path / "out").exists()
    if value == 6:
        assert "missing: config.json asks for it" in msg


# ---------------------------------------------------------------------------------- 3. values


@pytest.mark.parametrize("variant, tensor, data, what, args", [
    ("flash", "layers.1.attn_norm.weight", b"\xc0\x7f", "NaN/Inf", ()),              # BF16 NaN
    ("flash", "embed.weight", b"\x80\x7f", "NaN/Inf", ()),                           # BF16 +Inf
    ("flash", "layers.2.hc_attn_fn", struct.pack("<f", float("nan")), "NaN/Inf", ()),
    ("flash", "hc_head_base", struct.pack("<f", float("-inf")), "NaN/Inf", ()),
    ("flash", "layers.3.attn.compressor.ape", struct.pack("<f", float("nan")), "NaN/Inf", ()),
    ("flash", "layers.2.attn.kv_norm.weight", b"\x00\xfe", "values beyond +-2**64", ()),    # BF16 -1.7e38
    ("flash", "layers.2.attn.wq_a.weight", b"\x7f", "E4M3 NaN", ("--dense", "keep")),
    ("flash", "layers.2.attn.wq_a.scale", b"\xff", "E8M0 scale bytes 0xFF", ("--dense", "keep")),
    ("flash", "layers.2.attn.wq_a.scale", b"\xfe", "E8M0 scale bytes above 0xF6", ("--dense", "keep")),
    ("flash", "layers.2.attn.wq_a.scale", b"\xf7", "E8M0 scale bytes above 0xF6", ()),
    ("flash", "layers.1.ffn.experts.5.w3.scale", b"\xfe", "E8M0 scale bytes above 0xFC", ()),
    ("flash", "layers.1.ffn.experts.5.w3.scale", b"\xfd", "E8M0 scale bytes above 0xFC", ()),
    ("base", "layers.2.attn.wq_a.scale", struct.pack("<f", 1e36), "values beyond +-2**64", ("--dense", "keep")),
    ("flash", "layers.0.ffn.gate.tid2eid", struct.pack("<q", 8), "indices outside [0, 8)", ()),
    ("flash", "layers.0.ffn.gate.tid2eid", struct.pack("<q", -1), "indices outside [0, 8)", ()),
])
def test_values_a_checkpoint_cannot_hold_are_refused(tmp_path_factory, tmp_path, variant, tensor, data, what, args):
    src = copy_tree(pristine(tmp_path_factory, variant), tmp_path / "src")
    shard = poke(src, tensor, data)
    out = tmp_path / "out"
    _convert_refused(src, out, tensor, what, shard.name, "expected", args=args)
    assert not list(out.glob("*.safetensors")) and not (out / JOURNAL_FILE).exists()


@pytest.mark.parametrize("variant", ["flash", "base", "modelopt"])
def test_the_manifest_is_strict_json(tmp_path_factory, variant):
    out = converted(tmp_path_factory, variant)
    manifest = loads_strict((out / MANIFEST).read_text())  # no NaN/Infinity, no duplicate key
    assert manifest["tensors"]


# ---------------------------------------------------------------------------------- 4. incomplete or inconsistent


@pytest.mark.parametrize("names", [("layers.2.attn_norm.weight",), ("layers.1.attn.wq_a.weight", "layers.1.attn.wq_a.scale"),
                                   ("embed.weight",), ("layers.0.ffn.gate.tid2eid",),
                                   ("layers.2.attn.indexer.compressor.ape",), ("mtp.0.hnorm.weight",)])
def test_a_missing_required_tensor_is_refused_before_anything_is_written(src, tmp_path, names):
    shard = shard_of(src, names[0])
    rewrite_shard(src, shard, lambda t: [t.pop(n) for n in names])
    out = tmp_path / "out"
    msg = _convert_refused(src, out, names[0], "missing")
    assert not out.exists()
    assert "nothing was written" in msg


@pytest.mark.parametrize("tensor, replacement, expect", [
    ("layers.1.attn_norm.weight", torch.ones(256, dtype=torch.int32), "is I32 [256], config.json implies BF16/F16/F32 [256]"),
    ("layers.1.attn_norm.weight", torch.ones(255, dtype=torch.bfloat16), "is BF16 [255]"),
    ("layers.1.ffn.gate.bias", torch.zeros(7), "is F32 [7], config.json implies BF16/F16/F32 [8]"),
    ("hc_head_scale", torch.ones(3), "is F32 [3]"),
    ("layers.1.attn.wq_a.weight", torch.zeros(128, 384, dtype=torch.float8_e4m3fn), "contradicts config.json"),
])
def test_tensors_contradicting_the_config_are_refused(src, tmp_path, tensor, replacement, expect):
    rewrite_shard(src, shard_of(src, tensor), lambda t: t.__setitem__(tensor, replacement))
    _convert_refused(src, tmp_path / "out", tensor, expect)
    assert not (tmp_path / "out").exists()


def _header_edits(text: str) -> dict[str, str]:
    """Malformed variants of a real shard header (``text``), each one edit."""
    obj = json.loads(text)
    first = next(n for n in obj if n != "__metadata__")
    entry = json.dumps(obj[first], separators=(",", ":"))
    begin, end = obj[first]["data_offsets"]

    def with_entry(**fields) -> str:
        return json.dumps({**obj, first: {**obj[first], **fields}})

    return {
        "duplicate tensor key": text.rstrip()[:-1] + f',"{first}":{entry}}}',
        "duplicate field": text.replace('"dtype":', '"dtype":"U8","dtype":', 1),
        "negative shape": with_entry(shape=[-d for d in obj[first]["shape"]]),
        "float shape": with_entry(shape=[float(d) for d in obj[first]["shape"]]),
        "string offsets": with_entry(data_offsets=[str(begin), str(end)]),
        "float offsets": with_entry(data_offsets=[float(begin), float(end)]),
        "three offsets": with_entry(data_offsets=[begin, end, end]),
        "boolean shape": with_entry(shape=[True] * len(obj[first]["shape"])),
        "hole": with_entry(data_offsets=[begin + 1, end + 1]),
        "metadata list": json.dumps({**obj, "__metadata__": ["format", "pt"]}),
        "metadata numbers": json.dumps({**obj, "__metadata__": {"format": 1}}),
        "NaN constant": json.dumps({**obj, "__metadata__": {"format": "pt"}}).replace('"pt"', "NaN", 1),
        "entry not an object": json.dumps({**obj, first: [1, 2]}),
        "unknown dtype": with_entry(dtype="F4"),
        "not an object": json.dumps([obj]),
    }


def test_every_malformed_header_is_refused_and_at_least_what_safe_open_refuses(src, tmp_path):
    shard = shard_of(src, "layers.1.attn_norm.weight")
    original = shard.read_bytes()
    refused_by_safe_open = []
    for what, text in _header_edits(header_text(shard)).items():
        replace_header(shard, text)
        try:
            with safe_open(str(shard), "pt"):
                pass
        except Exception:  # noqa: BLE001 - safetensors raises its own error types
            refused_by_safe_open.append(what)
        msg = _convert_refused(src, tmp_path / "out", shard.name)
        assert "header" in msg or "tensor" in msg, (what, msg)
        shard.write_bytes(original)
    assert len(refused_by_safe_open) >= 10  # the comparison above is not vacuous


# ---------------------------------------------------------------------------------- 5. no traceback


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.pop("n_routed_experts"), "'n_routed_experts' is missing"),
    (lambda c: c.__setitem__("hidden_size", "256"), "'hidden_size' is '256'"),
    (lambda c: c.__setitem__("hidden_size", 256.0), "'hidden_size' is 256.0"),
    (lambda c: c.__setitem__("num_hidden_layers", True), "'num_hidden_layers' is True"),
    (lambda c: c.__setitem__("n_routed_experts", -8), "'n_routed_experts' is -8"),
    (lambda c: c.__setitem__("compress_ratios", "0,0,4"), "'compress_ratios' is '0,0,4'"),
    (lambda c: c.__setitem__("compress_ratios", [0, 0, 4, 128, 5, 0]), "compress ratio 5"),
    (lambda c: c.__setitem__("num_nextn_predict_layers", "1"), "'num_nextn_predict_layers' is '1'"),
    ("wrap", "expected a JSON object"),
])
def test_config_fields_missing_or_of_the_wrong_type(src, tmp_path, edit, field):
    edit_json(src / "config.json", edit)
    _convert_refused(src, tmp_path / "out", "config.json", field)
    assert not (tmp_path / "out").exists()


def test_config_with_a_duplicate_key_is_refused(src, tmp_path):
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"hidden_size": 256', '"hidden_size": 256, "hidden_size": 512', 1))
    _convert_refused(src, tmp_path / "out", "config.json", "duplicate key 'hidden_size'")


@pytest.mark.parametrize("where", ["under-a-file", "in-proc"])
def test_an_output_folder_that_cannot_be_created(src, tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "plain").write_text("a file")
        out = tmp_path / "plain" / "out"
    else:
        out = Path("/proc/nvfp4-megamoe-test/out")
    _convert_refused(src, out, str(out), "cannot create the output folder")


def test_an_os_error_while_copying_files_says_how_to_finish(src, tmp_path, monkeypatch):
    import nvfp4_megamoe.convert.api as api

    def full(a, b):
        raise OSError(errno.ENOSPC, "No space left on device", str(b))

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(api.shutil, "copyfile", full)
        _convert_refused(src, out, "No space left on device", "--resume")
    result = cli("convert", src, out, "--no-progress", "--resume")
    assert result.exit_code == 0, result.output
    assert (out / INDEX).exists() and (out / "tokenizer.json").exists()


def test_verify_json_into_a_missing_folder(tmp_path_factory, tmp_path):
    out = converted(tmp_path_factory, "flash")
    result = cli("verify", out, "--no-progress", "--json", tmp_path / "no" / "such" / "report.json")
    assert result.exit_code == 2 and "Traceback" not in result.output and "does not exist" in result.output
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("size", ["1e400", "0", "1e-3", "0.5B", "abc", "1..2", "-5", "", "e", "5 parsecs"])
def test_shard_size_values_that_are_not_sizes(src, tmp_path, size):
    result = cli("convert", src, tmp_path / "out", "--no-progress", "--shard-size", size)
    assert result.exit_code == 2 and "Traceback" not in result.output and "--shard-size" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_demo_into_a_workdir_an_earlier_demo_used(tmp_path_factory, tmp_path):
    work = tmp_path / "work"
    copy_tree(pristine(tmp_path_factory, "flash"), work / "source")  # what an earlier demo left there
    before = tree_hash(work)
    refused(cli("demo", "--workdir", work), str(work), "source/", "another --workdir")
    assert tree_hash(work) == before


# ---------------------------------------------------------------------------------- 6. verify checks what it says


def test_verify_fails_when_it_cannot_do_the_round_trip(tmp_path_factory, tmp_path):
    out = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "out")
    edit_json(out / MANIFEST, lambda m: m["source"].__setitem__("path", str(tmp_path / "gone")))
    result = cli("verify", out, "--no-progress")
    assert result.exit_code == 1 and "round trip against the source cannot be done" in result.output
    assert "--structure-only" in result.output and "\nOK" not in result.output
    result = cli("verify", out, "--no-progress", "--structure-only")
    assert result.exit_code == 0 and "no round trip" in result.output, result.output
    other = copy_tree(pristine(tmp_path_factory, "flash"), tmp_path / "other")
    poke(other, "layers.1.ffn.experts.2.w1.weight", b"\x77")  # the recorded path now holds another checkpoint
    edit_json(out / MANIFEST, lambda m: m["source"].__setitem__("path", str(other)))
    result = cli("verify", out, "--no-progress", "--fast")
    assert result.exit_code == 1 and "layers.1.ffn.experts.w13.weight" in result.output, result.output
    result = cli("verify", out, "--no-progress", "--structure-only", "--source", other)
    assert result.exit_code == 2 and "Traceback" not in result.output


@pytest.mark.parametrize("edit", [lambda m: m["shards"][next(iter(m["shards"]))].__setitem__("size", [1, 2]),
                                  lambda m: m["shards"][next(iter(m["shards"]))].__setitem__("tensors", 7),
                                  lambda m: m.__setitem__("source", True), lambda m: m.__setitem__("tensors", [])])
def test_verify_reports_a_manifest_of_wrong_types(tmp_path_factory, tmp_path, edit):
    out = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "out")
    edit_json(out / MANIFEST, edit)
    result = cli("verify", out, "--no-progress", "--fast")
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "FAILED" in result.output, result.output


def test_structure_only_still_screens_every_value(tmp_path_factory, tmp_path):
    out = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "out")
    poke(out, "layers.2.ffn_norm.weight", b"\xc0\x7f", at=8)
    result = cli("verify", out, "--no-progress", "--structure-only", "--fast")
    assert result.exit_code == 1 and "layers.2.ffn_norm.weight" in result.output and "NaN/Inf" in result.output


@pytest.mark.parametrize("what", ["shard", MANIFEST, INDEX])
def test_verify_does_not_block_on_a_fifo(tmp_path_factory, tmp_path, what):
    out = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "out")
    path = next(out.glob("model-*.safetensors")) if what == "shard" else out / what
    path.unlink()
    os.mkfifo(path)
    result = within(60, lambda: cli("verify", out, "--no-progress"))
    assert result.exit_code == 1 and "FIFO" in result.output and "Traceback" not in result.output, result.output


# ---------------------------------------------------------------------------------- 8. smaller


def test_names_from_the_checkpoint_are_printed_escaped(src, tmp_path_factory, tmp_path):
    forged = "layers.0.attn_norm.weight\nOK: every check held"
    _add_tensors(src, {forged: torch.ones(256, dtype=torch.bfloat16)})
    msg = _convert_refused(src, tmp_path / "out", repr(forged))
    assert "OK: every check held" not in msg.splitlines()
    out = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "conv")
    edit_json(out / INDEX, lambda i: i["weight_map"].__setitem__(forged, "model-00001-of-00001.safetensors\nOK"))
    result = cli("verify", out, "--no-progress", "--fast")
    assert result.exit_code == 1 and repr(forged) in result.output
    assert not any(line.startswith("OK") for line in result.output.splitlines()), result.output


@pytest.mark.parametrize("inside", ["converted", "."])
def test_converting_into_the_source_folder_or_below_is_refused(src, inside):
    before = tree_hash(src)
    refused(cli("convert", src, src / inside, "--no-progress"), "source folder", "never modified")
    assert tree_hash(src) == before and not (src / "converted").exists()


def test_a_refused_run_says_how_to_go_on(tmp_path_factory, src, tmp_path):
    """No finished shard: nothing is kept, and the same command runs again once the source is fixed. Finished
    shards: they are kept for --resume, and every later refusal says how to start over."""
    out = tmp_path / "early"
    shard = poke(src, "layers.0.attn_norm.weight", b"\xc0\x7f")
    msg = _convert_refused(src, out, "Nothing was kept", "run the same command again")
    assert not (out / JOURNAL_FILE).exists() and not any(out.iterdir())
    shutil.copyfile(pristine(tmp_path_factory, "flash") / shard.name, shard)  # the fix
    assert cli("convert", src, out, "--no-progress").exit_code == 0

    out = tmp_path / "late"
    msg = _unfinished(src, out)
    assert "finished shards" in msg and "--resume" in msg and f"remove {out}" in msg
    shard = shard_of(src, "mtp.0.attn_norm.weight")
    shutil.copyfile(pristine(tmp_path_factory, "flash") / shard.name, shard)  # the fix changes the source
    args = ("--shard-size", SMALL_SHARDS)
    _convert_refused(src, out, "unfinished conversion", f"to start over, remove {out}", args=args)
    _convert_refused(src, out, "source files changed", f"To start over, remove {out}", args=args + ("--resume",))
    shutil.rmtree(out)
    assert cli("convert", src, out, "--no-progress", *args).exit_code == 0


@pytest.mark.parametrize("what, kind", [("shard", "FIFO"), ("shard-dir", "a folder"), ("config.json", "FIFO"),
                                        (INDEX, "FIFO")])
def test_non_regular_source_files_are_reported_as_such(src, tmp_path, what, kind):
    path = {"shard": src / "model-00004-of-00008.safetensors", "shard-dir": src / "model-00004-of-00008.safetensors",
            "config.json": src / "config.json", INDEX: src / INDEX}[what]
    path.unlink()
    if what == "shard-dir":
        path.mkdir()
    else:
        os.mkfifo(path)
    result = within(60, lambda: cli("convert", src, tmp_path / "out", "--no-progress"))
    msg = refused(result, path.name, kind, "not a regular file")
    assert "missing" not in msg and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["fifo-manifest", "mistyped-config"])
def test_inspect_refuses_cleanly(tmp_path_factory, tmp_path, case):
    if case == "fifo-manifest":
        path = copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "out")
        (path / MANIFEST).unlink()
        os.mkfifo(path / MANIFEST)
        expect = "FIFO"
    else:
        path = copy_tree(pristine(tmp_path_factory, "flash"), tmp_path / "src")
        edit_json(path / "config.json", lambda c: c.__setitem__("num_hidden_layers", "5"))
        expect = "'num_hidden_layers' is '5'"
    refused(within(60, lambda: cli("inspect", path)), expect)
