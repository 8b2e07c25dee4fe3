"""Tests for convert/verify.py: clean conversions verify, every kind of damage is found and named (CPU, fast)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nvfp4_megamoe.convert import verify_roundtrip
from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.safetensors_header import read_header
from nvfp4_megamoe.convert.verify import VerifyReport, verify_checkpoint
from nvfp4_megamoe.kernels.swizzle import swizzled_shape
from nvfp4_megamoe.runtime.format import INDEX_FILE, MANIFEST_FILE

from synth_checkpoints import writable_copy

# (variant, convert options, synth options)
# (the cases with NVFP4 dense layers, ``--dense nvfp4``, have the most converted tensors to check and to damage)
NVFP4 = {"dense": "nvfp4"}
CASES = {
    "flash": ("flash", {"shard_size": 1_000_000, **NVFP4}, {"out_of_range_blocks": 3}),
    "pro": ("pro", NVFP4, {}),
    "base": ("base", NVFP4, {}),
    "modelopt": ("modelopt", NVFP4, {}),
    "flash-keep": ("flash", {"dense": "keep"}, {}),   # the default
    # I = 96: w13 has 192 rows (padded to 256), w2 6 scale columns (padded to 8).
    "padded": ("flash", NVFP4, {"moe_intermediate_size": 96}),
    # routed experts' weights in Hopper row tiles
    "flash-sm90": ("flash", {"target": "sm90", **NVFP4}, {"out_of_range_blocks": 3}),
    "modelopt-sm90": ("modelopt", {"target": "sm90", **NVFP4}, {}),
}
CLEAN = ["flash", "pro", "base", "modelopt", "flash-keep", "flash-sm90", "modelopt-sm90"]


@pytest.fixture(scope="module")
def converted(synth_checkpoints):
    """(source, output) of a case, from the session's shared, read-only checkpoints (tests/conftest.py)."""

    def get(case: str) -> tuple[Path, Path]:
        variant, conv, syn = CASES[case]
        return synth_checkpoints.converted(variant, synth=syn, **conv)

    return get


def _copy(out: Path, tmp_path: Path) -> Path:
    return writable_copy(out, tmp_path / "copy")


def _where(out: Path, tensor: str) -> tuple[Path, int, int]:
    """(shard path, absolute start, nbytes) of an output tensor."""
    shard = out / json.loads((out / INDEX_FILE).read_text())["weight_map"][tensor]
    info = read_header(shard).tensors[tensor]
    return shard, info.start, info.nbytes


def _poke(path: Path, offset: int, xor: int = 0x01, value: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value if value is not None else old ^ xor]))


def _cli(*args: str):
    return CliRunner().invoke(main, ["verify", "--no-progress", *map(str, args)])


def _named(rep: VerifyReport, tensor: str) -> list[str]:
    return [f.message for f in rep.failures if f.tensor == tensor]


@pytest.mark.parametrize("case", CLEAN)
def test_clean_conversion_verifies(converted, case, tmp_path):
    src, out = converted(case)
    report = tmp_path / "report.json"
    res = _cli(out, "--json", report)
    assert res.exit_code == 0, res.output
    assert "OK: every check held" in res.output
    data = json.loads(report.read_text())
    assert data["ok"] and data["round_trip"] and data["hashed"] and not data["failures"]
    assert all(t["checked"] == "round trip" for t in data["tensors"].values())
    lossy = {n: t for n, t in data["tensors"].items() if t["error"]}
    for name, t in lossy.items():
        assert t["error"]["rel_fro"] <= t["bound"]["rel_fro"] and t["error"]["cosine"] >= t["bound"]["cosine"]
        assert t["manifest_error"]["rel_fro"] == pytest.approx(t["error"]["rel_fro"], rel=1e-3)
    kinds = {t["kind"] for t in data["tensors"].values()}
    assert "passthrough" in kinds and ("lossless" in kinds or case == "base")
    if case == "flash":  # the out-of-range MXFP4 blocks are counted and bounded
        w13 = data["tensors"]["layers.0.ffn.experts.w13.weight"]
        assert w13["kind"] == "lossy" and w13["inexact_blocks"] == 3 and w13["source_format"] == "mxfp4"
    if case == "modelopt":
        assert data["tensors"]["layers.1.ffn.experts.w13.input_scale"]["checked"] == "round trip"


def test_sm90_target_tiles_the_routed_weights_and_nothing_else(converted, tmp_path):
    """--target sm90 writes every tensor as the canonical conversion does, except the routed experts' packed
    weights, which are the same bytes in row tiles; a manifest that hides the tiling fails verification."""
    from safetensors import safe_open

    from nvfp4_megamoe.kernels.row_tiles import tile_rows

    def tensors(out: Path) -> dict:
        found = {}
        for shard in sorted(out.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                found.update({k: f.get_tensor(k) for k in f.keys()})
        return found

    (_, canon), (_, tiled_out) = converted("flash"), converted("flash-sm90")
    canonical, tiled = tensors(canon), tensors(tiled_out)
    assert canonical.keys() == tiled.keys()
    routed = [n for n in canonical if ".ffn.experts.w" in n and n.endswith(".weight")]
    assert len(routed) == 2 * (len({n.rsplit(".experts", 1)[0] for n in routed}))
    for name, t in canonical.items():
        want = tile_rows(t) if name in routed else t
        assert tiled[name].equal(want), name
        # random codes: tiling moves bits (a row of one k-tile, tiny's w2 with I = 128, keeps its bytes in place but
        # not the bits of its words)
        assert name not in routed or not tiled[name].equal(t)
    manifest = json.loads((tiled_out / MANIFEST_FILE).read_text())
    assert manifest["options"]["target"] == "sm90" and "routed_weight_layout" in manifest["target"]
    # version 2: readers from before the Hopper nibble order refuse it instead of reading the tiles as row-major
    assert manifest["format_version"] == 2 and json.loads((canon / MANIFEST_FILE).read_text())["format_version"] == 1
    assert "row_tiles(16 rows x 64 bytes, hopper nibble order)" in manifest["tensors"][routed[0]]["transform"]

    lying = _copy(tiled_out, tmp_path)  # say sm100: the tiled bytes no longer round-trip to the source
    m = json.loads((lying / MANIFEST_FILE).read_text())
    m["options"]["target"] = "sm100"
    (lying / MANIFEST_FILE).write_text(json.dumps(m))
    rep = verify_checkpoint(lying, progress=False)
    assert not rep.ok and _named(rep, routed[0])


def test_first_row_tile_layout_is_named_by_verify_and_refused_by_the_runtime(converted, tmp_path):
    """A --target sm90 checkpoint whose manifest names the first row-tile step (words in format 1's order, before the
    Hopper nibble order): verify says to re-convert, and loading it is a FormatError that says so too."""
    from nvfp4_megamoe.runtime import load_model
    from nvfp4_megamoe.runtime.format import ROW_TILES_STEP, ROW_TILES_STEP_V0, FormatError

    _, tiled_out = converted("flash-sm90")
    old = _copy(tiled_out, tmp_path)
    m = json.loads((old / MANIFEST_FILE).read_text())
    routed = [n for n, rec in m["tensors"].items() if ROW_TILES_STEP in rec["transform"]]
    assert routed
    for name in routed:
        m["tensors"][name]["transform"] = [ROW_TILES_STEP_V0 if t == ROW_TILES_STEP else t
                                           for t in m["tensors"][name]["transform"]]
    (old / MANIFEST_FILE).write_text(json.dumps(m))
    rep = verify_checkpoint(old, progress=False, fast=True)
    assert not rep.ok and any("re-convert" in msg for msg in _named(rep, routed[0]))
    with pytest.raises(FormatError, match="re-convert"):
        load_model(old, device="cpu")


def test_sm90_target_refuses_shapes_it_cannot_tile(synth_checkpoints, tmp_path):
    """I = 96: w2's 96 inputs are not whole 128-K tiles; the plan names the tensors and nothing is written."""
    from nvfp4_megamoe.convert.errors import PlanError

    src = synth_checkpoints.source("flash", moe_intermediate_size=96)
    with pytest.raises(PlanError) as err:
        convert_checkpoint(src, tmp_path / "out", progress=False, target="sm90")
    assert "layers.0.ffn.experts.*.w2" in str(err.value) and "--target sm100" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_structure_only_without_source(converted, tmp_path):
    src, out = converted("flash")
    out = _copy(out, tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["source"]["path"] = str(tmp_path / "gone")
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    rep = verify_checkpoint(out, progress=False)  # the round trip was asked for and cannot be done: a failure
    assert not rep.ok and not rep.round_trip and "--structure-only" in str(rep.failures[0])
    rep = verify_checkpoint(out, progress=False, structure_only=True)
    assert rep.ok and not rep.round_trip and rep.hashed
    rep = verify_checkpoint(out, source=src, progress=False, fast=True)
    assert rep.ok and rep.round_trip and not rep.hashed


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("case,tensor,pick", [
    ("flash", "layers.1.ffn.experts.w13.weight", "middle"),   # MXFP4 codes
    ("flash", "layers.1.ffn.experts.w2.weight_scale", "first-scale-of-expert-3"),
    ("base", "layers.2.ffn.experts.w13.weight", "middle"),    # FP8 -> NVFP4 requantised codes
    ("base", "layers.2.attn.wq_a.weight_scale", "first"),
    ("modelopt", "layers.1.ffn.experts.w13.weight_scale", "first-scale-of-expert-3"),  # reconciled scales
    ("modelopt", "layers.1.ffn.experts.w2.input_scale", "first"),
    ("flash", "layers.0.attn_norm.weight", "middle"),          # passthrough
    ("flash-keep", "layers.0.attn.wq_a.weight", "middle"),     # FP8 kept as is
])
def test_flipped_byte_is_found_and_named(converted, tmp_path, case, tensor, pick, fast):
    _, out = converted(case)
    out = _copy(out, tmp_path)
    shard, start, nbytes = _where(out, tensor)
    offset = {"middle": start + nbytes // 2, "first": start,
              "first-scale-of-expert-3": start + 3 * (nbytes // read_header(shard).tensors[tensor].shape[0])}[pick]
    _poke(shard, offset)
    rep = verify_checkpoint(out, fast=fast, progress=False)
    assert not rep.ok
    assert _named(rep, tensor), [str(f) for f in rep.failures]
    assert rep.tensors[tensor].ok is False
    if not fast:
        assert any(f.shard == shard.name and "sha256" in f.message for f in rep.failures)
    res = _cli(out, *(["--fast"] if fast else []))
    assert res.exit_code != 0 and tensor in res.output and "FAILED" in res.output


def test_flipped_byte_without_source_is_caught_by_the_hash(converted, tmp_path):
    src, out = converted("pro")
    out = _copy(out, tmp_path)
    shard, start, nbytes = _where(out, "layers.1.ffn.experts.w2.weight")
    _poke(shard, start + nbytes // 3)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["source"]["path"] = str(tmp_path / "gone")
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    rep = verify_checkpoint(out, progress=False)
    assert not rep.ok and any(f.shard == shard.name and "sha256" in f.message for f in rep.failures)


def test_nan_scale_bad_padding_and_nan_alpha_found_without_source(converted, tmp_path):
    _, out = converted("base")
    out = _copy(out, tmp_path)
    scale = "layers.1.ffn.experts.w2.weight_scale"
    shard, start, nbytes = _where(out, scale)
    _poke(shard, start + 5, value=0x7F)  # a NaN E4M3 byte in expert 0's real scales
    alpha = "layers.2.attn.wq_a.alpha"
    ashard, astart, _ = _where(out, alpha)
    _poke(ashard, astart + 3, value=0x7F)  # float32 bits 0x7FC0.... = NaN
    _poke(ashard, astart + 2, value=0xC0)
    rep = verify_checkpoint(out, source=Path("/nonexistent-source-folder"), fast=True, progress=False)
    assert any("NaN E4M3" in m for m in _named(rep, scale)), [str(f) for f in rep.failures]
    assert any("finite and positive" in m for m in _named(rep, alpha))


def test_swizzle_padding_must_be_zero(converted, tmp_path):
    _, out = converted("padded")
    assert verify_checkpoint(out, fast=True, progress=False).ok
    out = _copy(out, tmp_path)
    header_tensors = {n: i for f in out.glob("*.safetensors") for n, i in read_header(f).tensors.items()}
    padded = None
    for n, info in header_tensors.items():
        if not n.endswith(".weight_scale"):
            continue
        w = header_tensors[n[: -len("_scale")]]
        rows, kb = w.shape[-2], w.shape[-1] * 2 // 16
        if swizzled_shape(rows, kb) != (rows, kb):
            padded, geom = n, (rows, kb)
            break
    assert padded is not None, "expected a padded scale tensor"
    name = padded
    shard, start, nbytes = _where(out, name)
    rows, kb = geom
    rp, kp = swizzled_shape(rows, kb)
    # Offset of a padding element (row rows if rows < rp, else column kb) in the swizzled layout.
    m, c = (rows, 0) if rows < rp else (0, kb)
    off = ((m // 128) * (kp // 4) + c // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + c % 4
    _poke(shard, start + off, value=0x38)
    rep = verify_checkpoint(out, fast=True, progress=False)
    assert any("padding" in m for m in _named(rep, name)), [str(f) for f in rep.failures]


def test_missing_and_truncated_shards_are_named(converted, tmp_path):
    _, out = converted("flash")
    out = _copy(out, tmp_path)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with open(shards[2], "r+b") as f:
        f.truncate(os.path.getsize(shards[2]) - 100)
    for fast in (False, True):
        rep = verify_checkpoint(out, fast=fast, progress=False)
        assert not rep.ok
        msgs = {f.shard: f.message for f in rep.failures if f.tensor is None}
        assert "missing" in msgs.get(shards[1].name, ""), [str(f) for f in rep.failures]
        assert any(f.shard == shards[2].name and "truncated" in f.message for f in rep.failures)
    res = _cli(out, "--fast")
    assert res.exit_code != 0 and shards[1].name in res.output and shards[2].name in res.output


def test_stray_shard_and_index_disagreement(converted, tmp_path):
    _, out = converted("modelopt")
    out = _copy(out, tmp_path)
    shutil.copy(next(out.glob("model-*.safetensors")), out / "model-00009-of-00009.safetensors")
    index = json.loads((out / INDEX_FILE).read_text())
    victim = "layers.0.ffn.gate.weight"
    del index["weight_map"][victim]
    (out / INDEX_FILE).write_text(json.dumps(index))
    rep = verify_checkpoint(out, fast=True, progress=False)
    assert any(f.shard == "model-00009-of-00009.safetensors" and "stray" in f.message for f in rep.failures)
    assert _named(rep, victim)


def test_manifest_error_record_and_bounds_are_enforced(converted, tmp_path, monkeypatch):
    _, out = converted("base")
    out = _copy(out, tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    name = "layers.0.attn.wq_a.weight"
    manifest["tensors"][name]["error"]["rel_fro"] *= 0.5
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    rep = verify_checkpoint(out, fast=True, progress=False)
    assert any("manifest records rel_fro" in m for m in _named(rep, name))
    monkeypatch.setitem(verify_roundtrip.BOUNDS, "fp8", verify_roundtrip.Bound(rel_fro=0.05, cosine=0.98))
    rep = verify_checkpoint(out, fast=True, progress=False)
    assert any("exceeds the bound" in m for m in _named(rep, "layers.1.attn.wkv.weight"))


def test_lossless_claim_is_checked(converted, tmp_path):
    _, out = converted("flash")
    out = _copy(out, tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    name = "layers.0.ffn.experts.w13.weight"  # has 3 out-of-range blocks, so it is lossy
    manifest["tensors"][name]["lossless"] = True
    manifest["tensors"][name].pop("error")
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    rep = verify_checkpoint(out, fast=True, progress=False)
    assert any("lossless=True" in m for m in _named(rep, name))


def test_not_a_conversion(converted):
    src, _ = converted("modelopt")
    rep = verify_checkpoint(src, progress=False)
    assert not rep.ok and "nvfp4_manifest.json" in str(rep.failures[0])
    res = _cli(src)
    assert res.exit_code != 0 and "not a converted checkpoint" in res.output


def test_header_shape_tampering_is_a_named_failure(converted, tmp_path):
    _, out = converted("modelopt")
    out = _copy(out, tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["tensors"]["layers.1.ffn.experts.w2.weight"]["transform"] = ["copy"]
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    rep = verify_checkpoint(out, fast=True, progress=False)
    assert any("differ from the plan" in m for m in _named(rep, "layers.1.ffn.experts.w2.weight"))
