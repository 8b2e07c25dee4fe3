"""Helper of the tests: ``nvfp4-convert`` commands run one after the other in one fresh interpreter, each answer
with whether ``torch`` had been imported by then (the answers that need no tensor math must come before it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def answers(*commands: list[object], cwd: Path | None = None, env: dict[str, str] | None = None) -> list[dict]:
    """Run the CLI ``commands`` (argument lists) in turn in one fresh interpreter (click's runner, in-process);
    per command: ``args``, ``exit_code``, ``output`` and ``torch`` (imported by the time it answered)."""
    args = json.dumps([[str(a) for a in c] for c in commands])
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _RUN, args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
