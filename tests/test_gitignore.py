"""Issue 30, item 7: what `gym-ray serve` and the notebooks write is not offered to git."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout"
)
@pytest.mark.parametrize(
    "path",
    [
        pytest.param("gym-ray-run.yaml", id="serve-run-config"),
        pytest.param("notebooks/gym-ray-run.yaml", id="serve-run-config-elsewhere"),
        pytest.param("notebooks/notebook_outputs/quickstart_rewards.png", id="notebook-outputs"),
        pytest.param(".ci/venv/bin/python", id="ci-venv"),
    ],
)
def test_generated_files_are_ignored(path: str) -> None:
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", path], cwd=REPO, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (0, f"{path}\n")
