"""Tests for convert/synth.py: the synthetic DeepSeek-V4 checkpoint generator (CPU, fast)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nvfp4_megamoe.convert.synth import (
    PRESETS,
    VARIANTS,
    compress_pattern,
    synthetic_config,
    write_synthetic,
)

_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _load(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    return torch.stack([b & 15, b >> 4], -1).flatten(-2)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    c = _nibbles(packed)
    m = _GRID[(c & 7).long()]
    return torch.where((c & 8) != 0, -m, m)


def _e8m0_exp(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8).to(torch.int32) - 127


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpts(synth_checkpoints) -> dict[str, Path]:
    return {v: synth_checkpoints.source(v) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_files_and_index(ckpts, variant):
    path = ckpts[variant]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        json.loads((path / name).read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards
    cfg = json.loads((path / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    assert len(shards) == L + 3
    assert shards[0] == f"model-00001-of-{L + 3:05d}.safetensors"
    total = 0
    seen = set()
    for fname in shards:
        with safe_open(str(path / fname), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = list(f.keys())
            groups = set()
            for k in keys:
                assert index["weight_map"][k] == fname
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
                groups.add(".".join(k.split(".")[:2]) if k.startswith(("layers.", "mtp.")) else "global")
            assert len(groups) == 1, (fname, groups)  # one layer (or the globals) per shard
            seen |= set(keys)
    assert seen == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    with safe_open(str(path / shards[0]), "pt") as f:
        assert list(f.keys()) == ["embed.weight"]


def test_tokenizer_loads(ckpts):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(ckpts["flash"])
    cfg = json.loads((ckpts["flash"] / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    assert tok("t5 t7").input_ids == [0, 5, 7]
    assert GenerationConfig.from_pretrained(ckpts["flash"]).eos_token_id == 1


def test_refuses_nonempty(tmp_path):
    (tmp_path / "x").write_text("hi")
    with pytest.raises(FileExistsError):
        write_synthetic(tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_config(ckpts, variant):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, DeepseekV4Config, DeepseekV4ForCausalLM

    path = ckpts[variant]
    cfg = AutoConfig.from_pretrained(path)
    assert isinstance(cfg, DeepseekV4Config)
    raw = json.loads((path / "config.json").read_text())
    assert {0, 4, 128} <= set(raw["compress_ratios"])
    assert len(raw["compress_ratios"]) == raw["num_hidden_layers"] + 1
    assert raw["num_hash_layers"] >= 1 and raw["num_nextn_predict_layers"] == 1
    assert raw["index_n_heads"] >= 8
    qc = raw["quantization_config"]
    if variant == "ct":  # compressed-tensors style (tests/test_compressed_tensors.py checks the rest)
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    else:
        assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["scale_fmt"] == "ue8m0"
        assert qc["weight_block_size"] == [128, 128]
        assert qc["expert_dtype"] == ("fp8" if variant == "base" else "fp4")
    if variant == "modelopt":
        assert qc["quant_algo"] == "MIXED_PRECISION" and qc["moe_quant_algo"] == "NVFP4"
        assert qc["group_size"] == 16 and "mtp.*" in qc["ignore"]
        assert len(qc["quantized_layers"]) == raw["num_hidden_layers"]
        json.loads((path / "hf_quant_config.json").read_text())
    if variant == "pro":
        assert raw["compress_ratios"][:3] == [128, 128, 4]
    else:
        assert raw["compress_ratios"][:4] == [0, 0, 4, 128]
    assert cfg.layer_types[: len(raw["compress_ratios"]) - 1]
    assert cfg.mlp_layer_types[0] == "hash_moe"
    with torch.device("meta"):
        DeepseekV4ForCausalLM(cfg)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dtypes_and_shapes(ckpts, variant):
    path = ckpts[variant]
    c = json.loads((path / "config.json").read_text())
    t = _load(path)
    H, V, E, I, K = (c[k] for k in ("hidden_size", "vocab_size", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"))
    hd, nh, ql = c["head_dim"], c["num_attention_heads"], c["q_lora_rank"]
    base = variant == "base"
    scale_dtype = torch.float32 if base else torch.float8_e8m0fnu

    assert t["embed.weight"].dtype == torch.bfloat16 and t["embed.weight"].shape == (V, H)
    assert t["head.weight"].shape == (V, H) and t["norm.weight"].shape == (H,)
    assert t["hc_head_fn"].shape == (4, 4 * H) and t["hc_head_fn"].dtype == torch.float32
    assert t["hc_head_base"].shape == (4,) and t["hc_head_scale"].shape == (1,)
    assert not any(k.startswith("model.") for k in t)

    def fp8(name, out, inp):
        w, s = t[name + ".weight"], t[name + ".scale"]
        assert w.dtype == torch.float8_e4m3fn and w.shape == (out, inp), name
        assert s.dtype == scale_dtype and s.shape == (math.ceil(out / 128), math.ceil(inp / 128)), name

    prefixes = [(f"layers.{i}.", c["compress_ratios"][i], i < c["num_hash_layers"]) for i in range(c["num_hidden_layers"])]
    prefixes.append(("mtp.0.", c["compress_ratios"][-1], False))
    for p, ratio, is_hash in prefixes:
        assert t[p + "hc_attn_fn"].shape == (24, 4 * H) and t[p + "hc_ffn_scale"].shape == (3,)
        assert t[p + "attn.attn_sink"].dtype == torch.float32 and t[p + "attn.attn_sink"].shape == (nh,)
        assert t[p + "attn.q_norm.weight"].shape == (ql,) and t[p + "attn.kv_norm.weight"].shape == (hd,)
        fp8(p + "attn.wq_a", ql, H)
        fp8(p + "attn.wq_b", nh * hd, ql)
        fp8(p + "attn.wkv", hd, H)
        fp8(p + "attn.wo_a", c["o_groups"] * c["o_lora_rank"], nh * hd // c["o_groups"])
        fp8(p + "attn.wo_b", H, c["o_groups"] * c["o_lora_rank"])
        fp8(p + "ffn.shared_experts.w1", I, H)
        fp8(p + "ffn.shared_experts.w2", H, I)
        assert (p + "attn.compressor.ape" in t) == (ratio != 0)
        assert (p + "attn.indexer.wq_b.weight" in t) == (ratio == 4)
        if ratio == 4:
            assert t[p + "attn.compressor.ape"].shape == (4, 2 * hd)
            assert t[p + "attn.compressor.wkv.weight"].dtype == torch.bfloat16
            assert t[p + "attn.compressor.wgate.weight"].shape == (2 * hd, H)
            fp8(p + "attn.indexer.wq_b", c["index_n_heads"] * c["index_head_dim"], ql)
            assert t[p + "attn.indexer.weights_proj.weight"].shape == (c["index_n_heads"], H)
            assert t[p + "attn.indexer.compressor.ape"].shape == (4, 2 * c["index_head_dim"])
            assert t[p + "attn.indexer.compressor.norm.weight"].shape == (c["index_head_dim"],)
        if ratio == 128:
            assert t[p + "attn.compressor.ape"].shape == (128, hd)
            assert t[p + "attn.compressor.wkv.weight"].shape == (hd, H)
        assert t[p + "ffn.gate.weight"].dtype == torch.bfloat16 and t[p + "ffn.gate.weight"].shape == (E, H)
        if is_hash:
            tid = t[p + "ffn.gate.tid2eid"]
            assert p + "ffn.gate.bias" not in t
            assert tid.dtype == torch.int64 and tid.shape == (V, K)
            assert int(tid.min()) >= 0 and int(tid.max()) < E
            assert (tid.sort(dim=1).values.diff(dim=1) != 0).all()  # distinct experts per row
        else:
            assert t[p + "ffn.gate.bias"].dtype == torch.float32 and t[p + "ffn.gate.bias"].shape == (E,)
        fmt = "fp8" if base else ("nvfp4" if variant == "modelopt" and p != "mtp.0." else "mxfp4")
        if variant == "ct" and p != "mtp.0.":
            fmt = "ct_nvfp4"
        for e in range(E):
            for w, (o, i) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
                n = f"{p}ffn.experts.{e}.{w}."
                if fmt == "fp8":
                    fp8(n[:-1], o, i)
                elif fmt == "mxfp4":
                    assert t[n + "weight"].dtype == torch.int8 and t[n + "weight"].shape == (o, i // 2)
                    assert t[n + "scale"].dtype == torch.float8_e8m0fnu and t[n + "scale"].shape == (o, i // 32)
                elif fmt == "ct_nvfp4":
                    assert t[n + "weight_packed"].dtype == torch.uint8 and t[n + "weight_packed"].shape == (o, i // 2)
                    assert t[n + "weight_scale"].dtype == torch.float8_e4m3fn
                    assert t[n + "weight_scale"].shape == (o, i // 16)
                    for k in ("weight_global_scale", "input_global_scale"):
                        assert t[n + k].dtype == torch.float32 and t[n + k].shape == (1,)
                    assert n + "weight" not in t and n + "scale" not in t
                else:
                    assert t[n + "weight"].dtype == torch.uint8 and t[n + "weight"].shape == (o, i // 2)
                    assert t[n + "weight_scale"].dtype == torch.float8_e4m3fn
                    assert t[n + "weight_scale"].shape == (o, i // 16)
                    assert t[n + "weight_scale_2"].dtype == torch.float32 and t[n + "weight_scale_2"].shape == ()
                    assert t[n + "input_scale"].dtype == torch.float32 and t[n + "input_scale"].shape == ()
                    assert n + "scale" not in t
            if fmt == "nvfp4":
                s1 = t[f"{p}ffn.experts.{e}.w1.weight_scale_2"]
                s3 = t[f"{p}ffn.experts.{e}.w3.weight_scale_2"]
                assert float(s1) != float(s3)
    for p in ("mtp.0.",):
        fp8(p + "e_proj", H, H)
        fp8(p + "h_proj", H, H)
        for n in ("enorm", "hnorm", "norm"):
            assert t[f"{p}{n}.weight"].shape == (H,)
        assert t[p + "hc_head_fn"].shape == (4, 4 * H) and t[p + "hc_head_scale"].shape == (1,)

    # No NaN anywhere (E4M3 0x7F/0xFF, E8M0 0xFF, float NaN).
    for k, v in t.items():
        if v.dtype == torch.float8_e4m3fn:
            assert ((v.view(torch.uint8) & 0x7F) != 0x7F).all(), k
        elif v.dtype == torch.float8_e8m0fnu:
            assert (v.view(torch.uint8) != 0xFF).all(), k
        elif v.is_floating_point():
            assert torch.isfinite(v.float()).all(), k
            assert v.float().abs().sum() > 0, k  # never all zeros


def test_mxfp4_properties(ckpts):
    t = _load(ckpts["flash"])
    c = json.loads((ckpts["flash"] / "config.json").read_text())
    H = c["hidden_size"]
    w = t["layers.1.ffn.experts.3.w1.weight"]
    s = t["layers.1.ffn.experts.3.w1.scale"]
    codes = _nibbles(w)
    assert (codes == 8).any()  # -0 present
    k = _e8m0_exp(s)
    assert int(k.max() - k.min()) <= 17 and int(k.max() - k.min()) >= 1
    deq = _e2m1(w) * torch.exp2(k.float()).repeat_interleave(32, 1)
    assert 0.6 < deq.std().item() * math.sqrt(H) < 1.6
    # FP8 dequant magnitude ~1/sqrt(fan_in)
    q = t["layers.1.attn.wq_a.weight"].float() * t["layers.1.attn.wq_a.scale"].float().repeat_interleave(128, 0).repeat_interleave(128, 1)[: t["layers.1.attn.wq_a.weight"].shape[0], :H]
    assert 0.6 < q.std().item() * math.sqrt(H) < 1.6


def test_out_of_range_blocks(tmp_path):
    n = 5
    p = write_synthetic(tmp_path / "o", "tiny", "flash", seed=3, out_of_range_blocks=n)
    t = _load(p)
    k1 = _e8m0_exp(t["layers.0.ffn.experts.0.w1.scale"])
    k3 = _e8m0_exp(t["layers.0.ffn.experts.0.w3.scale"])
    kmax = max(int(k1.max()), int(k3.max()))
    low = (kmax - k3) >= 20
    assert int(low.sum()) == n
    codes = _nibbles(t["layers.0.ffn.experts.0.w3.weight"]).view(k3.shape[0], k3.shape[1], 32)
    assert ((codes & 7) != 0).any(-1)[low].all()  # the lowered blocks are non-zero
    # other experts / layers untouched and in range
    k = _e8m0_exp(t["layers.1.ffn.experts.0.w3.scale"])
    assert int(k.max() - k.min()) <= 17
    # without the option no block is out of range
    q = _load(write_synthetic(tmp_path / "q", "tiny", "flash", seed=3))
    k3q = _e8m0_exp(q["layers.0.ffn.experts.0.w3.scale"])
    assert int(max(int(k1.max()), int(k3q.max())) - k3q.min()) <= 17
    with pytest.raises(ValueError):
        write_synthetic(tmp_path / "b", "tiny", "base", out_of_range_blocks=1)


def test_deterministic(tmp_path):
    a = _load(write_synthetic(tmp_path / "a", "tiny", "flash", seed=7))
    b = _load(write_synthetic(tmp_path / "b", "tiny", "flash", seed=7))
    c = _load(write_synthetic(tmp_path / "c", "tiny", "flash", seed=8))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a if a[k].dtype != torch.int64)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])


def test_config_api():
    cfg = synthetic_config("small", "flash")
    assert cfg["compress_ratios"] == compress_pattern(cfg["num_hidden_layers"], "flash")
    assert cfg["moe_intermediate_size"] % 128 != 0  # a row count that is not a multiple of 128
    assert synthetic_config("tiny", "flash", num_hidden_layers=6)["num_hidden_layers"] == 6
    assert synthetic_config("tiny", "pro")["routed_scaling_factor"] == 2.5
    assert set(PRESETS) >= {"tiny", "small", "flash-layer", "pro-layer"}
    fl = synthetic_config("flash-layer", "flash")  # real layer shapes; writing takes minutes, not tested here
    assert (fl["hidden_size"], fl["moe_intermediate_size"], fl["head_dim"]) == (4096, 2048, 512)
    assert {0, 4, 128} <= set(fl["compress_ratios"]) and len(fl["compress_ratios"]) == 4
    assert synthetic_config("flash-layer", "pro")["compress_ratios"][:2] == [128, 128]
    pl = synthetic_config("pro-layer", "flash")  # real V4-Pro layer shapes, 64 of the 384 experts
    assert (pl["hidden_size"], pl["moe_intermediate_size"], pl["num_attention_heads"], pl["q_lora_rank"],
            pl["o_groups"], pl["index_topk"]) == (7168, 3072, 128, 1536, 16, 1024)
    assert pl["compress_ratios"] == [128, 4, 128, 0]
    with pytest.raises(ValueError):
        synthetic_config("tiny", "flash", hidden_size=100)
    with pytest.raises(ValueError):
        synthetic_config("nope", "flash")


def _dequant_to_bf16(src: Path, dst: Path) -> None:
    """Dequantise a synthetic checkpoint into one BF16 native-named file transformers can load."""
    raw = _load(src)
    out = {}
    for k, v in raw.items():
        if k.endswith((".scale", ".weight_scale", ".weight_scale_2", ".input_scale")) and not k.startswith("hc"):
            if k.endswith(".scale") and k[:-6] + ".weight" not in raw:
                out[k] = v
            continue
        if k.endswith(".weight") and k[:-7] + ".scale" in raw:
            s = raw[k[:-7] + ".scale"].float()
            if v.dtype == torch.int8:
                w = _e2m1(v) * s.repeat_interleave(32, 1)
            else:
                o, i = v.shape
                w = v.float() * s.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
            out[k] = w.to(torch.bfloat16)
        elif k.endswith(".weight") and k[:-7] + ".weight_scale" in raw:
            pre = k[:-7]
            w = _e2m1(v) * raw[pre + ".weight_scale"].float().repeat_interleave(16, 1) * raw[pre + ".weight_scale_2"]
            out[k] = w.to(torch.bfloat16)
        else:
            out[k] = v
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("variant", ["flash", "modelopt"])
def test_transformers_loads_names_and_forward_is_sane(ckpts, tmp_path, variant):
    """Dequantised, every native name maps onto DeepseekV4ForCausalLM (no missing or
    unexpected keys) and a 200-token forward (SWA + CSA + HCA engaged) is finite and sane."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV4ForCausalLM

    dst = tmp_path / "deq"
    _dequant_to_bf16(ckpts[variant], dst)
    model, info = DeepseekV4ForCausalLM.from_pretrained(dst, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    peak = {}

    def hook(mod, inp, out, name=None):
        peak["shared"] = max(peak.get("shared", 0.0), out.abs().max().item())

    for n, mod in model.named_modules():
        if n.endswith(("shared_experts.gate_proj", "shared_experts.up_proj")):
            mod.register_forward_hook(hook)
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert 0.2 < logits.std().item() < 5.0
    assert peak["shared"] < 0.5 * model.config.swiglu_limit
