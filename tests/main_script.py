"""Run a script as ``__main__`` of a fresh interpreter and see which processes ran its top level.

For the checks that gym_ray's spawned helper processes do not import the caller's main script again
(``gym_ray._spawn``): the script's unguarded top level appends the pid of every process that runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: The unguarded top level put before every script: note who runs it.
PROLOGUE = """import os
with open(os.environ["GYM_RAY_TEST_MARKER"], "a") as _marker:
    _marker.write(f"{os.getpid()}\\n")
"""


def run_as_main_script(folder: Path, guarded: str, *args: str) -> tuple[dict[str, Any], list[int]]:
    """Run ``PROLOGUE`` + ``guarded`` (code under ``if __name__ == "__main__":`` that prints one JSON
    object) as a script in ``folder``; its JSON, and the pids that ran the script's top level."""
    script = folder / "main_script.py"
    script.write_text(PROLOGUE + guarded)
    marker = folder / "ran.txt"
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "GYM_RAY_TEST_MARKER": str(marker)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), [int(pid) for pid in marker.read_text().split()]
