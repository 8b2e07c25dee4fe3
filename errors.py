"""Every error nvfp4-megamoe raises on purpose, under one base class.

Each message names the file or tensor, says what was expected and what to do; ``path`` and
``tensor`` carry the same facts for code that handles errors (both optional). The converter's
errors (:class:`ConvertError` and below) are not ``ValueError``: the converter turns a
``ValueError`` from a transform into a :class:`SourceError` naming the unit. The format's and
the kernels' errors are ``ValueError`` as well, so callers that catch ``ValueError`` keep working.

Names read from input (tensor names, shard names, journal entries) go through :func:`shown`
before they are printed, so that a name holding a newline cannot forge a line of output.
"""

from __future__ import annotations

import os


class Nvfp4MegamoeError(Exception):
    """Base class of every error the package raises on purpose."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor

    def add_hint(self, hint: str) -> None:
        """Append a sentence (what to do next) to the message."""
        self.args = (f"{self.args[0]} {hint}",) + self.args[1:]


class ConvertError(Nvfp4MegamoeError):
    """A conversion (or a check of one) cannot proceed; nothing misleading was written."""


class SourceError(ConvertError):
    """The source checkpoint is malformed (bad header, truncated file, bad index, bad values, bad config)."""


class PlanError(ConvertError):
    """Some source tensors cannot be mapped; ``offenders`` lists every one as (tensor, file, reason)."""

    def __init__(self, summary: str, offenders: list[tuple[str, str, str]]):
        self.offenders = offenders
        lines = [f"  {shown(name)}  [{shown(file)}]: {reason}" for name, file, reason in offenders[:200]]
        if len(offenders) > 200:
            lines.append(f"  ... and {len(offenders) - 200} more")
        super().__init__(f"{summary} ({len(offenders)} offending tensors; nothing was written):\n" + "\n".join(lines),
                         tensor=offenders[0][0] if offenders else None)


class OutputError(ConvertError):
    """The output folder cannot be used (holds another conversion, not writable, disk full)."""


class FormatError(Nvfp4MegamoeError, ValueError):
    """A folder is not a format-1 checkpoint this version can read; the message says what to do."""


class KernelArgumentError(Nvfp4MegamoeError, ValueError):
    """A kernel's host wrapper was given shapes, dtypes or options it does not support."""


class InputError(Nvfp4MegamoeError, ValueError):
    """The runtime was given inputs outside what the model accepts (token ids outside the vocabulary, ...)."""


class NotRegularFileError(Nvfp4MegamoeError, OSError):
    """A path that must be a regular file is a folder, a FIFO, a device or a socket (reading it could block)."""


def shown(name: object) -> str:
    """``name`` as it may be printed: unchanged when every character is printable, else ``repr`` (escaped)."""
    text = str(name)
    return text if text.isprintable() else repr(text)
