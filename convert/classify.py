"""Every source tensor matched to exactly one rule of the table (``rules.py``), grouped by the unit it belongs to.

Headers only (names and dtypes), no torch: ``inspect`` names a source's variant and families with it before any
tensor math, and the plan (``plan.py``) builds its units from the groups.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Protocol

from .errors import PlanError
from .rules import FUSED, index_problem, matching_rules
from .source import SourceTensor


class PlanSource(Protocol):
    config: dict
    tensors: dict[str, SourceTensor]
    files: list[str]
    description: str


def classify(source: PlanSource, offenders: list[tuple[str, str, str]] | None = None) -> tuple[dict, Counter]:
    """Match every tensor to exactly one rule; group them by unit key.

    Tensors that match no rule or several are appended to ``offenders`` when it is given
    (so the caller can report them with other problems), else raised as :class:`PlanError`.
    """
    collect = offenders is not None
    offenders = offenders if collect else []
    dtype_of = {n: t.info.dtype for n, t in source.tensors.items()}
    groups: dict[tuple, dict] = defaultdict(lambda: {"fmt": set(), "members": {}})
    counts: Counter = Counter()
    for name, t in source.tensors.items():
        found = matching_rules(name, t.info.dtype, dtype_of)
        if len(found) != 1:
            reason = (f"matches no rule (dtype {t.info.dtype}, shape {list(t.info.shape)}): "
                      + (index_problem(name) or "unknown tensor, or a weight without its scale") if not found else
                      "matches several rules: " + ", ".join(r.name for r, _ in found))
            offenders.append((name, t.file, reason))
            continue
        rule, m = found[0]
        counts[rule.name] += 1
        if rule.family == "passthrough":
            key: tuple = ("passthrough", name)
            member: tuple = (name,)
        elif rule.family == "routed":
            key, member = ("routed", m["unit"], FUSED[m["w"]]), (int(m["e"]), m["w"], m["role"])
        elif rule.family == "shared":
            key, member = ("dense", m["unit"], FUSED[m["w"]]), (0, m["w"], m["role"])
        else:
            key, member = ("dense", m["unit"], None), (0, None, m["role"])
        groups[key]["fmt"].add(rule.fmt)
        groups[key]["members"][member] = name
    if offenders and not collect:
        raise PlanError("source tensors that cannot be mapped", offenders)
    return groups, counts
