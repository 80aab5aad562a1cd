"""Shards reduced while the run goes on (gym_ray.finalize.merge_ahead): the final merge takes them instead
of reducing again, writes the same bytes and counts as a merge without them, and reduces again a shard
whose files changed after its reduction."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gym_ray.bench.merge_bench import write_shards
from gym_ray.finalize import merge as merge_module
from gym_ray.finalize.merge import merge_shards
from gym_ray.finalize.merge_ahead import AHEAD_DIR, reduce_ahead
from gym_ray.record.shard_files import list_shards, shard_paths

ROWS, SHARDS = 400, 4


def _merged(run_dir: Path) -> tuple[bytes, bytes, dict[str, Any]]:
    result = merge_shards(run_dir, workers=1)
    counts = result.model_dump(exclude={"successes_path", "failures_path"})
    return result.successes_path.read_bytes(), result.failures_path.read_bytes(), counts


@pytest.fixture
def two_copies(tmp_path: Path) -> tuple[Path, Path]:
    cold = tmp_path / "cold"
    cold.mkdir()
    write_shards(cold, ROWS, SHARDS)
    ahead = tmp_path / "ahead"
    shutil.copytree(cold, ahead)  # the copy's files are other files: reductions are made on each
    return cold, ahead


def _refuse_reducing(*args: Any) -> Any:
    raise AssertionError(f"reduce_shard called for {args[1]}: its reduction made ahead was not used")


def test_the_merge_uses_every_reduction_and_writes_the_same_bytes(
    two_copies: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cold, ahead = two_copies
    expected = _merged(cold)
    assert [reduce_ahead(ahead, shard) for shard in list_shards(ahead)] == [True] * SHARDS
    monkeypatch.setattr(merge_module, "reduce_shard", _refuse_reducing)
    assert _merged(ahead) == expected
    assert expected[2]["successes"] == ROWS
    assert not (ahead / AHEAD_DIR).exists()  # removed once the merge used them


def test_a_shard_written_after_its_reduction_is_reduced_again(two_copies: tuple[Path, Path]) -> None:
    cold, ahead = two_copies
    for shard in list_shards(ahead):
        reduce_ahead(ahead, shard)
    # a line added to the last shard after its reduction (a resumed shard's new record), in both copies
    last = list_shards(cold)[-1]
    line = json.dumps({"_ng_task_index": 10_000, "_ng_rollout_index": 0, "reward": 1.0}) + "\n"
    for run_dir in (cold, ahead):
        with shard_paths(run_dir, last).successes.open("a") as handle:
            handle.write(line)
    expected = _merged(cold)
    assert expected[0].endswith(line.encode())
    assert _merged(ahead) == expected


def test_a_damaged_reduction_is_ignored(two_copies: tuple[Path, Path]) -> None:
    cold, ahead = two_copies
    first = list_shards(ahead)[0]
    reduce_ahead(ahead, first)
    (ahead / AHEAD_DIR / first / "reduction.json").write_text("{not json")
    assert _merged(ahead) == _merged(cold)
