"""One vocabulary for what a conversion holds, shared by ``convert``, ``demo``, ``inspect`` and ``verify``.

Tensors (the entries of the shards), by their manifest record: ``passthrough`` (copied byte for byte),
``lossless`` (converted, bit-exact), ``lossy`` (converted, error measured and recorded), ``input_scale``
(activation scales of a ModelOpt or compressed-tensors source, stacked unchanged). NVFP4 matrices: the converted
linears, each a ``.weight`` with its ``.weight_scale`` and ``.alpha``; a layer's routed experts count as one
stacked matrix per projection (``w13``, ``w2``). A checkpoint's layout, in words: format 1, canonical or Hopper
layout, with the ``--target`` that makes it.
"""

from __future__ import annotations

from collections import Counter

# the routed experts' stacked matrices, named ``P.ffn.experts.w13`` / ``.w2`` (docs/format.md)
ROUTED = ".ffn.experts."
LAYOUT_WORDS = {"sm100": "canonical layout", "sm90": "Hopper layout"}


def tensor_kind(entry: dict) -> str:
    """What the manifest record ``entry`` of one output tensor says it is (module docstring)."""
    transform = entry.get("transform") or []
    if transform == ["copy"]:
        return "passthrough"
    if transform == ["stack_input_scales"]:
        return "input_scale"
    return "lossless" if entry.get("lossless") else "lossy"


def counted(counts: dict[str, int]) -> str:
    """``lossless 36, lossy 138, passthrough 112``: kinds in name order."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def tensor_kinds(tensors: dict[str, dict]) -> dict[str, int]:
    """Tensors per kind, for a manifest's ``tensors``."""
    return dict(sorted(Counter(tensor_kind(e) for e in tensors.values()).items()))


def tensor_line(kinds: dict[str, int]) -> str:
    """``286 tensors (lossless 36, lossy 138, passthrough 112)``."""
    return f"{sum(kinds.values())} tensors ({counted(kinds)})"


def matrix_counts(tensors: dict[str, dict]) -> dict[str, int]:
    """NVFP4 matrices of a manifest's ``tensors``: in all, routed-expert stacks and dense, lossless and lossy."""
    kinds = {n: tensor_kind(e) for n, e in tensors.items() if n.endswith(".weight")}
    weights = [n for n, k in kinds.items() if k in ("lossless", "lossy")]
    routed = sum(ROUTED in n for n in weights)
    by_kind = Counter(kinds[n] for n in weights)
    return {"matrices": len(weights), "routed-expert stacks": routed, "dense": len(weights) - routed,
            "lossless": by_kind["lossless"], "lossy": by_kind["lossy"]}


def matrix_line(m: dict[str, int]) -> str:
    """``NVFP4 matrices: 58 (12 routed-expert stacks, 46 dense; lossless 12, lossy 46)``."""
    return (f"NVFP4 matrices: {m['matrices']} ({m['routed-expert stacks']} routed-expert stacks, {m['dense']} dense; "
            f"lossless {m['lossless']}, lossy {m['lossy']})")


def layout_words(target: str) -> str:
    """``format 1, Hopper layout (--target sm90)``: a converted checkpoint's layout as the docs name it."""
    return f"format 1, {LAYOUT_WORDS.get(target, f'unknown layout {target!r}')} (--target {target})"
