"""``inspect``: summarise a source or converted checkpoint (variant, tensor families, dtypes, bytes).

A local folder or a Hub repository (``owner/name``, through ``huggingface_hub``): from the Hub only
``config.json``, the index, a converted checkpoint's manifest and each shard's header (ranged reads) are fetched,
never a shard. No tensor is read, and torch is not imported.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from nvfp4_megamoe.errors import FormatError
from nvfp4_megamoe.input_files import file_kind
from nvfp4_megamoe.runtime.config import config_int
from nvfp4_megamoe.runtime.format import MANIFEST_FILE, ROW_TILES_FORMAT_VERSION, read_manifest

from .classify import classify
from .errors import PlanError, SourceError, shown
from .locate import Source, open_source
from .source import LocalSource
from .summary import layout_words, matrix_counts, matrix_line, tensor_kinds, tensor_line

# Source variant, detected from the formats the routed-expert rules found (never from config alone).
VARIANTS = {
    frozenset({"mxfp4"}): "official DeepSeek-V4 (MXFP4 experts, FP8 linears)",
    frozenset({"fp8"}): "DeepSeek-V4 -Base (FP8 experts, F32 scales)",
    frozenset({"nvfp4", "mxfp4"}): "ModelOpt NVFP4 export (NVFP4 experts, MXFP4 MTP experts)",
    frozenset({"nvfp4"}): "ModelOpt NVFP4 export (NVFP4 experts)",
    frozenset({"ct_nvfp4", "mxfp4"}): "compressed-tensors NVFP4 export (NVFP4 experts, MXFP4 MTP experts)",
    frozenset({"ct_nvfp4"}): "compressed-tensors NVFP4 export (NVFP4 experts)",
}


def _dtype_table(src: Source) -> dict[str, dict[str, int]]:
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for t in src.tensors.values():
        counts[t.info.dtype] += 1
        nbytes[t.info.dtype] += t.info.nbytes
    return {d: {"tensors": counts[d], "bytes": nbytes[d]} for d in sorted(counts)}



def _manifest(src: Source) -> dict | None:
    """The manifest of a converted checkpoint (None for a source checkpoint)."""
    local = isinstance(src, LocalSource)
    if (file_kind(src.root / MANIFEST_FILE) is None) if local else (MANIFEST_FILE not in src.extra_files()):
        return None
    try:
        return read_manifest(src.extra_file_path(MANIFEST_FILE).parent)  # a Hub manifest: downloaded to the cache
    except FormatError as exc:
        raise SourceError(str(exc), path=exc.path) from None


def inspect_checkpoint(path: str | Path, revision: str | None = None) -> dict:
    """A JSON-able summary of the checkpoint at ``path``: a local folder, or a Hub repo id (``owner/name``) at
    ``revision`` (headers only)."""
    src = open_source(path, revision=revision)
    try:
        summary: dict = {"path": src.description, "files": len(src.files), "tensors": len(src.tensors),
                         "bytes": sum(t.info.nbytes for t in src.tensors.values()), "dtypes": _dtype_table(src)}
        manifest = _manifest(src)
        if manifest is not None:
            record = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
            options = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
            target = options.get("target", "sm90" if manifest.get("format_version") == ROW_TILES_FORMAT_VERSION else "sm100")
            tensors = manifest.get("tensors", {})
            summary.update(kind="converted", format=layout_words(str(target)),
                           source=record.get("path") or record.get("repo_id"), options=options,
                           tensor_kinds=tensor_kinds(tensors), nvfp4_matrices=matrix_counts(tensors))
            return summary
        try:
            groups, counts = classify(src)
        except PlanError as exc:
            summary.update(kind="source (not fully mappable)", unmapped=[o[0] for o in exc.offenders])
            return summary
        fmts = frozenset(next(iter(g["fmt"])) for k, g in groups.items() if k[0] == "routed")
        try:
            layers = config_int(src.config, "num_hidden_layers", 0, minimum=0)
            experts = config_int(src.config, "n_routed_experts", 0, minimum=0)
        except FormatError as exc:
            raise SourceError(f"{src.description}/config.json: {str(exc).removeprefix('config.json: ')}") from None
        summary.update(kind="source", variant=VARIANTS.get(fmts, f"unknown mix {sorted(fmts)}"),
                       rules=dict(sorted(counts.items())), layers=layers, experts=experts)
        return summary
    finally:
        src.close()


def format_summary(s: dict) -> str:
    """Human-readable rendering of :func:`inspect_checkpoint`."""
    lines = [f"{s['path']}: {s['kind']}" + (f", {s['format']}" if "format" in s else "")]
    if "variant" in s:
        lines.append(f"  variant: {s['variant']}  ({s['layers']} layers, {s['experts']} routed experts)")
    if s.get("source"):
        lines.append(f"  converted from: {s['source']}  options: {s.get('options')}")
    lines.append(f"  {s['tensors']} tensors in {s['files']} files, {s['bytes']:,} bytes")
    lines.append("  dtypes:")
    lines += [f"    {d:8s} {v['tensors']:6d} tensors {v['bytes']:>16,} bytes" for d, v in s["dtypes"].items()]
    if "rules" in s:
        lines.append("  tensors per rule:")
        lines += [f"    {k:40s} {v:6d}" for k, v in s["rules"].items()]
    if "tensor_kinds" in s:
        lines.append(f"  {tensor_line(s['tensor_kinds'])}")
        lines.append(f"  {matrix_line(s['nvfp4_matrices'])}")
    if "unmapped" in s:
        lines.append(f"  tensors no rule maps ({len(s['unmapped'])}): " + ", ".join(shown(n) for n in s["unmapped"][:20]))
    return "\n".join(lines)
