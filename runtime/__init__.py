"""Load a converted (format 1) DeepSeek-V4 checkpoint and run it: ``load_model(path)(input_ids)``.

The names below are imported on first use (PEP 562), so that ``nvfp4_megamoe.runtime.format`` and
``.config``, which the converter's command line reads before any tensor math, do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module of this package that defines it
_EXPORTS = {
    "load_model": "model", "Model": "model", "DecodeState": "state", "ModelConfig": "config",
    "Checkpoint": "checkpoint", "ReferenceBackend": "backend", "HopperBackend": "hopper",
    "FormatError": "format", "World": "distributed",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .backend import ReferenceBackend
    from .checkpoint import Checkpoint
    from .config import ModelConfig
    from .distributed import World
    from .format import FormatError
    from .hopper import HopperBackend
    from .model import Model, load_model
    from .state import DecodeState


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
