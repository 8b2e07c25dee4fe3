"""The rule table against full-size V4-Flash and V4-Pro tensor lists, from headers alone.

The tensor names, dtypes and shapes are written here from the published checkpoints' layout
(docs/deepseek_v4.md, "Tensor names and shapes"), independently of the synthetic generator, and planned without
any data: every tensor must map, and the outputs must have the format-1 shapes at full scale.
"""

from __future__ import annotations

import math

import pytest

from nvfp4_megamoe.convert.errors import PlanError
from nvfp4_megamoe.convert.plan import Options, make_plan
from nvfp4_megamoe.convert.safetensors_header import DTYPES, TensorInfo
from nvfp4_megamoe.convert.source import SourceTensor

FLASH = dict(hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
             o_lora_rank=1024, n_routed_experts=256, moe_intermediate_size=2048, index_n_heads=64,
             index_head_dim=128, num_hash_layers=3, num_nextn_predict_layers=1, vocab_size=129280,
             num_experts_per_tok=6, head_dim=512,
             compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
PRO = dict(FLASH, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
           n_routed_experts=384, moe_intermediate_size=3072,
           compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])


class HeaderOnlySource:
    """A plan source made of header entries only (no file, no data)."""

    def __init__(self, config: dict, tensors: list[tuple[str, str, tuple[int, ...]]]):
        self.config = config
        self.description = "header-only"
        self.files = ["model-00001-of-00001.safetensors"]
        self.tensors, offset = {}, 0
        for name, dtype, shape in tensors:
            n = math.prod(shape) * DTYPES[dtype][1]
            self.tensors[name] = SourceTensor(name, self.files[0], TensorInfo(dtype, shape, offset, offset + n))
            offset += n


def _fp8(name, out, inp, scale="F8_E8M0"):
    return [(f"{name}.weight", "F8_E4M3", (out, inp)), (f"{name}.scale", scale, (-(-out // 128), -(-inp // 128)))]


def official_tensors(c: dict, variant: str = "flash") -> list[tuple[str, str, tuple[int, ...]]]:
    h, heads, ql, og, ol = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    e, i, ih, idim = c["n_routed_experts"], c["moe_intermediate_size"], c["index_n_heads"], c["index_head_dim"]
    scale = "F32" if variant == "base" else "F8_E8M0"
    t = [("embed.weight", "BF16", (c["vocab_size"], h)), ("head.weight", "BF16", (c["vocab_size"], h)),
         ("norm.weight", "BF16", (h,)), ("hc_head_fn", "F32", (4, 4 * h)), ("hc_head_base", "F32", (4,)),
         ("hc_head_scale", "F32", (1,))]
    blocks = [(f"layers.{n}", c["compress_ratios"][n], n < c["num_hash_layers"]) for n in range(c["num_hidden_layers"])]
    blocks += [(f"mtp.{k}", c["compress_ratios"][-1], False) for k in range(c["num_nextn_predict_layers"])]
    for p, ratio, hashed in blocks:
        for s in ("attn", "ffn"):
            t += [(f"{p}.hc_{s}_fn", "F32", (24, 4 * h)), (f"{p}.hc_{s}_base", "F32", (24,)),
                  (f"{p}.hc_{s}_scale", "F32", (3,)), (f"{p}.{s}_norm.weight", "BF16", (h,))]
        t += [(f"{p}.attn.attn_sink", "F32", (heads,)), (f"{p}.attn.q_norm.weight", "BF16", (ql,)),
              (f"{p}.attn.kv_norm.weight", "BF16", (512,))]
        t += _fp8(f"{p}.attn.wq_a", ql, h, scale) + _fp8(f"{p}.attn.wq_b", heads * 512, ql, scale)
        t += _fp8(f"{p}.attn.wkv", 512, h, scale) + _fp8(f"{p}.attn.wo_a", og * ol, heads * 512 // og, scale)
        t += _fp8(f"{p}.attn.wo_b", h, og * ol, scale)
        if ratio:
            coff = 2 if ratio == 4 else 1
            t += [(f"{p}.attn.compressor.ape", "F32", (ratio, coff * 512)),
                  (f"{p}.attn.compressor.wkv.weight", "BF16", (coff * 512, h)),
                  (f"{p}.attn.compressor.wgate.weight", "BF16", (coff * 512, h)),
                  (f"{p}.attn.compressor.norm.weight", "BF16", (512,))]
        if ratio == 4:
            t += _fp8(f"{p}.attn.indexer.wq_b", ih * idim, ql, scale)
            t += [(f"{p}.attn.indexer.weights_proj.weight", "BF16", (ih, h)),
                  (f"{p}.attn.indexer.compressor.ape", "F32", (4, 2 * idim)),
                  (f"{p}.attn.indexer.compressor.wkv.weight", "BF16", (2 * idim, h)),
                  (f"{p}.attn.indexer.compressor.wgate.weight", "BF16", (2 * idim, h)),
                  (f"{p}.attn.indexer.compressor.norm.weight", "BF16", (idim,))]
        t += [(f"{p}.ffn.gate.weight", "BF16", (e, h))]
        t += [(f"{p}.ffn.gate.tid2eid", "I64", (c["vocab_size"], c["num_experts_per_tok"]))] if hashed else \
            [(f"{p}.ffn.gate.bias", "F32", (e,))]
        t += _fp8(f"{p}.ffn.shared_experts.w1", i, h, scale) + _fp8(f"{p}.ffn.shared_experts.w3", i, h, scale)
        t += _fp8(f"{p}.ffn.shared_experts.w2", h, i, scale)
        for x in range(e):
            for w, (out, inp) in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
                name = f"{p}.ffn.experts.{x}.{w}"
                if variant == "base":
                    t += _fp8(name, out, inp, "F32")
                elif variant == "modelopt" and p.startswith("layers."):
                    t += [(f"{name}.weight", "U8", (out, inp // 2)), (f"{name}.weight_scale", "F8_E4M3", (out, inp // 16)),
                          (f"{name}.weight_scale_2", "F32", ()), (f"{name}.input_scale", "F32", ())]
                else:
                    t += [(f"{name}.weight", "I8", (out, inp // 2)), (f"{name}.scale", "F8_E8M0", (out, inp // 32))]
        if p.startswith("mtp."):
            t += _fp8(f"{p}.e_proj", h, h, scale) + _fp8(f"{p}.h_proj", h, h, scale)
            t += [(f"{p}.{n}.weight", "BF16", (h,)) for n in ("enorm", "hnorm", "norm")]
            t += [(f"{p}.hc_head_fn", "F32", (4, 4 * h)), (f"{p}.hc_head_base", "F32", (4,)),
                  (f"{p}.hc_head_scale", "F32", (1,))]
    return t


@pytest.mark.parametrize("config,variant", [(FLASH, "flash"), (PRO, "flash"), (FLASH, "base"), (FLASH, "modelopt")],
                         ids=["v4-flash", "v4-pro", "v4-flash-base", "v4-flash-modelopt"])
def test_every_full_scale_tensor_maps_to_format_1(config, variant):
    src = HeaderOnlySource(config, official_tensors(config, variant))
    plan = make_plan(src, Options(dense="nvfp4"))
    outs = {o.name: o for o in plan.outputs}
    sources = {s for o in plan.outputs for s in o.sources}
    assert sources == set(src.tensors)
    h, e, i = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    w13 = outs["layers.5.ffn.experts.w13.weight"]
    assert (w13.dtype, w13.shape) == ("U8", (e, 2 * i, h // 2))
    assert outs["layers.5.ffn.experts.w13.weight_scale"].shape == (e, 2 * i * h // 16)
    assert outs["layers.5.ffn.experts.w2.weight_scale"].shape == (e, h * -(-i // 16 // 4) * 4)
    assert outs["mtp.0.ffn.experts.w13.alpha"].shape == (e, 2) and outs["mtp.0.ffn.experts.w2.alpha"].shape == (e,)
    wo_a_in = config["num_attention_heads"] * 512 // config["o_groups"]
    assert outs["layers.0.attn.wo_a.weight"].shape == (config["o_groups"] * config["o_lora_rank"], wo_a_in // 2)
    assert outs["layers.0.ffn.shared_experts.w13.weight"].shape == (2 * i, h // 2)
    assert outs["layers.0.attn.wq_a.alpha"].shape == ()
    assert all(o.nbytes <= plan.options.shard_size for shard in plan.shards if len(shard) > 1 for o in shard)
    if variant == "modelopt":
        assert outs["layers.5.ffn.experts.w13.input_scale"].shape == (e, 2)
        assert "mtp.0.ffn.experts.w13.input_scale" not in outs
    src_bytes = sum(t.info.nbytes for t in src.tensors.values())
    if variant == "flash":  # the published checkpoint sizes: the tensor list above is the real one
        assert src_bytes == {4096: 159_609_485_896, 7168: 864_704_792_696}[h]
    # NVFP4 experts carry twice MXFP4's scale bytes, dense FP8 halves: about the same size overall.
    low, high = (0.9, 1.1) if variant != "base" else (0.5, 0.6)  # -Base experts are FP8: NVFP4 is ~half
    assert low * src_bytes < plan.total_bytes < high * src_bytes


def test_full_scale_default_keeps_the_dense_layers_as_released():
    """The default (``--dense keep``): every dense FP8 tensor is an output of its own, byte for byte; only the
    routed experts change."""
    src = HeaderOnlySource(FLASH, official_tensors(FLASH))
    plan = make_plan(src, Options())
    assert plan.options.dense == "keep"
    outs = {o.name: o for o in plan.outputs}
    assert "layers.7.attn.wq_b.scale" in outs and "layers.7.ffn.shared_experts.w3.weight" in outs
    assert "layers.7.ffn.experts.w13.weight" in outs
    kept = [name for name, t in src.tensors.items() if t.info.dtype == "F8_E4M3" and ".ffn.experts." not in name]
    assert len(kept) > 300
    for name in kept:
        info = src.tensors[name].info
        assert list(outs[name].sources) == [name] and (outs[name].dtype, tuple(outs[name].shape)) == (info.dtype,
                                                                                                    tuple(info.shape))


def test_full_scale_unknown_and_mismatched_tensors_are_all_reported():
    tensors = official_tensors(FLASH)
    tensors.append(("layers.9.attn.rotary_emb.inv_freq", "F32", (32,)))
    tensors = [(n, d, (2048, 2000) if n == "layers.4.ffn.experts.17.w1.weight" else s) for n, d, s in tensors]
    with pytest.raises(PlanError) as info:
        make_plan(HeaderOnlySource(FLASH, tensors))
    names = [o[0] for o in info.value.offenders]
    assert "layers.9.attn.rotary_emb.inv_freq" in names
    assert "layers.4.ffn.experts.17.w1.weight" in names
