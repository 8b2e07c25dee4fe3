"""The tensors of a loaded model's weights (``runtime/weights.py`` dataclasses), by their path in the tree."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch


def weight_tensors(obj, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from a weights dataclass (through fields and the layers' dict), with its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from weight_tensors(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from weight_tensors(value, f"{path}[{key}]")


def tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable from a weights dataclass."""
    return sum(t.nbytes for _, t in weight_tensors(obj))
