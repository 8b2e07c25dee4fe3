"""The command line's answers that need no tensor math come before torch is imported.

Importing torch takes seconds on a small machine; ``--help``, ``inspect`` (headers and JSON), a missing source or
output folder and the refusal of a folder holding another conversion must not wait for it. One fresh interpreter
runs every command in turn (``cli_process.answers``) and reports what each printed and whether ``torch`` was
imported by then.
"""

from __future__ import annotations

import json

from cli_process import answers
from hostile_inputs import converted, pristine


def test_answers_that_need_no_tensor_math_come_before_torch(tmp_path_factory, tmp_path):
    src, out = pristine(tmp_path_factory, "flash"), converted(tmp_path_factory, "flash")
    (tmp_path / "w").mkdir()  # a relative w/missing whose first part exists: a missing folder, never a Hub id
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("not a conversion")
    runs = answers(["--help"], ["inspect", out], ["inspect", src], ["inspect", out, "--json"],
                   ["convert", "/no/such/folder", tmp_path / "o1"], ["convert", "w/missing", tmp_path / "o2"],
                   ["convert", src, out], ["convert", src, out, "--dense", "nvfp4"],
                   ["convert", src, tmp_path / "taken"], ["convert", src, src / "inside"],
                   ["verify", "/no/such/folder"], cwd=tmp_path)
    by = {" ".join(r["args"]).replace(str(tmp_path), "TMP"): r for r in runs}
    for cmd, r in by.items():
        assert not r["torch"], f"`nvfp4-convert {cmd}` imported torch before it answered"
    assert "inspect" in by["--help"]["output"] and by["--help"]["exit_code"] == 0
    inspected = [r for r in runs if r["args"][0] == "inspect"]
    assert all(r["exit_code"] == 0 for r in inspected), inspected
    assert "format 1, canonical layout" in inspected[0]["output"] and "official DeepSeek-V4" in inspected[1]["output"]
    assert json.loads(inspected[2]["output"])["tensors"] > 0
    refusals = [r for r in runs if r["args"][0] in ("convert", "verify")]
    for r in refusals:
        assert r["exit_code"] == 1 and r["output"].startswith("error: "), r
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert "/no/such/folder: no such folder" in refusals[0]["output"]
    assert "w/missing: no such folder" in refusals[1]["output"] and "Hub" in refusals[1]["output"], refusals[1]
    assert "the same source and options" in refusals[2]["output"]
    assert "--dense keep there, nvfp4 here" in refusals[3]["output"], refusals[3]
    assert "not empty" in refusals[4]["output"] and "inside the source folder" in refusals[5]["output"]
    assert "/no/such/folder: no such folder" in refusals[6]["output"]
