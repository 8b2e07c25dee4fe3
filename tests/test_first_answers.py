"""The command line's answers that need no tensor math come before torch is imported.

Importing torch takes seconds on a small machine; ``--help``, ``inspect`` (headers and JSON), a missing source or
output folder and the refusal of a folder holding another conversion must not wait for it. One fresh interpreter
runs every command in turn (click's runner, in-process) and reports what each printed and whether ``torch`` was
imported by then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hostile_inputs import converted, pristine

_RUN = """
import json, sys
from click.testing import CliRunner
from nvfp4_megamoe.convert.cli import main
answers = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    answers.append({"args": args, "exit_code": result.exit_code, "output": result.output,
                    "torch": "torch" in sys.modules})
print(json.dumps(answers))
"""


def answers(*commands: list[object], cwd: Path | None = None) -> list[dict]:
    """Run the CLI ``commands`` one after the other in one fresh interpreter; what each answered."""
    args = json.dumps([[str(a) for a in c] for c in commands])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _RUN, args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_answers_that_need_no_tensor_math_come_before_torch(tmp_path_factory, tmp_path):
    src, out = pristine(tmp_path_factory, "flash"), converted(tmp_path_factory, "flash")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("not a conversion")
    runs = answers(["--help"], ["inspect", out], ["inspect", src], ["inspect", out, "--json"],
                   ["convert", "/no/such/folder", tmp_path / "o1"],
                   ["convert", src, out], ["convert", src, out, "--dense", "keep"],
                   ["convert", src, tmp_path / "taken"], ["convert", src, src / "inside"],
                   ["verify", "/no/such/folder"], cwd=tmp_path)
    by = {" ".join(r["args"]).replace(str(tmp_path), "TMP"): r for r in runs}
    for cmd, r in by.items():
        assert not r["torch"], f"`nvfp4-convert {cmd}` imported torch before it answered"
    assert "inspect" in by["--help"]["output"] and by["--help"]["exit_code"] == 0
    inspected = [r for r in runs if r["args"][0] == "inspect"]
    assert all(r["exit_code"] == 0 for r in inspected), inspected
    assert "converted" in inspected[0]["output"] and "official DeepSeek-V4" in inspected[1]["output"]
    assert json.loads(inspected[2]["output"])["tensors"] > 0
    refusals = [r for r in runs if r["args"][0] in ("convert", "verify")]
    for r in refusals:
        assert r["exit_code"] == 1 and r["output"].startswith("error: "), r
    assert not (tmp_path / "o1").exists()
    assert "/no/such/folder: no such folder" in refusals[0]["output"]
    assert "the same source and options" in refusals[1]["output"]
    assert "--dense nvfp4 there, keep here" in refusals[2]["output"], refusals[2]
    assert "not empty" in refusals[3]["output"] and "inside the source folder" in refusals[4]["output"]
    assert "/no/such/folder: no such folder" in refusals[5]["output"]
