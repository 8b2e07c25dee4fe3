"""Test-only oracle: a *source* (official-format) checkpoint dequantised to float32 and loaded into
transformers' ``DeepseekV4ForCausalLM``.

The native -> transformers name mapping below is written from the facts of transformers 5.23's
``conversion_mapping`` for ``deepseek_v4`` (attn -> self_attn, ffn -> mlp, the indexer moves under
the compressor, experts w1|w3 fuse into ``gate_up_proj`` [E, 2I, H] gate first, ``mtp.*`` is
ignored). Dequantisation uses the project's codecs: FP8 blocks, MXFP4, ModelOpt NVFP4
(row-major E4M3 block scales x ``weight_scale_2``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize
from nvfp4_megamoe.kernels.mxfp4 import dequantize_mxfp4
from nvfp4_megamoe.kernels.nvfp4 import dequantize_nvfp4

_LAYER_RENAMES = [  # (native suffix regex, transformers suffix), first match wins
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_attn_(fn|base|scale)", r"attn_hc.\1"),
    (r"hc_ffn_(fn|base|scale)", r"ffn_hc.\1"),
    (r"attn\.attn_sink", "self_attn.sinks"),
    (r"attn\.wq_a\.weight", "self_attn.q_a_proj.weight"),
    (r"attn\.q_norm\.weight", "self_attn.q_a_norm.weight"),
    (r"attn\.wq_b\.weight", "self_attn.q_b_proj.weight"),
    (r"attn\.wkv\.weight", "self_attn.kv_proj.weight"),
    (r"attn\.kv_norm\.weight", "self_attn.kv_norm.weight"),
    (r"attn\.wo_a\.weight", "self_attn.o_a_proj.weight"),
    (r"attn\.wo_b\.weight", "self_attn.o_b_proj.weight"),
    (r"attn\.indexer\.wq_b\.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    (r"attn\.indexer\.weights_proj\.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    (r"attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"attn\.compressor\.", "self_attn.compressor."),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.gate\.(weight|tid2eid)", r"mlp.gate.\1"),
    (r"ffn\.shared_experts\.w1\.weight", "mlp.shared_experts.gate_proj.weight"),
    (r"ffn\.shared_experts\.w3\.weight", "mlp.shared_experts.up_proj.weight"),
    (r"ffn\.shared_experts\.w2\.weight", "mlp.shared_experts.down_proj.weight"),
]
_COMPRESSOR_LEAVES = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight",
                      "ape": "position_bias", "norm.weight": "kv_norm.weight"}
_GLOBALS = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
            "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
            "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def hf_name(native: str) -> str | None:
    """transformers parameter name of a native (non-expert) tensor; None for tensors it has no place for."""
    if native in _GLOBALS:
        return _GLOBALS[native]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", native)
    if m is None:
        return None
    layer, rest = m.groups()
    for pattern, target in _LAYER_RENAMES:
        hit = re.match(pattern, rest)
        if hit is None:
            continue
        tail = rest[hit.end():]
        if target.endswith("."):  # a compressor prefix: rename its leaf too
            return f"model.layers.{layer}.{hit.expand(target)}{_COMPRESSOR_LEAVES[tail]}"
        if tail:
            return None
        return f"model.layers.{layer}.{hit.expand(target)}"
    return None


def _read_source(src: Path) -> dict[str, torch.Tensor]:
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                if not name.startswith("mtp."):
                    tensors[name] = f.get_tensor(name)
    return tensors


def _dequantize(t: dict[str, torch.Tensor], base: str) -> torch.Tensor:
    """float32 value of the linear ``base`` (``base.weight`` plus whichever scale tensors it has)."""
    w = t[f"{base}.weight"]
    if f"{base}.weight_scale_2" in t:  # ModelOpt NVFP4: row-major E4M3 scales [out, in/16]
        return dequantize_nvfp4(w, t[f"{base}.weight_scale"].view(torch.uint8), t[f"{base}.weight_scale_2"].float())
    if f"{base}.scale" in t:
        if w.dtype in (torch.int8, torch.uint8):  # MXFP4
            return dequantize_mxfp4(w, t[f"{base}.scale"])
        return fp8_block_dequantize(w, t[f"{base}.scale"])
    return w.float()


def dequantized_state_dict(src: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a source checkpoint (except MTP) as float32 under transformers' names."""
    src = Path(src)
    t = _read_source(src)
    cfg = json.loads((src / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    linear_bases = {n[: -len(".weight")] for n in t if n.endswith(".weight")}
    for base in sorted(linear_bases):
        if ".experts." in base:
            continue
        name = hf_name(f"{base}.weight")
        if name is None:
            raise KeyError(f"oracle: no transformers name for {base}.weight")
        out[name] = _dequantize(t, base)
    scale_suffixes = (".scale", ".weight_scale", ".weight_scale_2", ".input_scale")
    for native, value in t.items():
        if ".experts." in native or native.endswith(".weight") or native.endswith(scale_suffixes):
            continue
        name = hf_name(native)
        if name is None:
            raise KeyError(f"oracle: no transformers name for {native}")
        out[name] = value if value.dtype == torch.int64 else value.float()
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}.ffn.experts"
        e_count = cfg["n_routed_experts"]
        gate_up = [torch.cat((_dequantize(t, f"{p}.{e}.w1"), _dequantize(t, f"{p}.{e}.w3"))) for e in range(e_count)]
        down = [_dequantize(t, f"{p}.{e}.w2") for e in range(e_count)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def converted_nvfp4_weights(converted: str | Path) -> dict[str, torch.Tensor]:
    """Every NVFP4 tensor of a format-1 checkpoint decoded to float32, under transformers' names.

    Stacked experts become ``gate_up_proj`` / ``down_proj``; a fused shared expert ``w13`` is
    de-interleaved into ``gate_proj`` / ``up_proj``; other NVFP4 linears keep their module name.
    """
    from nvfp4_megamoe.kernels.nvfp4_reference import decode_gate_up, decode_weight

    converted = Path(converted)
    index = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"]

    def read(name: str) -> torch.Tensor:
        with safe_open(str(converted / index[name]), framework="pt") as f:
            return f.get_tensor(name)

    out: dict[str, torch.Tensor] = {}
    for name in index:
        if not name.endswith(".alpha") or name.startswith("mtp."):
            continue
        base = name[: -len(".alpha")]
        w, sc, alpha = read(f"{base}.weight"), read(f"{base}.weight_scale"), read(name)
        layer = base.split(".")[1]
        if base.endswith("ffn.experts.w13"):
            halves = [decode_gate_up(w[e], sc[e], alpha[e]) for e in range(w.shape[0])]
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(h) for h in halves])
        elif base.endswith("ffn.experts.w2"):
            out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
                [decode_weight(w[e], sc[e], alpha[e]) for e in range(w.shape[0])])
        elif base.endswith("shared_experts.w13"):
            gate, up = decode_gate_up(w, sc, alpha)
            out[f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight"] = gate
            out[f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"] = up
        else:
            out[hf_name(f"{base}.weight")] = decode_weight(w, sc, alpha)
    return out


def transformers_model(src: str | Path, *, nvfp4_from: str | Path | None = None):
    """``DeepseekV4ForCausalLM`` in float32 holding the exact dequantised source weights (eval mode).

    ``nvfp4_from``: take every NVFP4 weight from this converted checkpoint instead (decoded
    format 1), to separate the runtime's error from the conversion's on lossy paths (ModelOpt
    w1/w3 global-scale reconciliation, FP8 -> NVFP4 dense requantisation).
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    src = Path(src)
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    config = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every parameter is overwritten below; random init only costs time
        model = DeepseekV4ForCausalLM(config).float().eval()
    state = dequantized_state_dict(src)
    if nvfp4_from is not None:
        state.update(converted_nvfp4_weights(nvfp4_from))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise KeyError(f"oracle state dict mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}")
    return model
