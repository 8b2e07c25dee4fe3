"""Helpers of the hostile-input tests: tiny synthetic checkpoints built once per pytest run, edits on disk as a
user or an attacker would make them, and the refusal contract.

The checkpoints come from the project's synth (``tiny`` preset) and are never modified: a test copies
one and edits its copy. :func:`pristine` and :func:`converted` cache by variant for the whole pytest run
(they take pytest's session-wide ``tmp_path_factory``), so every test module shares one build.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import threading
from pathlib import Path
from typing import Callable

import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.safetensors_header import read_header
from nvfp4_megamoe.convert.synth import write_synthetic

INDEX = "model.safetensors.index.json"
MANIFEST = "nvfp4_manifest.json"
_BUILT: dict[tuple, object] = {}


def pristine(factory, variant: str = "flash") -> Path:
    """The tiny synthetic source of ``variant`` (built once per pytest run; never edit it, copy it)."""
    key = ("src", variant)
    if key not in _BUILT:
        _BUILT[key] = write_synthetic(factory.mktemp(f"pristine-{variant}") / "src", preset="tiny", variant=variant)
    return _BUILT[key]


def converted(factory, variant: str = "flash", **options) -> Path:
    """The conversion of :func:`pristine` ``variant`` with ``options`` (built once per pytest run; never edit it)."""
    key = ("out", variant, tuple(sorted(options.items())))
    if key not in _BUILT:
        out = factory.mktemp(f"converted-{variant}") / "out"
        convert_checkpoint(pristine(factory, variant), out, progress=False, **options)
        _BUILT[key] = out
    return _BUILT[key]


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tree_hash(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (what "nothing changed" is checked against)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def index_of(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


def shard_of(root: Path, tensor: str) -> Path:
    return root / index_of(root)["weight_map"][tensor]


def poke(root: Path, tensor: str, data: bytes, at: int = 0) -> Path:
    """Overwrite bytes of one tensor's data in place; returns its shard."""
    shard = shard_of(root, tensor)
    info = read_header(shard).tensors[tensor]
    assert at + len(data) <= info.nbytes, "the poke must stay inside the tensor"
    with open(shard, "r+b") as f:
        f.seek(info.start + at)
        f.write(data)
    return shard


def edit_json(path: Path, edit: Callable[[dict], object] | str) -> None:
    """Load ``path``, let ``edit`` change it in place, write it back; ``edit="wrap"`` puts the whole document
    in a list (valid JSON, not an object)."""
    obj = json.loads(path.read_text())
    if edit == "wrap":
        obj = [obj]
    else:
        edit(obj)
    path.write_text(json.dumps(obj))


def rewrite_shard(root: Path, shard: Path, edit: Callable[[dict[str, torch.Tensor]], None],
                  metadata: dict[str, str] | None = None) -> None:
    """Rewrite ``shard`` with its tensors edited by ``edit`` (add, remove, replace), and the index to match."""
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata=metadata or read_header(shard).metadata or {"format": "pt"})
    index = index_of(root)
    wm = {t: f for t, f in index["weight_map"].items() if f != shard.name}
    wm.update({t: shard.name for t in tensors})
    index["weight_map"] = dict(sorted(wm.items()))
    (root / INDEX).write_text(json.dumps(index))


def header_text(shard: Path) -> str:
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode()


def replace_header(shard: Path, text: str) -> None:
    """Give ``shard`` the header ``text`` (raw JSON, however malformed), keeping its data bytes."""
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        data = f.read()
    raw = text.encode() + b" " * (-len(text.encode()) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def cli(*args: object) -> Result:
    """The ``nvfp4-convert`` command line, in-process."""
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result: Result, *must_name: str) -> str:
    """Check the refusal contract on a CLI run: non-zero exit, one ``error:`` paragraph, no traceback, every
    ``must_name`` in the message; returns the message."""
    output = result.output
    assert result.exit_code not in (0, None), output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output, output
    assert output.startswith("error: ") or "\nerror: " in output, output
    msg = output[output.index("error: "):]
    for name in must_name:
        assert name in msg, (name, msg)
    return msg


def within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()``, failing the test if it has not returned after ``seconds`` (a read blocked on a FIFO never
    returns; the thread is left behind as a daemon)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: it blocks"
    if "error" in box:
        raise box["error"]
    return box.get("value")
