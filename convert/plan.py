"""The plan: every source tensor matched to one rule, grouped into units, outputs laid out in shards.

Built from the config and the safetensors headers alone (no tensor data), so ``--dry-run`` and
the Hub path need no shard download. Any tensor that matches no rule or two, a unit missing a
sibling, a layer missing an expert, or a shape that contradicts config.json raises
:class:`PlanError` listing every offender before anything is written.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .classify import PlanSource, classify
from .errors import PlanError
from .options import DENSE_MODES, TARGETS, Options
from .required import SourceModel, check_source, layer_problem, source_model
from .rules import FUSED_PARTS
from .source import E4M3_MAX

if TYPE_CHECKING:
    from .units import FusedMatrices, OutputSpec, Unit

# ``units`` (the conversion code, torch) and the kernels' row tiles are imported by the functions that build
# units: the torch-free steps before a plan (``classify``, the output-folder checks) import this module too.


@dataclass
class Plan:
    options: Options
    units: list[Unit]
    shards: list[list[OutputSpec]]
    rule_counts: Counter = field(default_factory=Counter)

    @property
    def outputs(self) -> list[OutputSpec]:
        return [o for shard in self.shards for o in shard]

    @property
    def total_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def _shape(source: PlanSource, name: str) -> tuple[int, ...]:
    return source.tensors[name].info.shape


def _expected_shapes(fmt: str, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    blocks = (-(-rows // 128), -(-cols // 128))
    return {
        "mxfp4": {"weight": ((rows, cols // 2),), "scale": ((rows, cols // 32),)},
        "fp8": {"weight": ((rows, cols),), "scale": (blocks,)},
        "nvfp4": {"weight": ((rows, cols // 2),), "weight_scale": ((rows, cols // 16),),
                  "weight_scale_2": ((), (1,)), "input_scale": ((), (1,))},
        "ct_nvfp4": {"weight_packed": ((rows, cols // 2),), "weight_scale": ((rows, cols // 16),),
                     "weight_global_scale": ((1,), ()), "input_global_scale": ((1,), ())},
    }[fmt]


def _matrix_unit(source: PlanSource, key: tuple, group: dict, model: SourceModel, offenders: list,
                 row_tiles: bool = False) -> FusedMatrices | None:
    from nvfp4_megamoe.kernels.row_tiles import ROWS, TILE_BYTES, tileable

    from .units import ROLES, FusedMatrices

    kind, prefix, fused = key
    fmts = group["fmt"]
    members = group["members"]
    first = next(iter(members.values()))
    file_of = lambda n: source.tensors[n].file  # noqa: E731
    if len(fmts) != 1:
        offenders.append((first, file_of(first), f"{prefix} mixes source formats {sorted(fmts)}"))
        return None
    fmt = fmts.pop()
    if kind == "routed":
        n_experts = model.config.n_routed_experts
        hidden, inter = model.config.hidden_size, model.config.moe_intermediate_size
        rows, cols = (inter, hidden) if fused == "w13" else (hidden, inter)
        items = range(n_experts)
        parts = FUSED_PARTS[fused]
        out_prefix = f"{prefix}.{fused}"
        extra = sorted({e for e, _, _ in members} - set(items))
        for e in extra:
            n = next(v for (i, _, _), v in members.items() if i == e)
            offenders.append((n, file_of(n), f"expert {e} is beyond n_routed_experts={n_experts} in config.json"))
    else:
        parts = FUSED_PARTS[fused] if fused else (None,)
        items = range(1)
        out_prefix = f"{prefix}.{fused}" if fused else prefix
        w0 = members.get((0, parts[0], "weight"))
        if w0 is None:
            offenders.append((first, file_of(first), f"{prefix}: missing {parts[0] or ''} weight"))
            return None
        shp = _shape(source, w0)
        rows, cols = shp[0], shp[1] * (2 if fmt != "fp8" else 1)
    expected = _expected_shapes(fmt, rows, cols)
    known = len(offenders)
    table: list[list[dict[str, str]]] = []
    for e in items:
        item = []
        for w in parts:
            roles = {}
            for role in ROLES[fmt]:
                name = members.get((e, w, role))
                where = f"{prefix}" + (f".{e}" if kind == "routed" else "") + (f".{w}" if w else "") + f".{role}"
                if name is None:
                    offenders.append((where, "-", f"missing (needed by {out_prefix}, source format {fmt})"))
                    continue
                if _shape(source, name) not in expected[role]:
                    offenders.append((name, file_of(name), f"shape {list(_shape(source, name))} contradicts config.json "
                                      f"(expected {' or '.join(str(list(s)) for s in expected[role])})"))
                roles[role] = name
            item.append(roles)
        table.append(item)
    if cols % 32 or rows % 8:
        offenders.append((first, file_of(first), f"shape [{rows}, {cols}] cannot become NVFP4 (needs in % 32 == 0, out % 8 == 0)"))
    if len(offenders) > known:
        return None
    if row_tiles and not tileable(len(parts) * rows, cols // 2):
        offenders.append((f"{prefix}.*.{'/'.join(parts)}", "-",
                          f"--target sm90 tiles routed experts by {ROWS} output rows x {2 * TILE_BYTES} inputs, "
                          f"which [{len(parts) * rows}, {cols}] does not divide into; convert with --target sm100"))
        return None
    return FusedMatrices(out_prefix, fmt, table, rows, cols, stacked=kind == "routed", row_tiles=row_tiles)


def build_units(source: PlanSource, options: Options) -> tuple[list[Unit], Counter]:
    """Rule-match, group and validate; returns units in source-file order."""
    from .units import Passthrough

    if options.dense not in DENSE_MODES:
        raise ValueError(f"dense must be one of {DENSE_MODES}, got {options.dense!r}")
    if options.target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {options.target!r}")
    model = source_model(source.config, f"{source.description}/config.json")
    offenders: list[tuple[str, str, str]] = []
    groups, counts = classify(source, offenders)
    check_source(source.tensors, groups, model, options.dense == "keep", offenders)
    units: list[Unit] = []
    for key, group in groups.items():
        if key[0] == "passthrough" or (key[0] == "dense" and options.dense == "keep"):
            for member, name in group["members"].items():
                info = source.tensors[name].info
                spec = model.expected.tensors.get(name)
                units.append(Passthrough(name, info.dtype, info.shape,
                                         element_max=E4M3_MAX if key[0] == "dense" and member[2] == "scale" else None,
                                         index_limit=spec.index_limit if spec is not None else None))
        elif layer_problem(f"{key[1]}.", model) is None:  # a layer the config lacks was reported by check_source
            unit = _matrix_unit(source, key, group, model, offenders,
                                row_tiles=options.target == "sm90" and key[0] == "routed")
            if unit is not None:
                units.append(unit)
    present = {(k[1], k[2]) for k in groups if k[0] == "routed"}
    for layer in model.expected.experts:
        for fused in ("w13", "w2"):
            if (layer, fused) not in present:
                offenders.append((f"{layer}.*.{'/'.join(FUSED_PARTS[fused])}", "-",
                                  "config.json declares this layer but the checkpoint has none of its routed experts"))
    if offenders:
        raise PlanError("source tensors that cannot be mapped, are missing or contradict config.json", offenders)
    order = {f: i for i, f in enumerate(source.files)}
    pos = lambda n: (order[source.tensors[n].file], source.tensors[n].info.start)  # noqa: E731
    units.sort(key=lambda u: min(pos(n) for n in u.sources))
    return units, counts


# Upper bounds on a shard header's bytes: fixed part (length, metadata, padding) and per tensor
# (quotes, dtype, offsets of up to 20 digits each), so file sizes, not just tensor bytes, stay
# under the limit.
HEADER_FIXED_BYTES = 512
HEADER_ENTRY_BYTES = 96


def _header_bytes(o: OutputSpec) -> int:
    return HEADER_ENTRY_BYTES + len(o.name) + len(json.dumps(list(o.shape)))


def assign_shards(outputs: list[OutputSpec], shard_size: int) -> list[list[OutputSpec]]:
    """Greedy, in order: a new shard starts when the next tensor would take the file past ``shard_size``.

    A single tensor larger than ``shard_size`` gets a shard of its own.
    """
    shards: list[list[OutputSpec]] = [[]]
    size = HEADER_FIXED_BYTES
    for o in outputs:
        cost = o.nbytes + _header_bytes(o)
        if shards[-1] and size + cost > shard_size:
            shards.append([])
            size = HEADER_FIXED_BYTES
        shards[-1].append(o)
        size += cost
    return shards


def make_plan(source: PlanSource, options: Options | None = None) -> Plan:
    """The complete plan for converting ``source``; raises :class:`PlanError` on any offender."""
    options = options or Options()
    units, counts = build_units(source, options)
    outputs = [o for u in units for o in u.outputs]
    return Plan(options, units, assign_shards(outputs, options.shard_size), counts)
