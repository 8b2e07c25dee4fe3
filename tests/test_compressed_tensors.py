"""compressed-tensors NVFP4 sources (llm-compressor ``nvfp4-pack-quantized``), checked against the spec.

Outputs are read with the real safetensors library and un-transformed with the index formulas of
docs/format.md (the helpers of tests/test_convert.py), not with the converter's own inverses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.inspect import inspect_checkpoint
from nvfp4_megamoe.convert.synth import synthetic_config
from nvfp4_megamoe.convert.verify import verify_checkpoint

from synth_checkpoints import writable_copy
from test_convert import Checkpoint, assert_mxfp4_scales_exact, e4m3, routed_expert_parts
from test_verify import _named, _poke, _where

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _reciprocal_f32(x: float) -> float:
    return float(1.0 / torch.tensor(x, dtype=torch.float32))


@pytest.fixture(scope="module")
def ct(synth_checkpoints) -> tuple[Checkpoint, Checkpoint, dict, Path]:
    """Source, conversion, its manifest, and the conversion's folder (shared, read-only)."""
    src, out = synth_checkpoints.converted("ct")
    manifest = json.loads((out / "nvfp4_manifest.json").read_text())
    return Checkpoint(src), Checkpoint(out), manifest, out


def test_source_is_compressed_tensors_shaped(ct):
    src, _, _, _ = ct
    cfg = json.loads((src.root / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == (4, "float", "tensor_group", 16)
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    name = "layers.1.ffn.experts.0.w1"
    assert src.get(f"{name}.weight_packed").dtype == torch.uint8
    assert src.get(f"{name}.weight_packed").shape == (I, H // 2)
    assert src.get(f"{name}.weight_scale").dtype == torch.float8_e4m3fn
    assert src.get(f"{name}.weight_scale").shape == (I, H // 16)
    for k in ("weight_global_scale", "input_global_scale"):
        t = src.get(f"{name}.{k}")
        assert t.dtype == torch.float32 and t.shape == (1,)
    assert f"{name}.weight" not in src.names() and "mtp.0.ffn.experts.0.w1.scale" in src.names()  # MTP stays MXFP4
    # The dequant x = e2m1 * e4m3 / gs reproduces a weight whose amax maps to 6 * 448.
    gs = float(src.get(f"{name}.weight_global_scale"))
    packed = src.get(f"{name}.weight_packed")
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(I, H)  # low nibble = even element
    vals = E2M1[(codes & 7).long()] * torch.where(codes & 8 != 0, -1.0, 1.0)
    x = vals.reshape(I, -1, 16) * (e4m3(src.get(f"{name}.weight_scale")).float() / gs).unsqueeze(-1)
    assert 0.5 * 448 * 6 < float(x.abs().max()) * gs <= 448 * 6 * 1.01
    assert synthetic_config("tiny", "ct")["quantization_config"]["ignore"]


def test_nibbles_scale_bytes_identical_and_alpha_is_reciprocal(ct):
    src, out, _, _ = ct
    checked_ct = checked_mx = 0
    for layer, name, rows, w_out, s_out, alpha in routed_expert_parts(src, out):
        if layer.startswith("mtp."):  # MXFP4 MTP experts: effective scales exact
            assert_mxfp4_scales_exact(src, name, rows, w_out, s_out, alpha)
            checked_mx += 1
            continue
        assert torch.equal(w_out, src.get(f"{name}.weight_packed")), name
        assert torch.equal(s_out, src.get(f"{name}.weight_scale").view(torch.uint8)), name
        gs = float(src.get(f"{name}.weight_global_scale"))
        assert alpha == _reciprocal_f32(gs), name  # float32(1 / gs), correctly rounded
        assert abs(alpha * gs - 1.0) <= 2.0**-24, name
        checked_ct += 1
    assert checked_ct > 0 and checked_mx > 0
    cfg = json.loads((src.root / "config.json").read_text())
    for i in range(cfg["num_hidden_layers"]):  # each half of w13 keeps its own global scale
        alpha = out.get(f"layers.{i}.ffn.experts.w13.alpha")
        assert not torch.equal(alpha[:, 0], alpha[:, 1])


def test_manifest_is_honest_about_non_power_of_two_scales(ct):
    src, out, manifest, _ = ct
    e = manifest["tensors"]["layers.1.ffn.experts.w13.weight"]
    assert e["lossless"] is False and e["inexact_blocks"] == 0
    assert e["inexact_alphas"] == 2 * 8  # tiny: 8 experts x (w1, w3), none a power of two
    assert 0 <= e["unrecoverable_global_scales"] <= e["inexact_alphas"]
    assert 0 < e["error"]["rel_fro"] < 1e-6 and e["error"]["cosine"] > 0.99999
    assert manifest["tensors"]["mtp.0.ffn.experts.w13.weight"]["lossless"] is True
    assert manifest["rule_counts"]["routed.ct_nvfp4.weight_packed"] > 0
    assert e["transform"][0].startswith("codes and scales kept")


def test_input_global_scale_is_stacked_unchanged(ct):
    src, out, manifest, _ = ct
    n_exp = json.loads((src.root / "config.json").read_text())["n_routed_experts"]
    w13, w2 = out.get("layers.1.ffn.experts.w13.input_global_scale"), out.get("layers.1.ffn.experts.w2.input_global_scale")
    assert w13.dtype == torch.float32 and w13.shape == (n_exp, 2) and w2.shape == (n_exp,)
    for e in range(n_exp):
        for j, p in enumerate(("w1", "w3")):
            want = src.get(f"layers.1.ffn.experts.{e}.{p}.input_global_scale").reshape(())
            assert w13[e, j].view(torch.int32) == want.view(torch.int32)
        assert w2[e].view(torch.int32) == src.get(f"layers.1.ffn.experts.{e}.w2.input_global_scale").reshape(()).view(torch.int32)
    assert "layers.1.ffn.experts.w13.input_scale" not in out.names()
    assert manifest["tensors"]["layers.1.ffn.experts.w13.input_global_scale"]["transform"] == ["stack_input_scales"]


def test_inspect_and_cli_know_the_variant(ct, tmp_path):
    src, _, _, _ = ct
    assert "compressed-tensors" in inspect_checkpoint(src.root)["variant"]
    res = CliRunner().invoke(main, ["synth", str(tmp_path / "s"), "--variant", "ct"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "s" / "config.json").is_file()


def test_verify_passes_and_catches_a_flipped_byte(ct, tmp_path):
    _, _, _, converted = ct
    rep = verify_checkpoint(converted, progress=False)
    assert rep.ok, [str(f) for f in rep.failures]
    assert rep.round_trip
    t = rep.tensors["layers.1.ffn.experts.w13.weight"]
    assert t.kind == "lossy" and t.source_format == "ct_nvfp4"
    assert rep.tensors["layers.1.ffn.experts.w2.input_global_scale"].checked == "round trip"
    res = CliRunner().invoke(main, ["verify", "--no-progress", str(converted)])
    assert res.exit_code == 0, res.output
    for tensor, where in (("layers.1.ffn.experts.w13.weight", "middle"),
                          ("layers.2.ffn.experts.w2.weight_scale", "first"),
                          ("layers.1.ffn.experts.w13.alpha", "first"),
                          ("layers.1.ffn.experts.w13.input_global_scale", "first")):
        out = writable_copy(converted, tmp_path / tensor)
        shard, start, nbytes = _where(out, tensor)
        _poke(shard, start + (nbytes // 2 if where == "middle" else 0))
        rep = verify_checkpoint(out, fast=True, progress=False)
        assert not rep.ok and _named(rep, tensor), (tensor, [str(f) for f in rep.failures])
        res = CliRunner().invoke(main, ["verify", "--no-progress", "--fast", str(out)])
        assert res.exit_code != 0 and tensor in res.output


def test_power_of_two_global_scales_are_lossless(synth_checkpoints, tmp_path):
    """With every weight_global_scale a power of two, 1/gs is exact: the path is bit-exact and verify agrees."""
    src = writable_copy(synth_checkpoints.source("ct"), tmp_path / "src")
    for f in sorted(src.glob("model-*.safetensors")):
        tensors = load_file(f)
        changed = False
        for name, t in tensors.items():
            if name.endswith(".weight_global_scale"):
                tensors[name] = torch.tensor([2.0 ** round(math.log2(float(t)))], dtype=torch.float32)
                changed = True
        if changed:
            save_file(tensors, f, metadata={"format": "pt"})
    convert_checkpoint(src, tmp_path / "out", progress=False)
    manifest = json.loads((tmp_path / "out" / "nvfp4_manifest.json").read_text())
    e = manifest["tensors"]["layers.1.ffn.experts.w13.weight"]
    assert e["lossless"] is True and "error" not in e
    assert e["inexact_alphas"] == 0 and e["unrecoverable_global_scales"] == 0
    out = Checkpoint(tmp_path / "out")
    gs = float(Checkpoint(src).get("layers.1.ffn.experts.3.w3.weight_global_scale"))
    assert float(out.get("layers.1.ffn.experts.w13.alpha")[3, 1]) * gs == 1.0
    rep = verify_checkpoint(tmp_path / "out", progress=False)
    assert rep.ok, [str(f) for f in rep.failures]
    assert rep.tensors["layers.1.ffn.experts.w13.weight"].kind == "lossless"


def test_missing_global_scale_is_refused(synth_checkpoints, tmp_path):
    src = writable_copy(synth_checkpoints.source("ct"), tmp_path / "src")
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    gone = "layers.2.ffn.experts.4.w3.weight_global_scale"
    f = src / idx["weight_map"].pop(gone)
    tensors = load_file(f)
    del tensors[gone]
    save_file(tensors, f, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    res = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--no-progress"])
    assert res.exit_code != 0
    assert "layers.2.ffn.experts.4.w3" in res.output
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
