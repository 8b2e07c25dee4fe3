"""What a DeepSeek-V4 checkpoint holds for its config: every tensor's name, dtypes and shape.

One table serves both sides. The converter checks a source against it before a byte is written
(``convert/required.py`` adds what each source format needs for the routed experts), and
``load_model`` checks a converted checkpoint against it (``runtime/weights.py``). Three kinds:

* ``tensors``: stored as they are in both (norms, mHC parameters, attention sinks, compressors, the
  router, the embedding and the head): name -> :class:`Spec` (allowed dtypes and the shape);
* ``linears``: block-scaled FP8 in a source, NVFP4 (or FP8 kept) after conversion: prefix -> logical
  ``[out, in]``. The shared expert is three of them (``w1``, ``w2``, ``w3``); a converted NVFP4 one
  fuses ``w1`` and ``w3`` into ``w13`` (``[2 * out, in]``);
* routed experts, one stacked group per layer, ``n_routed_experts`` of
  ``[moe_intermediate_size, hidden_size]`` (gate, up) and ``[hidden_size, moe_intermediate_size]``
  (down).

Which tensors a layer has follows from the config: a compress ratio of 4 or 128 adds a compressor
(``head_dim`` wide per window half at ratio 4), 4 also the lightning indexer; the first
``num_hash_layers`` layers route by ``tid2eid`` instead of a bias; an MTP block has the layer tensors
of a ratio-0 non-hash layer plus ``e_proj``, ``h_proj``, three norms and its own ``hc_head_*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import ModelConfig

FLOAT = ("BF16", "F16", "F32")  # read as float by the runtime (activations are float32)
INDEX = ("I64", "I32")
FP8_SCALES = ("F8_E8M0", "U8", "F32")  # the block scales of an FP8 linear (E8M0 bytes, or float32 in -Base)
FP8_BLOCK = 128


@dataclass(frozen=True)
class Spec:
    """A stored tensor: the dtypes it may have and its exact shape; ``index_limit``: it holds indices, each in
    ``[0, index_limit)`` (a hash layer's ``tid2eid`` names experts)."""

    dtypes: tuple[str, ...]
    shape: tuple[int, ...]
    index_limit: int | None = None

    def describe(self) -> str:
        return f"{'/'.join(self.dtypes)} {list(self.shape)}"


@dataclass
class Expected:
    """The tensors of one block (a layer, an MTP layer, or the model's global tensors)."""

    tensors: dict[str, Spec] = field(default_factory=dict)
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)
    experts: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # prefix -> (experts, I, H)
    why: dict[str, str] = field(default_factory=dict)  # prefix -> what about the config asks for it

    def update(self, other: "Expected") -> None:
        self.tensors.update(other.tensors)
        self.linears.update(other.linears)
        self.experts.update(other.experts)
        self.why.update(other.why)


def fp8_scale_shape(out: int, inp: int) -> tuple[int, int]:
    """Shape of the 128 x 128 block scales of an FP8 ``[out, in]`` weight."""
    return -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)


def _hc(e: Expected, prefix: str, kind: str, cfg: ModelConfig) -> None:
    hc, h = cfg.hc_mult, cfg.hidden_size
    mix, scales = (hc, 1) if kind == "head" else ((2 + hc) * hc, 3)
    e.tensors[f"{prefix}hc_{kind}_fn"] = Spec(FLOAT, (mix, hc * h))
    e.tensors[f"{prefix}hc_{kind}_base"] = Spec(FLOAT, (mix,))
    e.tensors[f"{prefix}hc_{kind}_scale"] = Spec(FLOAT, (scales,))


def _compressor(e: Expected, prefix: str, ratio: int, dim: int, hidden: int) -> None:
    width = 2 * dim if ratio == 4 else dim  # ratio 4: overlapping windows, two halves
    e.tensors[prefix + "ape"] = Spec(FLOAT, (ratio, width))
    e.tensors[prefix + "wkv.weight"] = Spec(FLOAT, (width, hidden))
    e.tensors[prefix + "wgate.weight"] = Spec(FLOAT, (width, hidden))
    e.tensors[prefix + "norm.weight"] = Spec(FLOAT, (dim,))


def layer_tensors(cfg: ModelConfig, prefix: str, ratio: int, hashed: bool) -> Expected:
    """What decoder layer (or MTP block) ``prefix`` (``layers.3``, ``mtp.0``) holds at ``ratio``."""
    h, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ql, groups, ol = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    p, e = prefix + ".", Expected()
    e.why[prefix] = (f"compress ratio {ratio}" + (", hash-routed" if hashed else "")
                     + (" (MTP)" if prefix.startswith("mtp.") else ""))
    _hc(e, p, "attn", cfg)
    _hc(e, p, "ffn", cfg)
    e.tensors[p + "attn_norm.weight"] = Spec(FLOAT, (h,))
    e.tensors[p + "ffn_norm.weight"] = Spec(FLOAT, (h,))
    a = p + "attn."
    e.tensors[a + "attn_sink"] = Spec(FLOAT, (heads,))
    e.tensors[a + "q_norm.weight"] = Spec(FLOAT, (ql,))
    e.tensors[a + "kv_norm.weight"] = Spec(FLOAT, (hd,))
    e.linears.update({a + "wq_a": (ql, h), a + "wq_b": (heads * hd, ql), a + "wkv": (hd, h),
                      a + "wo_a": (groups * ol, heads * hd // groups), a + "wo_b": (h, groups * ol)})
    if ratio:
        _compressor(e, a + "compressor.", ratio, hd, h)
    if ratio == 4:
        e.linears[a + "indexer.wq_b"] = (cfg.index_n_heads * cfg.index_head_dim, ql)
        e.tensors[a + "indexer.weights_proj.weight"] = Spec(FLOAT, (cfg.index_n_heads, h))
        _compressor(e, a + "indexer.compressor.", ratio, cfg.index_head_dim, h)
    f = p + "ffn."
    n, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    e.tensors[f + "gate.weight"] = Spec(FLOAT, (n, h))
    if hashed:
        e.tensors[f + "gate.tid2eid"] = Spec(INDEX, (cfg.vocab_size, cfg.top_k), index_limit=n)
    else:
        e.tensors[f + "gate.bias"] = Spec(FLOAT, (n,))
    shared = inter * cfg.n_shared_experts
    e.linears.update({f + "shared_experts.w1": (shared, h), f + "shared_experts.w2": (h, shared),
                      f + "shared_experts.w3": (shared, h)})
    e.experts[f + "experts"] = (n, inter, h)
    return e


def mtp_tensors(cfg: ModelConfig, prefix: str, ratio: int) -> Expected:
    """An MTP block: a non-hash layer plus its projections, norms and ``hc_head_*``."""
    e = layer_tensors(cfg, prefix, ratio, hashed=False)
    h, p = cfg.hidden_size, prefix + "."
    e.linears.update({p + "e_proj": (h, h), p + "h_proj": (h, h)})
    for norm in ("enorm", "hnorm", "norm"):
        e.tensors[f"{p}{norm}.weight"] = Spec(FLOAT, (h,))
    _hc(e, p, "head", cfg)
    return e


def global_tensors(cfg: ModelConfig) -> Expected:
    """The embedding, the head, the final norm and ``hc_head_*``."""
    v, h = cfg.vocab_size, cfg.hidden_size
    e = Expected(tensors={"embed.weight": Spec(FLOAT, (v, h)), "head.weight": Spec(FLOAT, (v, h)),
                          "norm.weight": Spec(FLOAT, (h,))})
    _hc(e, "", "head", cfg)
    return e


def model_tensors(cfg: ModelConfig, mtp_ratios: tuple[int, ...] = ()) -> Expected:
    """Everything a checkpoint of ``cfg`` holds: global tensors, every layer, and one MTP block per entry of
    ``mtp_ratios`` (its compress ratio)."""
    e = global_tensors(cfg)
    for i, ratio in enumerate(cfg.compress_ratios):
        e.update(layer_tensors(cfg, f"layers.{i}", ratio, i < cfg.num_hash_layers))
    for j, ratio in enumerate(mtp_ratios):
        e.update(mtp_tensors(cfg, f"mtp.{j}", ratio))
    return e
