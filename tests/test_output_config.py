"""The converted ``config.json`` says what the checkpoint now is (format 1's ``quantization_config``), keeps the
source's block under another key, and a foreign quantisation file (ModelOpt's ``hf_quant_config.json``) is kept
under another name: an engine that reads them cannot take format 1 for the source's format."""

from __future__ import annotations

import json
import re

import pytest

from hostile_inputs import INDEX, converted, pristine
from nvfp4_megamoe.convert.output_config import (QUANT_METHOD, RENAMED, SOURCE_KEY, converted_config,
                                                 source_config)
from nvfp4_megamoe.convert.synth import VARIANTS, synthetic_config


@pytest.mark.parametrize("variant", VARIANTS)
def test_source_config_inverts_converted_config(variant):
    source = synthetic_config("tiny", variant)
    block = {"quant_method": QUANT_METHOD}
    out = converted_config(source, block)
    assert out["quantization_config"] is block and out[SOURCE_KEY] == source["quantization_config"]
    assert list(source_config(out).items()) == list(source.items())  # keys, values and their order
    bare = {k: v for k, v in source.items() if k != "quantization_config"}  # a source without a block
    assert SOURCE_KEY not in converted_config(bare, block)
    assert list(source_config(converted_config(bare, block)).items()) == list(bare.items())


def _nvfp4_matrices(out) -> set[str]:
    names = json.loads((out / INDEX).read_text())["weight_map"]
    return {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}


def _covered(patterns: list[str], prefixes: set[str]) -> set[str]:
    regexes = [re.compile(re.escape(p).replace(r"\*", "[0-9]+")) for p in patterns]
    return {n for n in prefixes if any(r.fullmatch(n) for r in regexes)}


def _configs(src, out) -> tuple[dict, dict]:
    return json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())


def test_a_conversion_describes_format_1_and_keeps_the_source_block(tmp_path_factory):
    src, out = pristine(tmp_path_factory, "flash"), converted(tmp_path_factory, "flash", dense="nvfp4")
    cfg, source = _configs(src, out)
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["format"], q["group_size"], q["layout"], q["target"]) == \
           (QUANT_METHOD, 1, 16, "canonical", "sm100")
    assert source["quantization_config"]["quant_method"] == "fp8"  # what the converted config must no longer say
    assert cfg[SOURCE_KEY] == source["quantization_config"] and source_config(cfg) == source
    matrices = _nvfp4_matrices(out)  # every NVFP4 matrix (X.weight_scale present), dense and routed
    assert _covered(q["nvfp4_linears"], matrices) == matrices
    assert "layers.*.ffn.experts.w13" in q["nvfp4_linears"] and "layers.*.attn.wq_a" in q["nvfp4_linears"]
    assert "fp8_linears" not in q and "renamed_source_files" not in q


def test_modelopt_with_kept_fp8_on_the_hopper_layout(tmp_path_factory):
    src = pristine(tmp_path_factory, "modelopt")
    out = converted(tmp_path_factory, "modelopt", dense="keep", target="sm90")
    cfg, source = _configs(src, out)
    q = cfg["quantization_config"]
    assert (q["layout"], q["target"]) == ("hopper-row-tiles", "sm90")
    assert not (out / "hf_quant_config.json").exists()
    for name, kept in RENAMED.items():
        assert (out / kept).read_bytes() == (src / name).read_bytes()
    assert q["renamed_source_files"] == RENAMED
    assert _covered(q["nvfp4_linears"], _nvfp4_matrices(out)) == _nvfp4_matrices(out)
    weights = json.loads((out / INDEX).read_text())["weight_map"]
    fp8 = {n.removesuffix(".scale") for n in weights if n.endswith(".scale")}
    assert fp8 and _covered(q["fp8_linears"], fp8) == fp8 and "layers.*.attn.wq_a" in q["fp8_linears"]
    assert q["fp8_format"] == {"weight": "F8_E4M3", "weight_block_size": [128, 128], "scale": ["F8_E8M0"]}
    assert q["kept_activation_scales"] == ["layers.*.ffn.experts.w13.input_scale", "layers.*.ffn.experts.w2.input_scale"]
    assert cfg[SOURCE_KEY] == source["quantization_config"] and source_config(cfg) == source
