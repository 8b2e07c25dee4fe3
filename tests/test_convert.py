"""The converter end to end on synthetic checkpoints, checked against the format spec alone.

Outputs are read with the real safetensors library and un-transformed here with the index
formulas of docs/format.md (not with the converter's own inverse functions).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.errors import OutputError, PlanError
from nvfp4_megamoe.convert.inspect import inspect_checkpoint
from nvfp4_megamoe.convert.output_config import source_config

from numeric import rel_err
from synth_checkpoints import writable_copy

VARIANTS = ("flash", "pro", "base", "modelopt")


class Checkpoint:
    """All tensors of a safetensors checkpoint folder, opened lazily through its index."""

    def __init__(self, root: Path):
        self.root = root
        self.weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
        self._handles = {}

    def names(self) -> set[str]:
        return set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        f = self.weight_map[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(self.root / f), "pt")
        return self._handles[f].get_tensor(name)


def spec_unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m = torch.arange(rows).unsqueeze(1)
    kb = torch.arange(cols).unsqueeze(0)
    off = ((m // 128) * math.ceil(cols / 4) + kb // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + kb % 4
    return flat[off]


def spec_deinterleave(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.arange(fused.shape[0])
    is_gate = (r // 8) % 2 == 0
    return fused[r[is_gate]], fused[r[~is_gate]]


def e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).double()


def e8m0(b: torch.Tensor) -> torch.Tensor:
    exponent = b.view(torch.uint8).to(torch.int64) - 127
    return torch.ldexp(torch.ones(b.shape, dtype=torch.float64), exponent)  # exact powers of two


def _manifest(out: Path) -> dict:
    return json.loads((out / "nvfp4_manifest.json").read_text())


@pytest.fixture(scope="module")
def converted(synth_checkpoints) -> dict[str, tuple[Checkpoint, Checkpoint, dict]]:
    out = {}
    for variant in VARIANTS:
        src, conv = synth_checkpoints.converted(variant)
        out[variant] = (Checkpoint(src), Checkpoint(conv), _manifest(conv))
    return out


def _expert_layers(cfg: dict) -> list[str]:
    return [f"layers.{i}" for i in range(cfg["num_hidden_layers"])] + \
        [f"mtp.{i}" for i in range(cfg.get("num_nextn_predict_layers", 0))]


def routed_expert_parts(src: Checkpoint, out: Checkpoint):
    """Every routed-expert part of a conversion, un-swizzled and de-interleaved by the spec's own formulas:
    yields (layer, source part name, rows, packed codes, scale bytes, alpha), after checking each stacked
    tensor's dtype and shape (alpha [E, 2] for w13, [E] for w2)."""
    cfg = json.loads((src.root / "config.json").read_text())
    hidden, inter, n_exp = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    for layer in _expert_layers(cfg):
        for fused, parts, rows, cols in (("w13", ("w1", "w3"), inter, hidden), ("w2", ("w2",), hidden, inter)):
            base = f"{layer}.ffn.experts.{fused}"
            weight, scale, alpha = out.get(f"{base}.weight"), out.get(f"{base}.weight_scale"), out.get(f"{base}.alpha")
            assert weight.dtype == torch.uint8 and weight.shape == (n_exp, len(parts) * rows, cols // 2)
            assert alpha.dtype == torch.float32 and alpha.shape == ((n_exp, 2) if len(parts) == 2 else (n_exp,))
            alpha = alpha.reshape(n_exp, -1)
            for e in range(n_exp):
                s = spec_unswizzle(scale[e], len(parts) * rows, cols // 16)
                w_parts = spec_deinterleave(weight[e]) if len(parts) == 2 else (weight[e],)
                s_parts = spec_deinterleave(s) if len(parts) == 2 else (s,)
                for j, (p, w_out, s_out) in enumerate(zip(parts, w_parts, s_parts)):
                    yield layer, f"{layer}.ffn.experts.{e}.{p}", rows, w_out, s_out, float(alpha[e, j])


def assert_mxfp4_scales_exact(src: Checkpoint, name: str, rows: int, w_out, s_out, alpha: float) -> None:
    """An MXFP4 part: codes copied, and its effective scales (E4M3 byte x alpha) the source's powers of two on
    every non-zero 32-block (all-zero blocks may take any scale)."""
    assert torch.equal(w_out, src.get(f"{name}.weight").view(torch.uint8)), name
    eff = e4m3(s_out) * alpha
    want = e8m0(src.get(f"{name}.scale")).repeat_interleave(2, dim=1)
    codes = torch.stack((w_out & 7, (w_out >> 4) & 7), -1).reshape(rows, -1, 32)
    nonzero = (codes != 0).any(-1).repeat_interleave(2, dim=1)
    assert torch.equal(eff[nonzero], want[nonzero]), name


@pytest.mark.parametrize("variant", ["flash", "pro", "modelopt"])
def test_expert_nibbles_and_scales_follow_the_spec(converted, variant):
    src, out, _ = converted[variant]
    checked_mx = checked_nv = 0
    for _layer, name, rows, w_out, s_out, alpha in routed_expert_parts(src, out):
        if f"{name}.scale" in src.names():  # MXFP4: exact powers of two on non-zero blocks
            assert_mxfp4_scales_exact(src, name, rows, w_out, s_out, alpha)
            checked_mx += 1
        else:  # ModelOpt: codes, scale bytes and each half's weight_scale_2 kept exactly
            assert torch.equal(w_out, src.get(f"{name}.weight").view(torch.uint8)), name
            assert torch.equal(s_out, src.get(f"{name}.weight_scale").view(torch.uint8)), name
            assert alpha == float(src.get(f"{name}.weight_scale_2")), name
            checked_nv += 1
    assert checked_mx > 0
    assert variant != "modelopt" or checked_nv > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_passthrough_is_byte_identical_and_manifest_covers_every_source(converted, variant):
    src, out, manifest = converted[variant]
    sources = {s for entry in manifest["tensors"].values() for s in entry["sources"]}
    assert sources == src.names()
    assert set(manifest["tensors"]) == out.names()
    copies = [n for n, e in manifest["tensors"].items() if e["transform"] == ["copy"]]
    assert copies
    for name in copies:
        a, b = src.get(name), out.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_index_shards_and_metadata(converted, variant):
    _, out, manifest = converted[variant]
    files = set(out.weight_map.values())
    assert files == set(manifest["shards"])
    for f in files:
        with safe_open(str(out.root / f), "pt") as h:
            meta = h.metadata()
            assert meta["format"] == "pt" and meta["nvfp4_format_version"] == "1"
            assert set(h.keys()) == {n for n, g in out.weight_map.items() if g == f}
    source = Path(manifest["source"]["path"])
    for copied in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out.root / copied).read_bytes() == (source / copied).read_bytes()
    # config.json: the source's, with a format-1 quantization_config (tests/test_output_config.py)
    assert source_config(json.loads((out.root / "config.json").read_text())) == json.loads((source / "config.json").read_text())


def test_dense_fp8_requantized_with_measured_error(synth_checkpoints):
    """``--dense nvfp4``: the dense FP8 linears requantised, their error measured and recorded."""
    conversion = synth_checkpoints.converted("flash", dense="nvfp4")
    src, out, manifest = Checkpoint(conversion.source), Checkpoint(conversion.output), _manifest(conversion.output)
    entry = manifest["tensors"]["layers.0.attn.wq_a.weight"]
    assert entry["lossless"] is False and 0 < entry["error"]["rel_fro"] < 0.15
    w, s = src.get("layers.0.attn.wq_a.weight"), src.get("layers.0.attn.wq_a.scale")
    ref = w.double() * e8m0(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    packed, alpha = out.get("layers.0.attn.wq_a.weight"), float(out.get("layers.0.attn.wq_a.alpha"))
    scales = e4m3(spec_unswizzle(out.get("layers.0.attn.wq_a.weight_scale"), packed.shape[0], packed.shape[1] // 8))
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(packed.shape[0], -1).long()
    deq = (grid[codes].reshape(packed.shape[0], -1, 16) * scales.unsqueeze(-1)).reshape(ref.shape) * alpha
    assert rel_err(deq, ref) == pytest.approx(entry["error"]["rel_fro"], rel=1e-3)
    shared = out.get("layers.0.ffn.shared_experts.w13.weight")
    assert shared.shape[0] == 2 * src.get("layers.0.ffn.shared_experts.w1.weight").shape[0]


def test_the_default_keeps_every_dense_fp8_tensor_as_released(converted):
    """The default (``--dense keep``): every non-expert tensor byte-identical to the source, nothing lossy but
    what the routed experts' cast records (none here), the shared expert under its source names."""
    s, o, manifest = converted["flash"]
    assert manifest["options"]["dense"] == "keep"
    kept = [n for n in s.names() if ".ffn.experts." not in n]
    assert any(n.endswith("attn.wq_a.weight") for n in kept) and any(n.endswith("attn.wq_a.scale") for n in kept)
    for name in kept:
        assert torch.equal(s.get(name).view(torch.uint8), o.get(name).view(torch.uint8)), name
    assert not [n for n, e in manifest["tensors"].items() if e.get("lossless") is False]
    assert "layers.0.ffn.experts.w13.weight" in o.names()
    assert not any(n.startswith("layers.0.ffn.shared_experts.w13") for n in o.names())


def test_out_of_range_blocks_are_counted_and_measured(synth_checkpoints):
    manifest = _manifest(synth_checkpoints.converted("flash", synth={"out_of_range_blocks": 3}).output)
    entry = manifest["tensors"]["layers.0.ffn.experts.w13.weight"]
    assert entry["inexact_blocks"] == 3 and entry["lossless"] is False
    assert 0 < entry["error"]["rel_fro"] < 1e-2
    assert manifest["tensors"]["layers.0.ffn.experts.w2.weight"]["lossless"] is True


def test_small_shard_size_splits_output(synth_checkpoints):
    _, out = synth_checkpoints.converted("flash", shard_size=500_000)
    manifest = _manifest(out)
    assert len(manifest["shards"]) > 3
    for f, info in manifest["shards"].items():
        assert info["size"] == (out / f).stat().st_size
        assert info["size"] <= 500_000 or len(info["tensors"]) == 1


def test_conversion_is_deterministic(synth_checkpoints, tmp_path):
    src, first = synth_checkpoints.converted("modelopt")
    a = _manifest(first)["shards"]
    b = convert_checkpoint(src, tmp_path / "b", progress=False).manifest["shards"]
    assert {k: v["sha256"] for k, v in a.items()} == {k: v["sha256"] for k, v in b.items()}


def _add_tensor(root: Path, name: str, tensor: torch.Tensor) -> None:
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(root / shard))
    tensors[name] = tensor
    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    index["weight_map"][name] = shard
    index_path.write_text(json.dumps(index))


def _remove_tensors(root: Path, names: list[str]) -> None:
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in {index["weight_map"][n] for n in names}:
        tensors = {k: v for k, v in load_file(str(root / shard)).items() if k not in names}
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    for n in names:
        del index["weight_map"][n]
    index_path.write_text(json.dumps(index))


def _assert_nothing_written(out: Path) -> None:
    assert not (out / "model.safetensors.index.json").exists()
    assert not out.exists() or not any(out.iterdir())


def test_unknown_tensor_is_refused_before_writing(synth_checkpoints, tmp_path):
    src = writable_copy(synth_checkpoints.source("flash"), tmp_path / "src")
    _add_tensor(src, "layers.0.attn.mystery_proj.weight", torch.randn(4, 4))
    _add_tensor(src, "layers.1.ffn.experts.0.w1.bias", torch.randn(4))
    with pytest.raises(PlanError) as info:
        convert_checkpoint(src, tmp_path / "out", progress=False)
    msg = str(info.value)
    assert "layers.0.attn.mystery_proj.weight" in msg and "layers.1.ffn.experts.0.w1.bias" in msg
    assert "model-00001-of-" in msg  # the file is named
    _assert_nothing_written(tmp_path / "out")
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out2")])
    assert result.exit_code != 0 and "mystery_proj" in result.output
    _assert_nothing_written(tmp_path / "out2")


def test_missing_siblings_and_experts_are_all_listed(synth_checkpoints, tmp_path):
    src = writable_copy(synth_checkpoints.source("flash"), tmp_path / "src")
    _remove_tensors(src, ["layers.0.ffn.experts.1.w1.scale",          # weight without scale
                          "layers.1.ffn.experts.2.w3.weight", "layers.1.ffn.experts.2.w3.scale",  # w1 without w3
                          "layers.0.attn.wq_a.scale"])                 # dense weight without scale
    with pytest.raises(PlanError) as info:
        convert_checkpoint(src, tmp_path / "out", progress=False)
    msg = str(info.value)
    for expected in ("layers.0.ffn.experts.1.w1.weight", "layers.0.attn.wq_a.weight"):
        assert expected in msg
    _assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("removed,named", [
    ("layers.2.ffn.experts.", r"layers\.2\.ffn\.experts"),                     # a layer without experts
    ("layers.1.ffn.experts.3.", r"layers\.1\.ffn\.experts\.3\.w1\.weight"),  # one expert missing
])
def test_missing_experts_are_refused(synth_checkpoints, tmp_path, removed, named):
    src = writable_copy(synth_checkpoints.source("flash"), tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    _remove_tensors(src, [n for n in index["weight_map"] if n.startswith(removed)])
    with pytest.raises(PlanError, match=named):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path / "out")


def test_dry_run_prints_plan_and_writes_nothing(synth_checkpoints, tmp_path):
    src = synth_checkpoints.source("modelopt")
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "routed.nvfp4.weight" in result.output and "routed.mxfp4.weight" in result.output
    assert "shard     1" in result.output and "nothing written" in result.output
    assert not (tmp_path / "out").exists()


def test_existing_conversion_is_not_overwritten(synth_checkpoints, tmp_path):
    src = synth_checkpoints.source("flash")
    convert_checkpoint(src, tmp_path / "out", progress=False)
    before = (tmp_path / "out" / "nvfp4_manifest.json").read_bytes()
    with pytest.raises(OutputError, match="already holds"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "nvfp4_manifest.json").read_bytes() == before


@pytest.mark.parametrize("variant,words", [("flash", "official"), ("base", "Base"), ("modelopt", "ModelOpt")])
def test_inspect_detects_variant(synth_checkpoints, variant, words):
    src = synth_checkpoints.source(variant)
    assert words in inspect_checkpoint(src)["variant"]
    result = CliRunner().invoke(main, ["inspect", str(src)])
    assert result.exit_code == 0 and words in result.output


def test_demo_runs(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    assert "NVFP4 matrices:" in result.output and (tmp_path / "demo" / "converted" / "nvfp4_manifest.json").is_file()
