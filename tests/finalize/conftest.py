"""Fixtures of the merge and aggregation tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gym_ray.bench.merge_bench import write_shards

#: Rows and shards of :func:`two_copies` (shards of 100 rows, 25 tasks of 4 rollouts each).
ROWS, SHARDS = 400, 4


@pytest.fixture
def two_copies(tmp_path: Path) -> tuple[Path, Path]:
    """The same run folder twice, as a run leaves it (``cold`` and ``ahead``): the copy's files are other
    files, so work done ahead on one is never taken for the other's."""
    cold = tmp_path / "cold"
    cold.mkdir()
    write_shards(cold, ROWS, SHARDS)
    ahead = tmp_path / "ahead"
    shutil.copytree(cold, ahead)
    return cold, ahead
