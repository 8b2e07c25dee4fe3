"""The model hyper-parameters the runtime needs, read from a checkpoint's ``config.json``.

Both spellings found in the wild are accepted: the release configs (``compress_ratios`` with one
entry per layer plus MTP, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and the
transformers 5.x spelling (``layer_types``, ``mlp_layer_types``, ``partial_rotary_factor``,
``rope_parameters`` nested as ``main``/``compress``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nvfp4_megamoe.input_files import file_kind, read_json_object

from .format import FormatError

_MISSING = object()
COMPRESS_RATIOS = (0, 4, 128)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")  # the router scores kernels/router_reference.py computes


def config_int(cfg: dict, key: str, default: object = _MISSING, minimum: int = 1) -> int:
    """``cfg[key]`` as an int of at least ``minimum`` (or ``default`` when absent); :class:`FormatError` saying
    which field and what it holds otherwise (a string, a float or a boolean is not an integer here)."""
    value = cfg.get(key, default)
    if value is _MISSING:
        raise FormatError(f"config.json: the field {key!r} is missing; a DeepSeek-V4 config.json sets it (an integer "
                          f">= {minimum}). Copy config.json from the checkpoint's release.")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FormatError(f"config.json: {key!r} is {value!r}; expected an integer >= {minimum}. Fix config.json.")
    return value


FLOAT32_MAX = 3.4028234663852886e38


def config_float(cfg: dict, key: str, default: object = _MISSING, above: float | None = None) -> float:
    """``cfg[key]`` (or ``default``) as a float finite in float32 (the runtime computes in it) and, when ``above``
    is given, greater than it; :class:`FormatError` otherwise."""
    value = cfg.get(key, default)
    if value is None:
        value = default
    if value is _MISSING:
        raise FormatError(f"config.json: the field {key!r} is missing (a number). Fix config.json.")
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not abs(value) <= FLOAT32_MAX
            or (above is not None and not value > above)):
        bound = f" greater than {above:g}" if above is not None else ""
        raise FormatError(f"config.json: {key!r} is {value!r}; expected a number{bound}, finite in float32. Fix "
                          "config.json.")
    return float(value)


def _list(cfg: dict, key: str, length: int) -> list:
    value = cfg[key]
    if not isinstance(value, list) or len(value) < length:
        raise FormatError(f"config.json: {key!r} is {value!r}; expected a list with one entry per layer "
                          f"(num_hidden_layers = {length}). Fix config.json.")
    return value[:length]

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
    n_shared_experts: int = 1
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Read and check ``config.json``'s fields: every one the runtime uses must be present (or have its
        default) and of the right type, or :class:`FormatError` names it."""
        if not isinstance(cfg, dict):
            raise FormatError(f"config.json holds {type(cfg).__name__}, expected a JSON object")
        n = config_int(cfg, "num_hidden_layers")
        if cfg.get("layer_types") is not None:
            rates = {**_RATIO_OF_LAYER_TYPE, **(cfg.get("compress_rates") or {}), "sliding_attention": 0}
            unknown = [t for t in _list(cfg, "layer_types", n) if not isinstance(t, str) or t not in rates]
            if unknown:
                raise FormatError(f"config.json: layer_types holds {unknown[0]!r}; expected one of {sorted(rates)}")
            ratios = tuple(rates[t] for t in cfg["layer_types"][:n])
        elif cfg.get("compress_ratios") is not None:
            ratios = tuple(_list(cfg, "compress_ratios", n))
        else:
            raise FormatError("config.json has neither `compress_ratios` nor `layer_types`")
        bad = [r for r in ratios if not isinstance(r, int) or isinstance(r, bool) or r not in COMPRESS_RATIOS]
        if bad:
            raise FormatError(f"config.json: compress ratio {bad[0]!r}; expected one of {COMPRESS_RATIOS} per layer")
        if cfg.get("mlp_layer_types") is not None:
            n_hash = sum(1 for t in _list(cfg, "mlp_layer_types", n) if t == "hash_moe")
        else:
            n_hash = config_int(cfg, "num_hash_layers", 3, minimum=0)
        if n_hash > n:
            raise FormatError(f"config.json: num_hash_layers = {n_hash} exceeds num_hidden_layers = {n}")
        head_dim = config_int(cfg, "head_dim", 512)
        if cfg.get("qk_rope_head_dim") is not None:
            rope_dim = config_int(cfg, "qk_rope_head_dim")
        elif cfg.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * config_float(cfg, "partial_rotary_factor", 1.0))
        else:
            rope_dim = 64
        if rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise FormatError(f"config.json: the rotary dimension {rope_dim} must be even and in (0, head_dim = "
                              f"{head_dim}]")
        main_theta = config_float(cfg, "rope_theta", 10000.0, above=1.0)
        compress_theta = config_float(cfg, "compress_rope_theta", 160000.0, above=1.0)
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("compress"), dict):
            main = params.get("main")
            main_theta = config_float(main if isinstance(main, dict) else {}, "rope_theta", main_theta, above=1.0)
            scaling = params["compress"]
            compress_theta = config_float(scaling, "rope_theta", compress_theta, above=1.0)
        elif scaling is None and isinstance(params, dict):
            scaling = params
        if scaling is not None and not isinstance(scaling, dict):
            raise FormatError(f"config.json: rope_scaling is {scaling!r}; expected an object")
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "yarn":
            compress_rope = RopeConfig(
                compress_theta, rope_dim, config_float(scaling, "factor", above=0.0),
                config_int(scaling, "original_max_position_embeddings"),
                config_float(scaling, "beta_fast", 32.0) or 32.0, config_float(scaling, "beta_slow", 1.0) or 1.0)
        elif kind in (None, "default"):
            compress_rope = RopeConfig(compress_theta, rope_dim)
        else:
            raise FormatError(f"config.json: rope scaling type {kind!r} is not supported (expected yarn)")
        heads, groups = config_int(cfg, "num_attention_heads"), config_int(cfg, "o_groups")
        experts, top_k = config_int(cfg, "n_routed_experts"), config_int(cfg, "num_experts_per_tok")
        if heads % groups:
            raise FormatError(f"config.json: num_attention_heads = {heads} is not a multiple of o_groups = {groups}")
        if top_k > experts:
            raise FormatError(f"config.json: num_experts_per_tok = {top_k} exceeds n_routed_experts = {experts}")
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise FormatError(f"config.json: scoring_func is {scoring!r}; expected one of {SCORING_FUNCS}")
        return cls(
            vocab_size=config_int(cfg, "vocab_size"), hidden_size=config_int(cfg, "hidden_size"), num_layers=n,
            num_heads=heads, head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=config_int(cfg, "q_lora_rank"), o_groups=groups, o_lora_rank=config_int(cfg, "o_lora_rank"),
            n_routed_experts=experts, top_k=top_k,
            moe_intermediate_size=config_int(cfg, "moe_intermediate_size"), num_hash_layers=n_hash,
            routed_scaling_factor=config_float(cfg, "routed_scaling_factor", 1.0, above=0.0),
            swiglu_limit=config_float(cfg, "swiglu_limit", 10.0, above=0.0),
            sliding_window=config_int(cfg, "sliding_window", 128),
            hc_mult=config_int(cfg, "hc_mult", 4), hc_sinkhorn_iters=config_int(cfg, "hc_sinkhorn_iters", 20),
            hc_eps=config_float(cfg, "hc_eps", 1e-6, above=0.0),
            rms_norm_eps=config_float(cfg, "rms_norm_eps", 1e-6, above=0.0),
            index_n_heads=config_int(cfg, "index_n_heads", 64), index_head_dim=config_int(cfg, "index_head_dim", 128),
            index_topk=config_int(cfg, "index_topk", 512), compress_ratios=ratios,
            main_rope=RopeConfig(main_theta, rope_dim), compress_rope=compress_rope,
            scoring_func=scoring, n_shared_experts=config_int(cfg, "n_shared_experts", 1), raw=cfg,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        if file_kind(file) is None:
            raise FormatError(f"{file}: missing; a converted checkpoint carries the source's config.json")
        try:
            return cls.from_dict(read_json_object(file, "a DeepSeek-V4 config.json is a JSON object", FormatError))
        except FormatError as exc:
            if str(file) not in str(exc):
                exc.args = (f"{file}: {exc}",)
                exc.path = str(file)
            raise
