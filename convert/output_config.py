"""The converted checkpoint's non-tensor files, written so that other tools read format 1 for what it is.

An engine picks its loader from ``config.json``'s ``quantization_config`` (``quant_method``) and, for ModelOpt
exports, from ``hf_quant_config.json``. Copied as they were, they would describe the source (``fp8`` with 128x128
weight blocks, ModelOpt NVFP4 with its own scale names), and an engine reading them would misread format 1. So:

* ``config.json``: the source's, with ``quantization_config`` describing format 1 (:func:`format1_quantization`)
  in the place of the source's block, which is kept unchanged under ``source_quantization_config``
  (:func:`converted_config`; :func:`source_config` is its inverse);
* ``hf_quant_config.json`` (ModelOpt): kept, bytes unchanged, as ``source_hf_quant_config.json``
  (:data:`RENAMED`), and named in ``quantization_config.renamed_source_files``;
* every other non-tensor file (generation config, tokenizer): copied unchanged.

The runtime reads only the model's fields of ``config.json`` (``runtime/config.py``), never these blocks; the
manifest stays the per-tensor record.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from nvfp4_megamoe.runtime.format import FORMAT_NAME

if TYPE_CHECKING:
    from .locate import Source
    from .plan import Plan

QUANT_METHOD = FORMAT_NAME
SOURCE_KEY = "source_quantization_config"
# foreign quantisation files -> the name they are kept under (an engine looking for the first must not find it)
RENAMED = {"hf_quant_config.json": "source_hf_quant_config.json"}
GROUP_SIZE = 16
LAYOUTS = {"sm100": "canonical", "sm90": "hopper-row-tiles"}
_LAYER = re.compile(r"^(layers|mtp)\.[0-9]+\.")


def _patterns(names: set[str]) -> list[str]:
    """Tensor-name prefixes with the layer index as ``*`` (``layers.3.attn.wq_a`` -> ``layers.*.attn.wq_a``)."""
    return sorted({_LAYER.sub(r"\1.*.", n) for n in names})


def format1_quantization(plan: Plan, renamed: dict[str, str]) -> dict:
    """``quantization_config`` of a conversion made by ``plan``: which linears are NVFP4 (and how), which kept the
    source's FP8, which activation scales were kept; everything else is as the source had it."""
    dtypes = {o.name: o.dtype for o in plan.outputs}
    copied = {o.name for o in plan.outputs if o.transform == ["copy"]}
    nvfp4 = {o.name.removesuffix(".weight") for o in plan.outputs if o.name.endswith(".weight") and o.name not in copied}
    fp8 = {n.removesuffix(".weight") for n in copied if n.endswith(".weight") and dtypes[n] == "F8_E4M3"}
    block = {
        "quant_method": QUANT_METHOD,
        "format": 1,
        "layout": LAYOUTS[plan.options.target],
        "target": plan.options.target,
        "group_size": GROUP_SIZE,
        "weight_format": "e2m1, two per byte (low nibble = even element), tensor X.weight",
        "block_scale_format": "e4m3, one per 16 weights along K, 128x4 swizzle, tensor X.weight_scale",
        "global_scale_format": "float32, value = e2m1 * e4m3 * alpha, tensor X.alpha",
        "nvfp4_linears": _patterns(nvfp4),
        "activations": "not quantized (the runtime computes in BF16/float32)",
        "unchanged": "every other tensor, as the source had it (nvfp4_manifest.json lists each tensor's transform)",
    }
    if fp8:
        scales = sorted({dtypes[f"{p}.scale"] for p in fp8 if f"{p}.scale" in dtypes})
        block["fp8_linears"] = _patterns(fp8)
        block["fp8_format"] = {"weight": "F8_E4M3", "weight_block_size": [128, 128], "scale": scales}
    kept_inputs = {o.name for o in plan.outputs if o.name.endswith((".input_scale", ".input_global_scale"))}
    if kept_inputs:
        block["kept_activation_scales"] = _patterns(kept_inputs)
    if renamed:
        block["renamed_source_files"] = dict(renamed)
    return block


def converted_config(source: dict, quantization: dict) -> dict:
    """The converted ``config.json``: ``source`` with ``quantization`` as its ``quantization_config`` (in the
    source block's place) and the source's block, if any, under :data:`SOURCE_KEY`."""
    cfg = dict(source)
    if "quantization_config" in source:
        cfg[SOURCE_KEY] = source["quantization_config"]  # last; the format-1 block takes the source block's place
    cfg["quantization_config"] = quantization
    return cfg


def source_config(converted: dict) -> dict:
    """The inverse of :func:`converted_config`: the source's ``config.json`` (same keys, same order)."""
    cfg = dict(converted)
    if SOURCE_KEY in cfg:
        cfg["quantization_config"] = cfg.pop(SOURCE_KEY)
    else:
        cfg.pop("quantization_config", None)
    return cfg


def write_extra_files(src: Source, out: Path, plan: Plan) -> None:
    """Write the source's non-tensor files into ``out`` (see the module docstring)."""
    names = src.extra_files()
    renamed = {n: RENAMED[n] for n in names if n in RENAMED}
    for name in names:
        if name == "config.json":
            cfg = converted_config(src.config, format1_quantization(plan, renamed))
            (out / name).write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(src.extra_file_path(name), out / renamed.get(name, name))
