"""Errors the converter raises. Each message names the file or tensor and says what was expected.

The CLI turns any :class:`ConvertError` into a one-paragraph message and a non-zero exit.
"""

from __future__ import annotations


class ConvertError(Exception):
    """Base class: a conversion cannot proceed; nothing misleading was written."""


class SourceError(ConvertError):
    """The source checkpoint is malformed (bad header, truncated file, bad index, bad values)."""


class PlanError(ConvertError):
    """Some source tensors cannot be mapped; ``offenders`` lists every one as (tensor, file, reason)."""

    def __init__(self, summary: str, offenders: list[tuple[str, str, str]]):
        self.offenders = offenders
        lines = [f"  {name}  [{file}]: {reason}" for name, file, reason in offenders[:200]]
        if len(offenders) > 200:
            lines.append(f"  ... and {len(offenders) - 200} more")
        super().__init__(f"{summary} ({len(offenders)} offending tensors; nothing was written):\n" + "\n".join(lines))


class OutputError(ConvertError):
    """The output folder cannot be used (holds another conversion, not writable, disk full)."""
