"""Shards reduced while the run goes on (gym_ray.finalize.merge_ahead): the final merge takes them instead
of reducing again, writes the same bytes and counts as a merge without them, and reduces again a shard
whose files changed after its reduction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.finalize import merge as merge_module
from gym_ray.finalize.merge import merge_shards
from gym_ray.finalize.merge_ahead import AHEAD_DIR, grow_prefix, reduce_ahead
from gym_ray.record.shard_files import list_shards, shard_paths
from tests.finalize.conftest import ROWS, SHARDS


def _merged(run_dir: Path) -> tuple[bytes, bytes, dict[str, Any]]:
    result = merge_shards(run_dir, workers=1)
    counts = result.model_dump(exclude={"successes_path", "failures_path"})
    return result.successes_path.read_bytes(), result.failures_path.read_bytes(), counts


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


def _reduce_all_and_grow(run_dir: Path, planned: list[str]) -> int:
    for shard in list_shards(run_dir):
        reduce_ahead(run_dir, shard)
    return grow_prefix(run_dir, planned)


def test_the_output_grown_as_a_prefix_becomes_the_merged_files(
    two_copies: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cold, ahead = two_copies
    expected = _merged(cold)
    assert _reduce_all_and_grow(ahead, list_shards(ahead)) == SHARDS
    assert sorted(p.name for p in (ahead / AHEAD_DIR).iterdir()) == [
        "prefix-failures.jsonl",
        "prefix.json",
        "prefix.jsonl",
    ]  # every reduction is in the prefix now
    monkeypatch.setattr(merge_module, "reduce_shard", _refuse_reducing)
    assert _merged(ahead) == expected
    assert not (ahead / AHEAD_DIR).exists()


def test_the_prefix_stops_at_the_first_shard_not_reduced_and_the_merge_does_the_rest(
    two_copies: tuple[Path, Path],
) -> None:
    cold, ahead = two_copies
    shards = list_shards(ahead)
    for shard in (shards[0], shards[1], shards[3]):
        reduce_ahead(ahead, shard)
    assert grow_prefix(ahead, shards) == 2
    assert _merged(ahead) == _merged(cold)


def test_bytes_a_crash_left_after_the_recorded_prefix_are_cut_off(two_copies: tuple[Path, Path]) -> None:
    cold, ahead = two_copies
    shards = list_shards(ahead)
    reduce_ahead(ahead, shards[0])
    assert grow_prefix(ahead, shards) == 1
    with (ahead / AHEAD_DIR / "prefix.jsonl").open("ab") as torn:
        torn.write(b'{"_ng_task_index": 9')  # a crash in the middle of the next append
    assert _reduce_all_and_grow(ahead, shards) == SHARDS
    assert _merged(ahead) == _merged(cold)


@pytest.mark.parametrize("change", ["appended", "out-of-order"])
def test_a_prefix_that_no_longer_holds_is_ignored(two_copies: tuple[Path, Path], change: str) -> None:
    cold, ahead = two_copies
    shards = list_shards(ahead)
    if change == "out-of-order":  # a plan whose shards are not in identity order: the prefix stops
        for shard in shards:
            reduce_ahead(ahead, shard)
        assert grow_prefix(ahead, [shards[1], shards[0], *shards[2:]]) == 1
    else:  # a shard of the prefix written after it went in
        assert _reduce_all_and_grow(ahead, shards) == SHARDS
        line = json.dumps({"_ng_task_index": 10_000, "_ng_rollout_index": 0, "reward": 1.0}) + "\n"
        for run_dir in (cold, ahead):
            with shard_paths(run_dir, shards[0]).successes.open("a") as handle:
                handle.write(line)
    assert _merged(ahead) == _merged(cold)
