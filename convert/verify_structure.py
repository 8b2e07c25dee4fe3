"""File-level checks of a converted checkpoint: manifest, index and shards agree both ways.

Everything here reads headers and JSON only (plus whole files for the sha256), never tensor
values: each shard's size equals its header's end (``read_header`` catches truncation and
overlaps), the shard set, the tensor set and the tensor -> shard map are the same in the
manifest, the index and the headers, and dtypes/shapes match the plan re-made from the source
(or, without a source, what config.json implies for the NVFP4 families).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from nvfp4_megamoe.input_files import file_kind, read_json_object
from nvfp4_megamoe.kernels.swizzle import swizzled_nbytes
from nvfp4_megamoe.runtime.config import ModelConfig
from nvfp4_megamoe.runtime.format import INDEX_FILE, MANIFEST_FILE, SHARD_METADATA, FormatError, read_manifest, alpha_shape

from .errors import ConvertError, SourceError, shown
from .safetensors_header import Header, read_header

Fail = Callable[[str | None, str | None, str], None]  # (tensor, file, message)
MAX_LISTED = 20


@dataclass
class Layout:
    """What the file checks established about the output folder."""

    manifest: dict | None = None
    weight_map: dict[str, str] = field(default_factory=dict)
    headers: dict[str, Header] = field(default_factory=dict)  # readable shards only
    shard_of: dict[str, str] = field(default_factory=dict)  # tensor -> shard (manifest, else index)
    bad_shards: set[str] = field(default_factory=set)


def _listed(fail: Fail, items: list[tuple[str | None, str | None, str]]) -> None:
    for t, f, msg in items[:MAX_LISTED]:
        fail(t, f, msg)
    if len(items) > MAX_LISTED:
        fail(None, None, f"... and {len(items) - MAX_LISTED} more like the above")


def check_files(out: Path, fail: Fail, warn: Callable[[str], None]) -> Layout:
    """Manifest, index and shard headers of ``out``; every disagreement goes to ``fail``."""
    lay = Layout()
    try:
        lay.manifest = read_manifest(out)
    except FormatError as exc:
        fail(None, MANIFEST_FILE, str(exc))
        return lay
    try:
        index = read_json_object(out / INDEX_FILE, "a finished conversion writes it last", SourceError)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise SourceError(f"{out / INDEX_FILE}: no 'weight_map' object of tensor -> shard file names")
        lay.weight_map = dict(weight_map)
    except ConvertError as exc:
        fail(None, INDEX_FILE, f"cannot read the index: {exc}")
        index = {}
    shards: dict = lay.manifest.get("shards") or {}
    tensors: dict = lay.manifest.get("tensors") or {}
    for name, entry in shards.items():
        listed = entry.get("tensors", [])
        if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
            fail(None, name, f"the manifest's list of this shard's tensors is malformed ({type(listed).__name__})")
            entry["tensors"] = []
            continue
        for t in listed:
            lay.shard_of[t] = name
    for t, f in lay.weight_map.items():
        lay.shard_of.setdefault(t, f)

    index_files = set(lay.weight_map.values())
    on_disk = {p.name for p in out.glob("*.safetensors")}
    for name in sorted(shards):
        if name not in on_disk:
            lay.bad_shards.add(name)
            fail(None, name, "shard is missing: the manifest" + (" and the index" if name in index_files else "")
                 + f" list it with {len(shards[name].get('tensors', []))} tensors. Convert again (or copy the shard back).")
        elif file_kind(out / name) != "a regular file":
            lay.bad_shards.add(name)
            fail(None, name, f"is {file_kind(out / name)}, not a regular file; it was not read (a read could block "
                 "forever). Copy the real shard back, or convert again.")
    for name in sorted(index_files - set(shards)):
        fail(None, name, "the index maps tensors to this shard but the manifest does not list it")
        if name not in on_disk:
            lay.bad_shards.add(name)
    for name in sorted(on_disk - set(shards) - index_files):
        fail(None, name, "stray shard: present in the folder but in neither the manifest nor the index")
    for p in sorted(out.glob(".*.partial")):
        warn(f"{shown(p.name)}: an unfinished shard of an interrupted run is still in the folder")

    for name in sorted(set(shards) - lay.bad_shards):
        path = out / name
        size, want = os.path.getsize(path), shards[name].get("size")
        if want is not None and (not isinstance(want, int) or isinstance(want, bool)):
            fail(None, name, f"the manifest records its size as {want!r}, not a number of bytes")
        elif want is not None and size != want:
            fail(None, name, f"shard is {size} bytes, the manifest records {want}"
                 + (" (truncated)" if size < want else ""))
        try:
            header = read_header(path)
        except SourceError as exc:
            lay.bad_shards.add(name)
            fail(None, name, str(exc))
            continue
        lay.headers[name] = header
        meta = {k: header.metadata.get(k) for k in SHARD_METADATA}
        if meta != SHARD_METADATA:
            fail(None, name, f"header __metadata__ {meta} is not the format-1 metadata {SHARD_METADATA}")
        listed = list(shards[name].get("tensors", []))
        problems = [(t, name, "listed for this shard in the manifest but absent from its header")
                    for t in listed if t not in header.tensors]
        problems += [(t, name, "in the shard's header but not listed for it in the manifest")
                     for t in header.tensors if t not in set(listed)]
        _listed(fail, problems)

    problems = []
    for t in sorted(set(tensors) | set(lay.weight_map) | set(lay.shard_of)):
        where = lay.shard_of.get(t)
        if t not in tensors:
            problems.append((t, where, "in the index or a shard but without a manifest record"))
        if lay.weight_map and t not in lay.weight_map:
            problems.append((t, where, "not in the index weight_map"))
        elif lay.weight_map and where is not None and lay.weight_map[t] != where:
            problems.append((t, where, f"the index maps it to {shown(lay.weight_map[t])}, the manifest to "
                             f"{shown(where)}"))
        if t in tensors and where is None:
            problems.append((t, None, "has a manifest record but no shard holds it"))
    _listed(fail, problems)

    metadata = index.get("metadata") if isinstance(index, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if not lay.bad_shards and total is not None:
        have = sum(i.nbytes for h in lay.headers.values() for i in h.tensors.values())
        if total != have:
            fail(None, INDEX_FILE, f"metadata.total_size is {total}, the shards hold {have} tensor bytes")
    return lay


def nvfp4_groups(names: list[str] | set[str]) -> list[str]:
    """Prefixes ``X`` with ``X.weight``, ``X.weight_scale`` and ``X.alpha`` all present."""
    s = set(names)
    return sorted(n[: -len(".weight_scale")] for n in s if n.endswith(".weight_scale")
                  and n[: -len(".weight_scale")] + ".weight" in s and n[: -len(".weight_scale")] + ".alpha" in s)


def check_against_config(config: ModelConfig, lay: Layout, fail: Fail) -> None:
    """Without a source: the NVFP4 families' dtypes and shapes agree with each other and config.json."""
    info = {t: (h.path, i) for h in lay.headers.values() for t, i in h.tensors.items()}
    problems = []
    for prefix in nvfp4_groups(info):
        (wp, w), (_, s), (_, a) = info[prefix + ".weight"], info[prefix + ".weight_scale"], info[prefix + ".alpha"]
        shard = Path(wp).name
        lead = w.shape[:-2]
        if w.dtype != "U8" or len(w.shape) not in (2, 3):
            problems.append((prefix + ".weight", shard, f"is {w.dtype} {list(w.shape)}, expected U8 [(E,) R, K/2]"))
            continue
        rows, kb = w.shape[-2], 2 * w.shape[-1] // 16
        want = lead + (swizzled_nbytes(rows, kb),)
        if s.dtype != "U8" or s.shape != want:
            problems.append((prefix + ".weight_scale", shard, f"is {s.dtype} {list(s.shape)}, expected U8 {list(want)}"))
        if a.dtype != "F32" or a.shape != alpha_shape(prefix, lead):
            problems.append((prefix + ".alpha", shard, f"is {a.dtype} {list(a.shape)}, expected F32 "
                             f"{list(alpha_shape(prefix, lead))}"))
        if ".ffn.experts." in prefix + ".":
            e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
            fused = prefix.rsplit(".", 1)[1]
            want_w = (e, 2 * i, h // 2) if fused == "w13" else (e, h, i // 2)
            if w.shape != want_w:
                problems.append((prefix + ".weight", shard, f"shape {list(w.shape)} contradicts config.json "
                                 f"(expected {list(want_w)})"))
        for kind in ("input_scale", "input_global_scale"):  # ModelOpt / compressed-tensors activation scales
            inp = info.get(f"{prefix}.{kind}")
            if inp is not None:
                want_i = lead + ((2,) if prefix.endswith("w13") else ())
                if inp[1].dtype != "F32" or inp[1].shape != want_i:
                    problems.append((f"{prefix}.{kind}", shard, f"is {inp[1].dtype} {list(inp[1].shape)}, "
                                     f"expected F32 {list(want_i)}"))
    _listed(fail, problems)
