"""Synthetic checkpoints (``convert/synth.py``) and their conversions, each built once per test session.

Tests get the folders through the ``synth_checkpoints`` fixture of ``tests/conftest.py``. The folders are shared
by every test that asks for the same variant and options, so they are made read-only: a test that changes a
checkpoint (a flipped byte, an edited manifest, a removed shard) works on a :func:`writable_copy`.
"""

from __future__ import annotations

import inspect
import itertools
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, NamedTuple

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.synth import write_synthetic


class Conversion(NamedTuple):
    source: Path
    output: Path


def _explicit(fn: Callable, options: dict[str, Any]) -> tuple:
    """``options`` without those equal to ``fn``'s defaults, as a key: ``target="sm100"`` and no target ask for
    the same checkpoint."""
    params = inspect.signature(fn).parameters
    return tuple(sorted((k, v) for k, v in options.items() if k not in params or params[k].default != v))


def _freeze(root: Path) -> None:
    """Take the write permission from every file and folder below ``root`` (root itself ignores it: for a
    test run as root the copy-before-changing rule is a convention only)."""
    for path in [*root.rglob("*"), root]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def writable_copy(src: Path, dst: Path) -> Path:
    """A private, writable copy of a (shared, read-only) checkpoint folder; returns ``dst``."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for path in [dst, *dst.rglob("*")]:
        if path.is_dir():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return dst


class SynthCheckpoints:
    """Builds on first request and remembers, below ``root``: sources by (variant, preset, seed, synth options),
    conversions by that and the converter's options (``progress`` is always off)."""

    def __init__(self, root: Path):
        self.root = root
        self._sources: dict[tuple, Path] = {}
        self._conversions: dict[tuple, Conversion] = {}
        self._numbers = itertools.count()

    def _folder(self, kind: str, preset: str, variant: str) -> Path:
        return self.root / f"{next(self._numbers):03d}-{kind}-{preset}-{variant}"

    def source(self, variant: str = "flash", *, preset: str = "tiny", seed: int = 0, **synth: Any) -> Path:
        """A synthetic source checkpoint (``write_synthetic(preset, variant, seed, **synth)``), read-only."""
        key = (variant, preset, seed, _explicit(write_synthetic, synth))
        if key not in self._sources:
            path = write_synthetic(self._folder("src", preset, variant), preset=preset, variant=variant, seed=seed,
                                   **synth)
            _freeze(path)
            self._sources[key] = path
        return self._sources[key]

    def converted(self, variant: str = "flash", *, preset: str = "tiny", seed: int = 0,
                  synth: dict[str, Any] | None = None, **convert: Any) -> Conversion:
        """That source and its conversion (``convert_checkpoint(src, out, **convert)``), both read-only."""
        synth = synth or {}
        key = (variant, preset, seed, _explicit(write_synthetic, synth), _explicit(convert_checkpoint, convert))
        if key not in self._conversions:
            src = self.source(variant, preset=preset, seed=seed, **synth)
            out = self._folder("out", preset, variant)
            convert_checkpoint(src, out, progress=False, **convert)
            _freeze(out)
            self._conversions[key] = Conversion(src, out)
        return self._conversions[key]
