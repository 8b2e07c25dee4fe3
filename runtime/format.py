"""Format 1, the converted checkpoint: names, file names and version checks shared by writer and reader.

``docs/format.md`` is the specification; this module is its executable part. ``convert`` writes
what is named here and ``runtime`` reads it, so neither spells a file or tensor name on its own.
"""

from __future__ import annotations

import re
from pathlib import Path

from nvfp4_megamoe.errors import FormatError, shown
from nvfp4_megamoe.input_files import file_kind, read_json_object

FORMAT_NAME = "nvfp4-megamoe"
FORMAT_VERSION = 1  # the manifest of a canonical (``--target sm100``) checkpoint, and every shard header
# the manifest of a ``--target sm90`` checkpoint since its row tiles hold Hopper-order words: readers from before
# that change know row tiles by another step name and would read these as row-major; the version makes them refuse
ROW_TILES_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, ROW_TILES_FORMAT_VERSION)
MANIFEST_FILE = "nvfp4_manifest.json"
INDEX_FILE = "model.safetensors.index.json"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")

# Keys every shard header's __metadata__ carries.
SHARD_METADATA = {"format": "pt", "nvfp4_format": FORMAT_NAME, "nvfp4_format_version": str(FORMAT_VERSION)}


def shard_name(i: int, n: int) -> str:
    """File name of output shard ``i`` (1-based) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


_SHARD_NAME = re.compile(r"model-([0-9]{5,})-of-([0-9]{5,})\.safetensors")


def check_shard_name(name: object, where: str) -> str:
    """``name`` if it is a format-1 shard file name (:func:`shard_name`), else :class:`FormatError`: an index or
    manifest naming anything else (``../x``, an absolute path) would lead a reader outside the checkpoint."""
    m = _SHARD_NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or name != shard_name(int(m.group(1)), int(m.group(2))) or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise FormatError(f"{where} names the shard file {shown(name)!r}, which is not a format-1 shard name "
                          f"(model-NNNNN-of-NNNNN.safetensors inside the folder); refusing to read it. The checkpoint "
                          "was edited or is corrupt: convert it again.")
    return name


def fused_expert_names(prefix: str, proj: str) -> dict[str, str]:
    """Tensor names of a stacked/fused NVFP4 projection (``proj`` is ``w13`` or ``w2``) under ``prefix``."""
    base = f"{prefix}.{proj}"
    return {"weight": f"{base}.weight", "weight_scale": f"{base}.weight_scale", "alpha": f"{base}.alpha"}


def nvfp4_linear_names(prefix: str) -> dict[str, str]:
    """Tensor names of a dense NVFP4 linear ``prefix`` (codes, swizzled scales, alpha)."""
    return {"weight": f"{prefix}.weight", "weight_scale": f"{prefix}.weight_scale", "alpha": f"{prefix}.alpha"}


def fp8_linear_names(prefix: str) -> dict[str, str]:
    """Tensor names of an FP8 block-scaled linear ``prefix`` kept with ``--dense keep``."""
    return {"weight": f"{prefix}.weight", "scale": f"{prefix}.scale"}


# The manifest's transform step of packed weights written in Hopper row tiles (``--target sm90``,
# ``kernels/row_tiles.py``); a tensor whose ``transform`` lists it is tiled.
ROW_TILES_STEP = "row_tiles(16 rows x 64 bytes, hopper nibble order)"
# the step of the first row tiles (words in format 1's nibble order), which this version no longer reads
ROW_TILES_STEP_V0 = "row_tiles(16 rows x 64 bytes)"


def has_row_tiles(manifest: dict, name: str) -> bool:
    """Is output tensor ``name`` stored in Hopper row tiles (its manifest transform lists :data:`ROW_TILES_STEP`)?

    Raises :class:`FormatError` for the first row-tile layout (:data:`ROW_TILES_STEP_V0`)."""
    steps = manifest.get("tensors", {}).get(name, {}).get("transform", ())
    if ROW_TILES_STEP_V0 in steps:
        raise FormatError(f"{name}: routed weights in the first Hopper row-tile layout ({ROW_TILES_STEP_V0!r}, written "
                          f"before the Hopper nibble order); re-convert the source with `nvfp4-convert convert SRC DST "
                          f"--target sm90` (or `--target sm100`, read by every GPU).")
    return ROW_TILES_STEP in steps


def read_manifest(path: str | Path) -> dict:
    """Load and check a converted checkpoint's manifest.

    Raises :class:`FormatError` if ``path`` holds no manifest (not converted: run
    ``nvfp4-convert convert`` first) or one written by a newer/unknown format.
    """
    file = Path(path) / MANIFEST_FILE
    if file_kind(file) is None:
        raise FormatError(f"{path}: no {MANIFEST_FILE}; this is not a converted checkpoint. "
                          f"Convert it first with `nvfp4-convert convert SRC {path}`.", path=file)
    manifest = read_json_object(file, "the manifest is corrupt; convert the checkpoint again", FormatError)
    name, version = manifest.get("format"), manifest.get("format_version")
    if name != FORMAT_NAME:
        raise FormatError(f"{file}: format {name!r} is not {FORMAT_NAME!r}")
    if version not in READABLE_VERSIONS:
        raise FormatError(f"{file}: format version {version} is not supported by this version "
                          f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade nvfp4-megamoe or "
                          f"re-convert.")
    for key in ("tensors", "shards"):
        records = manifest.get(key, {})
        if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
            raise FormatError(f"{file}: {key!r} must map names to objects; the manifest is corrupt: convert the "
                              "checkpoint again.", path=file)
    return manifest


def alpha_shape(prefix: str, lead: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of ``prefix.alpha`` given the weight's leading (expert) dimensions.

    Stacked routed ``w13`` carries one global scale per half, ``[E, 2]`` (gate, up): ModelOpt
    exports scale w1 and w3 separately and a shared alpha would have to re-round one half's block
    scales. Everything else has one alpha per matrix: ``[E]`` stacked, ``[]`` dense.
    """
    return lead + (2,) if lead and prefix.endswith(".w13") else lead
