"""The synthetic checkpoints' ``config.json``: the official V4-Flash keys, the presets, each variant's quantisation
block (see ``synth.py`` for what each variant and preset is).

Apart from ``synth.py`` (which writes the tensors, with torch) so that the command line lists the presets and
variants without importing torch.
"""

from __future__ import annotations

import copy
from typing import Any

VARIANTS: tuple[str, ...] = ("flash", "pro", "base", "modelopt", "ct")

# Official V4-Flash config.json (the keys the release ships); presets override dims.
_OFFICIAL_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "compress_ratios": None,  # derived from num_hidden_layers + variant unless overridden
    "compress_rope_theta": 160000,
    "dtype": "bfloat16",
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hash_layers": 3,
    "num_hidden_layers": 43,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "expert_dtype": "fp4",
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 129280,
}

#: Preset name -> config.json overrides.  Add a preset by adding a dict here (and,
#: optionally, a ``PRO_OVERRIDES`` entry).  Constraints checked by ``synthetic_config``:
#: hidden_size and moe_intermediate_size multiples of 32 (MXFP4/NVFP4 K), heads divisible
#: by o_groups, qk_rope_head_dim even and <= head_dim, top-k <= experts, hash layers < layers.
PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on CPU: convert + a 200-token forward.  5 layers: SWA, SWA, CSA, HCA, CSA (+MTP SWA);
    # window 32 so 150-250 tokens engage the sliding window, CSA top-k and one HCA entry.
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 5,
        "num_hash_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 64,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 8,
        "sliding_window": 32,
    },
    # Somewhat larger; q_lora_rank 192, o_lora 96 and I=96 give row counts that are not
    # multiples of 128 (partial FP8 blocks, padded swizzle rows).
    "small": {
        "vocab_size": 1024,
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_hash_layers": 2,
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 192,
        "o_groups": 2,
        "o_lora_rank": 96,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 96,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 16,
        "sliding_window": 64,
    },
    # Real V4-Flash layer shapes (H=4096, I=2048, 64 of the 256 experts, 64 heads x 512,
    # q/o lora 1024, 8 o_groups, 64 index heads x 128) on 3 layers (SWA/hash, CSA, HCA) + MTP
    # and a 8192-token vocabulary: ~1 GB per layer shard (3.9 GB in all, ~2 GB peak RSS,
    # minutes to write), for kernel and converter timing.
    "flash-layer": {
        "vocab_size": 8192,
        "num_hidden_layers": 3,
        "num_hash_layers": 1,
        "compress_ratios": [0, 4, 128, 0],
        "n_routed_experts": 64,
    },
    # Real V4-Pro layer shapes (H=7168, I=3072, 64 of the 384 experts, 128 heads x 512, q lora 1536, 16 o_groups,
    # o lora 1024, top-1024 indexer) on 3 layers (HCA/hash, CSA, HCA) + MTP and a 8192-token vocabulary: ~2.7 GB
    # per layer shard (~8.5 GB in all, minutes to write), for end-to-end decode timing (bench/e2e_bench.py).
    "pro-layer": {
        "vocab_size": 8192,
        "hidden_size": 7168,
        "num_hidden_layers": 3,
        "num_hash_layers": 1,
        "compress_ratios": [128, 4, 128, 0],
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "o_groups": 16,
        "o_lora_rank": 1024,
        "n_routed_experts": 64,
        "moe_intermediate_size": 3072,
        "index_topk": 1024,
        "routed_scaling_factor": 2.5,
    },
    # flash-layer with twice the experts (~7.5 GB): the converter's peak-memory check (bench/convert_bench.py).
    "flash-layer-2x": {
        "vocab_size": 8192,
        "num_hidden_layers": 3,
        "num_hash_layers": 1,
        "compress_ratios": [0, 4, 128, 0],
        "n_routed_experts": 128,
    },
}

#: Extra overrides for ``variant="pro"`` per preset (V4-Pro vs Flash: ~1.5x experts and
#: I, twice the o_groups, routed_scaling_factor 2.5, larger index_topk).
PRO_OVERRIDES: dict[str, dict[str, Any]] = {
    "tiny": {
        "n_routed_experts": 12,
        "moe_intermediate_size": 192,
        "o_groups": 4,
        "routed_scaling_factor": 2.5,
        "index_topk": 16,
    },
    "flash-layer": {
        "routed_scaling_factor": 2.5,
        "compress_ratios": [128, 128, 4, 0],
    },
    "small": {
        "n_routed_experts": 24,
        "moe_intermediate_size": 160,
        "o_groups": 4,
        "routed_scaling_factor": 2.5,
        "index_topk": 32,
    },
}

_DEFAULT_PRO = {"routed_scaling_factor": 2.5}

_MODELOPT_IGNORE = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
_CT_IGNORE = ["head", r"re:.*\.attn\..*", r"re:.*\.ffn\.shared_experts\..*", r"re:^mtp\..*"]


# --------------------------------------------------------------------------- config


def compress_pattern(num_layers: int, style: str = "flash") -> list[int]:
    """``compress_ratios`` for ``num_layers`` main layers plus one MTP entry (0).

    flash: ``[0, 0, 4, 128, 4, 128, ..., 0]``; pro: ``[128, 128, 4, 128, 4, ..., 0]``.
    """
    head = [0, 0] if style != "pro" else [128, 128]
    head = head[:num_layers]
    rest = [4 if i % 2 == 0 else 128 for i in range(max(num_layers - 2, 0))]
    return head + rest + [0]


def synthetic_config(preset: str, variant: str = "flash", **overrides: Any) -> dict[str, Any]:
    """The config.json dict for ``preset`` / ``variant`` with ``overrides`` applied last.

    Keys are the official config.json keys (``compress_ratios``, ``num_hash_layers``,
    ``qk_rope_head_dim``, ``rope_scaling``, ...), which transformers' ``DeepseekV4Config``
    accepts.  ``compress_ratios`` is derived from ``num_hidden_layers`` and the variant
    unless given.  Raises ``ValueError`` on unknown preset/variant or inconsistent dims.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    cfg = copy.deepcopy(_OFFICIAL_CONFIG)
    cfg.update(copy.deepcopy(PRESETS[preset]))
    if variant == "pro":
        cfg.update(copy.deepcopy(PRO_OVERRIDES.get(preset, _DEFAULT_PRO)))
    qc = cfg["quantization_config"]
    if variant == "base":
        cfg["expert_dtype"] = "fp8"
        qc["expert_dtype"] = "fp8"
    cfg.update(copy.deepcopy(overrides))
    qc = cfg["quantization_config"]
    if cfg.get("compress_ratios") is None:
        cfg["compress_ratios"] = compress_pattern(
            cfg["num_hidden_layers"], "pro" if variant == "pro" else "flash"
        )
    if variant == "modelopt":
        n = cfg["num_hidden_layers"]
        qc.update(
            {
                "quant_algo": "MIXED_PRECISION",
                "moe_quant_algo": "NVFP4",
                "group_size": 16,
                "kv_cache_quant_algo": None,
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False},
                        "input_activations": {
                            "num_bits": 4,
                            "type": "float",
                            "group_size": 16,
                            "dynamic": False,
                        },
                    }
                },
                "ignore": list(_MODELOPT_IGNORE),
                "quantized_layers": {
                    f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(n)
                },
                "producer": {"name": "modelopt", "version": "synthetic"},
            }
        )
    if variant == "ct":
        fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": [r"re:^layers\.\d+\.ffn\.experts\.\d+\.w[123]$"],
                    "weights": {**fp4, "dynamic": False, "observer": "minmax", "scale_dtype": "float8_e4m3fn"},
                    "input_activations": {**fp4, "dynamic": "local", "observer": "minmax"},
                    "output_activations": None,
                    "format": "nvfp4-pack-quantized",
                }
            },
            "ignore": list(_CT_IGNORE),
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "transform_config": {},
            "version": "synthetic",
        }
    _validate(cfg)
    return cfg


def _validate(cfg: dict[str, Any]) -> None:
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    L = cfg["num_hidden_layers"]
    problems = []
    if H % 32 or I % 32:
        problems.append(f"hidden_size ({H}) and moe_intermediate_size ({I}) must be multiples of 32")
    if cfg["num_attention_heads"] % cfg["o_groups"]:
        problems.append("num_attention_heads must be divisible by o_groups")
    rd = cfg["qk_rope_head_dim"]
    if rd % 2 or rd > cfg["head_dim"]:
        problems.append("qk_rope_head_dim must be even and <= head_dim")
    if cfg["index_head_dim"] % 2 or cfg["index_head_dim"] < rd:
        problems.append("index_head_dim must be even and >= qk_rope_head_dim")
    if cfg["num_experts_per_tok"] > cfg["n_routed_experts"]:
        problems.append("num_experts_per_tok > n_routed_experts")
    if not 0 <= cfg["num_hash_layers"] < L:
        problems.append("num_hash_layers must be in [0, num_hidden_layers)")
    if cfg["num_nextn_predict_layers"] != 1:
        problems.append("only num_nextn_predict_layers == 1 is generated")
    cr = cfg["compress_ratios"]
    if len(cr) != L + cfg["num_nextn_predict_layers"] or any(r not in (0, 4, 128) for r in cr):
        problems.append(f"compress_ratios needs {L}+1 entries from {{0, 4, 128}}, got {cr}")
    if cfg["n_shared_experts"] != 1:
        problems.append("only n_shared_experts == 1 is generated")
    if problems:
        raise ValueError("inconsistent synthetic config: " + "; ".join(problems))
