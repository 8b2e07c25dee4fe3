"""The tensors a source checkpoint must hold for its config.json, checked in the plan before a byte is written.

The table is the runtime's (``runtime/expected.py``, the one ``load_model`` checks a converted checkpoint
against). This module reads config.json (a missing or mistyped field is a :class:`SourceError` naming it),
adds the MTP blocks the config declares, and compares the table with the source's tensors as the rule
table classified them:

* every tensor of a layer belongs to a declared layer (``layers.N``: N < ``num_hidden_layers``;
  ``mtp.N``: N < ``num_nextn_predict_layers``);
* a tensor copied as it is must be one the config asks for, of an allowed dtype and its exact shape;
* an FP8 linear must be one the config asks for, its weight ``[out, in]`` (and, kept with
  ``--dense keep``, its block scales ``[ceil(out/128), ceil(in/128)]``; converted, the plan checks them);
* nothing the config asks for is missing.

The routed experts of every declared layer are checked by the plan, which knows each source format's roles
(``units.ROLES``): every expert below ``n_routed_experts``, every role, shapes from the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nvfp4_megamoe.errors import FormatError
from nvfp4_megamoe.runtime.config import COMPRESS_RATIOS, ModelConfig, config_int
from nvfp4_megamoe.runtime.expected import Expected, fp8_scale_shape, model_tensors

from .errors import SourceError

_LAYER = re.compile(r"(layers|mtp)\.([0-9]+)\.")
Offenders = list[tuple[str, str, str]]


@dataclass
class SourceModel:
    """A source's config.json, read and checked, and the tensors it asks for."""

    config: ModelConfig
    mtp_ratios: tuple[int, ...]
    expected: Expected

    @property
    def layer_counts(self) -> dict[str, int]:
        return {"layers": self.config.num_layers, "mtp": len(self.mtp_ratios)}


def _mtp_ratios(cfg: dict, layers: int) -> tuple[int, ...]:
    """One compress ratio per MTP block: ``compress_ratios`` lists them after the layers' (0 when it does not)."""
    count = config_int(cfg, "num_nextn_predict_layers", 0, minimum=0)
    listed = cfg.get("compress_ratios") if isinstance(cfg.get("compress_ratios"), list) else []
    ratios = tuple(listed[layers:layers + count]) + (0,) * max(0, count - len(listed[layers:]))
    bad = [r for r in ratios if r not in COMPRESS_RATIOS or isinstance(r, bool)]
    if bad:
        raise FormatError(f"config.json: the MTP compress ratio {bad[0]!r} is not one of {COMPRESS_RATIOS}")
    return ratios


def source_model(config: dict, where: str) -> SourceModel:
    """Read ``config`` (the source's config.json, at ``where``); :class:`SourceError` for a bad field."""
    try:
        model = ModelConfig.from_dict(config)
        mtp = _mtp_ratios(config, model.num_layers)
    except FormatError as exc:
        raise SourceError(f"{where}: {str(exc).removeprefix('config.json: ')} The plan was not made; nothing was "
                          "written.", path=where) from None
    return SourceModel(model, mtp, model_tensors(model, mtp))


def layer_problem(name: str, model: SourceModel) -> str | None:
    """Why ``name`` (matched by a rule, so its indices are canonical) lies outside the layers declared, or None."""
    m = _LAYER.match(name)
    if m is None:
        return None
    kind, index = m.group(1), int(m.group(2))
    limit = model.layer_counts[kind]
    if index < limit:
        return None
    key = "num_hidden_layers" if kind == "layers" else "num_nextn_predict_layers"
    return (f"{kind} {index} is beyond what config.json declares ({key} = {limit}); the config and the checkpoint "
            "disagree (fix config.json, or remove the extra layer's tensors)")


def _why(name: str, model: SourceModel) -> str:
    m = _LAYER.match(name)
    if m is None:
        return ""
    layer = f"{m.group(1)}.{m.group(2)}"
    return f" ({layer}: {model.expected.why.get(layer, '')})"


def check_source(tensors: dict, groups: dict, model: SourceModel, dense_keep: bool, offenders: Offenders) -> None:
    """Compare the classified source (``groups`` from ``classify.classify``) with ``model``'s table; every problem
    is appended to ``offenders`` as (tensor, file, reason)."""
    expected = model.expected
    file_of = lambda n: tensors[n].file  # noqa: E731
    seen_tensors, seen_linears = set(), set()
    for key, group in groups.items():
        for member, name in group["members"].items():
            why = layer_problem(name, model)
            if why is not None:
                offenders.append((name, file_of(name), why))
                continue
            info = tensors[name].info
            if key[0] == "passthrough":
                spec = expected.tensors.get(name)
                seen_tensors.add(name)
                if spec is None:
                    offenders.append((name, file_of(name), "config.json asks for no such tensor" + _why(name, model)))
                elif info.dtype not in spec.dtypes or info.shape != spec.shape:
                    offenders.append((name, file_of(name), f"is {info.dtype} {list(info.shape)}, config.json implies "
                                      f"{spec.describe()}"))
            elif key[0] == "dense":
                _, part, role = member
                prefix = key[1] + (f".{part}" if part else "")
                shape = expected.linears.get(prefix)
                seen_linears.add(prefix)
                if shape is None:
                    offenders.append((name, file_of(name), "config.json asks for no such linear" + _why(name, model)))
                elif role == "weight" and info.shape != shape:
                    offenders.append((name, file_of(name), f"shape {list(info.shape)} contradicts config.json "
                                      f"(expected {list(shape)})"))
                elif role == "scale" and dense_keep and info.shape != fp8_scale_shape(*shape):
                    offenders.append((name, file_of(name), f"shape {list(info.shape)} contradicts config.json (the "
                                      f"128x128 block scales of a {list(shape)} weight are {list(fp8_scale_shape(*shape))})"))
    for name in sorted(set(expected.tensors) - seen_tensors):
        offenders.append((name, "-", "missing: config.json asks for it" + _why(name, model)))
    for prefix in sorted(set(expected.linears) - seen_linears):
        offenders.append((f"{prefix}.weight", "-", "missing: config.json asks for this FP8 linear (weight and scale)"
                          + _why(prefix, model)))
