"""The model hyper-parameters the runtime needs, read from a checkpoint's ``config.json``.

Both spellings found in the wild are accepted: the release configs (``compress_ratios`` with one
entry per layer plus MTP, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and the
transformers 5.x spelling (``layer_types``, ``mlp_layer_types``, ``partial_rotary_factor``,
``rope_parameters`` nested as ``main``/``compress``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .format import FormatError

_RATIO_OF_LAYER_TYPE = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                        "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE flavour: plain (``factor`` None) or YaRN without mscale (the V4 reference applies none)."""

    theta: float
    dim: int
    factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: tuple[int, ...]  # one per decoder layer (MTP entry dropped)
    main_rope: RopeConfig
    compress_rope: RopeConfig
    scoring_func: str = "sqrtsoftplus"
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        n = cfg["num_hidden_layers"]
        if cfg.get("layer_types") is not None:
            rates = {**_RATIO_OF_LAYER_TYPE, **(cfg.get("compress_rates") or {}), "sliding_attention": 0}
            ratios = tuple(int(rates[t]) for t in cfg["layer_types"][:n])
        elif cfg.get("compress_ratios") is not None:
            ratios = tuple(int(r) for r in cfg["compress_ratios"][:n])
        else:
            raise FormatError("config.json has neither `compress_ratios` nor `layer_types`")
        if cfg.get("mlp_layer_types") is not None:
            n_hash = sum(1 for t in cfg["mlp_layer_types"][:n] if t == "hash_moe")
        else:
            n_hash = int(cfg.get("num_hash_layers", 3))
        head_dim = int(cfg.get("head_dim", 512))
        if cfg.get("qk_rope_head_dim") is not None:
            rope_dim = int(cfg["qk_rope_head_dim"])
        elif cfg.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * cfg["partial_rotary_factor"])
        else:
            rope_dim = 64
        main_theta = float(cfg.get("rope_theta", 10000.0))
        compress_theta = float(cfg.get("compress_rope_theta", 160000.0))
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("compress"), dict):
            main_theta = float(params.get("main", {}).get("rope_theta", main_theta))
            scaling = params["compress"]
            compress_theta = float(scaling.get("rope_theta", compress_theta))
        elif scaling is None and isinstance(params, dict):
            scaling = params
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "yarn":
            compress_rope = RopeConfig(
                compress_theta, rope_dim, float(scaling["factor"]),
                int(scaling["original_max_position_embeddings"]),
                float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1))
        elif kind in (None, "default"):
            compress_rope = RopeConfig(compress_theta, rope_dim)
        else:
            raise FormatError(f"config.json: rope scaling type {kind!r} is not supported (expected yarn)")
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]), num_layers=n,
            num_heads=int(cfg["num_attention_heads"]), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=int(cfg["q_lora_rank"]), o_groups=int(cfg["o_groups"]), o_lora_rank=int(cfg["o_lora_rank"]),
            n_routed_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]), num_hash_layers=n_hash,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)), sliding_window=int(cfg.get("sliding_window", 128)),
            hc_mult=int(cfg.get("hc_mult", 4)), hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            index_n_heads=int(cfg.get("index_n_heads", 64)), index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 512)), compress_ratios=ratios,
            main_rope=RopeConfig(main_theta, rope_dim), compress_rope=compress_rope,
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")), raw=cfg,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise FormatError(f"{file}: missing; a converted checkpoint carries the source's config.json")
        return cls.from_dict(json.loads(file.read_text()))
