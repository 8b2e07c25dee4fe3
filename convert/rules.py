"""The rule table: which source tensors exist in each supported variant and where they go.

Every source tensor must match exactly one rule (name pattern + its own dtype + the dtypes of
named siblings); that is how a tensor's format is detected, never from config alone. A rule
puts its tensor into a *unit* (a group of tensors converted together) under a *role*:

* ``routed``  - one layer's routed experts of one fused projection (w1+w3 -> w13, or w2)
* ``dense``   - one FP8 linear (``attn.wq_a``, ...); the shared expert's w1+w3 fuse into one unit
* ``passthrough`` - copied byte for byte

Supported sources: official V4-Flash/V4-Pro (MXFP4 experts, FP8 + E8M0 scales), -Base (FP8
experts, F32 scales), NVIDIA ModelOpt NVFP4 exports (NVFP4 backbone experts, MXFP4 MTP
experts) and compressed-tensors NVFP4 exports (llm-compressor; ``weight_packed`` /
``weight_global_scale`` naming, MXFP4 MTP experts). A new variant is new rows here, not new branches elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# An index (layer, MTP layer, expert) is canonical decimal: ASCII digits, no leading zero. ``experts.03`` or
# ``layers.01`` would otherwise name the same expert or layer as ``experts.3`` or ``layers.1`` (``int`` reads
# both), and one of the two would silently replace the other.
INDEX = r"(?:0|[1-9][0-9]*)"
LAYER = rf"(?:layers|mtp)\.{INDEX}"
PROJ = r"(?P<w>w[123])"
FUSED = {"w1": "w13", "w3": "w13", "w2": "w2"}
FUSED_PARTS = {"w13": ("w1", "w3"), "w2": ("w2",)}

FP4_BYTES = ("I8", "U8")
E8M0 = ("F8_E8M0", "U8")
FP8 = ("F8_E4M3",)


@dataclass(frozen=True)
class Rule:
    """One row of the table. ``requires`` maps sibling roles to the dtypes they must have."""

    name: str
    pattern: re.Pattern
    dtypes: tuple[str, ...] | None  # None: any dtype (passthrough)
    family: str
    fmt: str
    role: str
    requires: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _rule(name, pattern, dtypes, family, fmt, role, **requires) -> Rule:
    return Rule(name, re.compile(pattern), dtypes, family, fmt, role, tuple(requires.items()))


_ROUTED = rf"^(?P<unit>{LAYER}\.ffn\.experts)\.(?P<e>{INDEX})\.{PROJ}\.(?P<role>{{}})$"
_DENSE = rf"^(?P<unit>(?:{LAYER}\.attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|mtp\.{INDEX}\.(?:e_proj|h_proj)))\.(?P<role>{{}})$"
_SHARED = rf"^(?P<unit>{LAYER}\.ffn\.shared_experts)\.{PROJ}\.(?P<role>{{}})$"

RULES: tuple[Rule, ...] = (
    # Routed experts, official MXFP4: int8 [out, in/2] + E8M0 [out, in/32].
    _rule("routed.mxfp4.weight", _ROUTED.format("weight"), FP4_BYTES, "routed", "mxfp4", "weight", scale=E8M0),
    _rule("routed.mxfp4.scale", _ROUTED.format("scale"), E8M0, "routed", "mxfp4", "scale", weight=FP4_BYTES),
    # Routed experts, -Base FP8: F8_E4M3 [out, in] + F32 (or E8M0) 128x128 block scales.
    _rule("routed.fp8.weight", _ROUTED.format("weight"), FP8, "routed", "fp8", "weight", scale=("F32",) + E8M0),
    _rule("routed.fp8.scale", _ROUTED.format("scale"), ("F32",) + E8M0, "routed", "fp8", "scale", weight=FP8),
    # Routed experts, ModelOpt NVFP4: U8 [out, in/2] + E4M3 [out, in/16] + F32 weight_scale_2 + F32 input_scale.
    _rule("routed.nvfp4.weight", _ROUTED.format("weight"), ("U8",), "routed", "nvfp4", "weight",
          weight_scale=FP8, weight_scale_2=("F32",)),
    _rule("routed.nvfp4.weight_scale", _ROUTED.format("weight_scale"), FP8, "routed", "nvfp4", "weight_scale", weight=("U8",)),
    _rule("routed.nvfp4.weight_scale_2", _ROUTED.format("weight_scale_2"), ("F32",), "routed", "nvfp4", "weight_scale_2", weight=("U8",)),
    _rule("routed.nvfp4.input_scale", _ROUTED.format("input_scale"), ("F32",), "routed", "nvfp4", "input_scale", weight=("U8",)),
    # Routed experts, compressed-tensors NVFP4 (llm-compressor ``nvfp4-pack-quantized``): U8 weight_packed
    # [out, in/2] + E4M3 weight_scale [out, in/16] + F32 weight_global_scale [1] (a divisor: 1 / ModelOpt's
    # weight_scale_2) + input_global_scale [1] (F32; BF16 seen in some releases).
    _rule("routed.ct_nvfp4.weight_packed", _ROUTED.format("weight_packed"), ("U8",), "routed", "ct_nvfp4",
          "weight_packed", weight_scale=FP8, weight_global_scale=("F32",)),
    _rule("routed.ct_nvfp4.weight_scale", _ROUTED.format("weight_scale"), FP8, "routed", "ct_nvfp4", "weight_scale",
          weight_packed=("U8",)),
    _rule("routed.ct_nvfp4.weight_global_scale", _ROUTED.format("weight_global_scale"), ("F32",), "routed", "ct_nvfp4",
          "weight_global_scale", weight_packed=("U8",)),
    _rule("routed.ct_nvfp4.input_global_scale", _ROUTED.format("input_global_scale"), ("F32", "BF16"), "routed",
          "ct_nvfp4", "input_global_scale", weight_packed=("U8",)),
    # Dense FP8 linears and the shared expert: F8_E4M3 + E8M0 (official) or F32 (-Base) block scales.
    _rule("dense.fp8.weight", _DENSE.format("weight"), FP8, "dense", "fp8", "weight", scale=("F32",) + E8M0),
    _rule("dense.fp8.scale", _DENSE.format("scale"), ("F32",) + E8M0, "dense", "fp8", "scale", weight=FP8),
    _rule("shared.fp8.weight", _SHARED.format("weight"), FP8, "shared", "fp8", "weight", scale=("F32",) + E8M0),
    _rule("shared.fp8.scale", _SHARED.format("scale"), ("F32",) + E8M0, "shared", "fp8", "scale", weight=FP8),
    # Everything below is copied byte for byte.
    _rule("passthrough.global", r"^(?:embed\.weight|head\.weight|norm\.weight|hc_head_(?:fn|base|scale))$",
          None, "passthrough", "raw", "tensor"),
    _rule("passthrough.hc", rf"^{LAYER}\.(?:hc_(?:attn|ffn|head)_(?:fn|base|scale))$", None, "passthrough", "raw", "tensor"),
    _rule("passthrough.norm", rf"^{LAYER}\.(?:attn_norm|ffn_norm|attn\.q_norm|attn\.kv_norm)\.weight$",
          None, "passthrough", "raw", "tensor"),
    _rule("passthrough.sink", rf"^{LAYER}\.attn\.attn_sink$", None, "passthrough", "raw", "tensor"),
    _rule("passthrough.gate", rf"^{LAYER}\.ffn\.gate\.(?:weight|bias|tid2eid)$", None, "passthrough", "raw", "tensor"),
    _rule("passthrough.compressor",
          rf"^{LAYER}\.attn\.(?:indexer\.)?compressor\.(?:ape|wkv\.weight|wgate\.weight|norm\.weight)$",
          None, "passthrough", "raw", "tensor"),
    _rule("passthrough.indexer", rf"^{LAYER}\.attn\.indexer\.weights_proj\.weight$", None, "passthrough", "raw", "tensor"),
    _rule("passthrough.mtp", rf"^mtp\.{INDEX}\.(?:enorm|hnorm|norm)\.weight$", None, "passthrough", "raw", "tensor"),
)


def sibling_name(match: re.Match, role: str) -> str:
    """The name of the tensor that sits beside ``match``'s tensor under another role."""
    name = match.string
    return name[: match.start("role")] + role + name[match.end("role"):]


def matching_rules(name: str, dtype: str, dtype_of: dict[str, str]) -> list[tuple[Rule, re.Match]]:
    """Every rule that ``name`` (of ``dtype``) satisfies, with its siblings' dtypes from ``dtype_of``.

    The whole name must match (``fullmatch``: a ``$`` alone would also accept a trailing newline)."""
    found = []
    for rule in RULES:
        m = rule.pattern.fullmatch(name)
        if m is None or (rule.dtypes is not None and dtype not in rule.dtypes):
            continue
        if all(dtype_of.get(sibling_name(m, role)) in dts for role, dts in rule.requires):
            found.append((rule, m))
    return found


_ANY_INDEX = re.compile(r"(?:^|\.)(?:layers|mtp|experts)\.(\w+)(?=\.|$)")


def index_problem(name: str) -> str | None:
    """Why a name that no rule maps may have been meant as a layer or expert (a non-canonical index), or None."""
    for m in _ANY_INDEX.finditer(name):
        text = m.group(1)
        if not re.fullmatch(INDEX, text) and text.isdigit():
            return (f"index {text!r} is not canonical decimal (write {int(text)}, without leading zeros or non-ASCII "
                    "digits); the converter does not guess which tensor it was meant to be")
    return None
