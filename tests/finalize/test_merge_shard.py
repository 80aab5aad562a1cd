"""The two ways of a merge (finalize/_merge_shard.py, finalize/merge.py), through merge_shards: when shards
may be kept on their own, the attempt index a record without one has, the general way's counts, temp files and
key layout, and the argument and identity errors word for word."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import ConfigError, InputError
from gym_ray.finalize.merge import merge_shards
from gym_ray.record.shard_files import shard_paths
from tests.finalize.test_merge import (
    _reference_counts,
    _reference_merge,
    counts_of,
    fail,
    read,
    rec,
    write_shard,
)


@pytest.mark.parametrize(
    ("shards", "expected"),
    [
        pytest.param(
            # the last identity of a is the first of b: two successes of (1, 0), one is a duplicate
            [[rec(0, 0, src="a"), rec(1, 0, src="a")], [rec(1, 0, src="b"), rec(2, 0, src="b")]],
            (3, 0, 0, 1, 0, 0),
            id="same-identity-at-the-seam",
        ),
        pytest.param(
            # b starts with a failure of a's last identity (5, 0): superseded by a's success
            [[rec(5, 0, src="a")], [fail(5, 0, src="b"), rec(6, 0, src="b")]],
            (2, 0, 0, 0, 1, 0),
            id="a-failure-superseded-across-the-seam",
        ),
        pytest.param(
            # a ends at rollout 1 of task 5, b holds only that identity
            [[rec(4, 0, src="a"), rec(5, 1, src="a")], [rec(5, 1, src="b")]],
            (2, 0, 0, 1, 0, 0),
            id="a-later-rollout-at-the-seam",
        ),
        pytest.param(
            # the same failure attempt at the seam: a's is kept, b's (terminal) is a duplicate
            [
                [fail(0, 0, src="a"), fail(3, 2, 1, src="a")],
                [fail(3, 2, 1, _ng_failure_terminal=True, src="b")],
            ],
            (0, 2, 0, 0, 0, 1),
            id="a-failure-attempt-at-the-seam",
        ),
    ],
)
def test_shards_meeting_at_one_identity_are_merged_not_concatenated(
    tmp_path: Path, shards: list[list[dict[str, Any]]], expected: tuple[int, ...]
) -> None:
    for number, records in enumerate(shards):
        write_shard(tmp_path, f"s{number}", records)
    result = merge_shards(tmp_path)
    expected_successes, expected_failures = _reference_merge(shards)
    assert read(tmp_path / "rollouts.jsonl") == expected_successes
    assert read(tmp_path / "rollouts_failures.jsonl") == expected_failures
    assert counts_of(result) == expected == tuple(_reference_counts(shards).values())


def test_shards_meeting_at_the_seam_keep_the_first_shard_s_line(tmp_path: Path) -> None:
    """Ties between shards keep shard-label order: the kept (1, 0) is a's, byte for byte."""
    write_shard(tmp_path, "a", [rec(0, 0, src="a"), rec(1, 0, src="a")])
    write_shard(tmp_path, "b", [rec(1, 0, src="b"), rec(2, 0, src="b")])
    merge_shards(tmp_path)
    assert (tmp_path / "rollouts.jsonl").read_bytes() == (
        b'{"_ng_task_index":0,"_ng_rollout_index":0,"src":"a"}\n'
        b'{"_ng_task_index":1,"_ng_rollout_index":0,"src":"a"}\n'
        b'{"_ng_task_index":2,"_ng_rollout_index":0,"src":"b"}\n'
    )


@pytest.mark.parametrize("task", [pytest.param(3, id="64-bit-task"), pytest.param(2**70, id="huge-task")])
def test_a_failure_without_attempt_index_is_attempt_0(tmp_path: Path, task: int) -> None:
    """PROTOCOL.md: ``_ng_attempt_index`` is absent or 0 on the first attempt, so the two are one attempt
    (a repeat is a duplicate) and sort before attempt 1; a huge task index is read by the exact parser."""
    explicit_0 = {**fail(task, 0, src="explicit"), keys.ATTEMPT_INDEX: 0}
    shards = [[fail(task, 0, 1, src="a"), fail(task, 0, src="absent")], [explicit_0]]
    for number, records in enumerate(shards):
        write_shard(tmp_path, f"s{number}", records)
    result = merge_shards(tmp_path)
    assert [
        json.loads(line)["src"] for line in (tmp_path / "rollouts_failures.jsonl").read_bytes().splitlines()
    ] == [
        "absent",
        "a",
    ]
    assert counts_of(result) == (0, 2, 0, 0, 0, 1)


def test_the_general_merge_counts_the_skipped_lines_of_every_shard(tmp_path: Path) -> None:
    """Shards that share identities, with corrupt lines and omitted rows in several of them, and a shard
    with nothing to keep: every skipped line is counted once."""
    drained = {keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True}
    write_shard(tmp_path, "a", [rec(0, 0, src="a"), fail(1, 0, src="a"), rec(2, 0, **drained)])
    write_shard(tmp_path, "b", [rec(0, 0, src="b"), rec(1, 0, src="b")])
    write_shard(tmp_path, "c", [rec(3, 0, **drained), rec(4, 0, **drained)])  # nothing to keep
    for shard, corrupt in (("a", b"not json\n[1]\n"), ("b", b"{torn\n"), ("c", b"x\n")):
        with shard_paths(tmp_path, shard).successes.open("ab") as handle:
            handle.write(corrupt)
    result = merge_shards(tmp_path)
    assert (tmp_path / "rollouts.jsonl").read_bytes() == (
        b'{"_ng_task_index":0,"_ng_rollout_index":0,"src":"a"}\n'
        b'{"_ng_task_index":1,"_ng_rollout_index":0,"src":"b"}\n'
    )
    assert (tmp_path / "rollouts_failures.jsonl").read_bytes() == b""
    assert (result.corrupt_lines, result.omitted_rows_skipped) == (4, 3)
    assert counts_of(result) == (2, 0, 0, 1, 1, 0)


@pytest.mark.parametrize("shared", [pytest.param(False, id="disjoint"), pytest.param(True, id="shared")])
def test_temp_files_go_under_the_run_folder_not_the_system_temp_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """The module docstring: temp files go under ``<run_dir>/.merge-*`` (the system temp folder may be
    small, or another file system); here it does not exist at all."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-system-temp"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_shard(run_dir, "a", [rec(0, 0, src="a"), rec(1, 0, src="a")])
    write_shard(run_dir, "b", [rec(1 if shared else 2, 0, src="b")])
    result = merge_shards(run_dir)
    assert counts_of(result) == ((2, 0, 0, 1, 0, 0) if shared else (3, 0, 0, 0, 0, 0))
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("rollouts-")) == [
        "rollouts.jsonl",
        "rollouts_failures.jsonl",
    ]


def test_failure_attempts_that_differ_only_in_high_digits_stay_apart(tmp_path: Path) -> None:
    """The general merge compares attempts by their whole key: 0, 2**60 and 2**61 are three attempts
    (their keys differ only in the first hex digit), and 2**60 repeated is a duplicate."""
    shards = [
        [fail(0, 0, 2**60, src="a"), fail(0, 0, 0, src="a")],
        [fail(0, 0, 2**61, src="b"), fail(0, 0, 2**60, src="b")],
    ]
    for number, records in enumerate(shards):
        write_shard(tmp_path, f"s{number}", records)
    result = merge_shards(tmp_path)
    assert [r["src"] for r in read(tmp_path / "rollouts_failures.jsonl")] == ["a", "a", "b"]
    assert read(tmp_path / "rollouts_failures.jsonl") == _reference_merge(shards)[1]
    assert counts_of(result) == (0, 3, 0, 0, 0, 1)


@pytest.mark.parametrize(
    ("shards", "expected"),
    [
        pytest.param(
            [[rec(2**63, 0, src="a"), rec(1, 0, src="a")], [rec(0, 0, src="b"), rec(2**63, 0, src="b")]],
            [(0, 0, 0), (1, 0, 0), (2**63, 0, 0)],
            id="task",
        ),
        pytest.param(
            [[rec(1, 2**63 + 1, src="a"), rec(1, 0, src="a")], [rec(1, 0, src="b")]],
            [(1, 0, 0), (1, 2**63 + 1, 0)],
            id="rollout",
        ),
        pytest.param(
            [[fail(2, 0, 2**64 - 1, src="a"), fail(2, 0, 1, src="a")], [fail(2, 0, 1, src="b")]],
            [(2, 0, 1), (2, 0, 2**64 - 1)],
            id="attempt",
        ),
    ],
)
def test_an_index_just_past_the_signed_64_bit_range_orders_like_an_integer(
    tmp_path: Path, shards: list[list[dict[str, Any]]], expected: list[tuple[int, int, int]]
) -> None:
    """A task, rollout or attempt in [2**63, 2**64) does not fit the packed 64-bit key: it sorts after
    every smaller index, not before (the merge restarts with a wider layout). Shards share identities."""
    for number, records in enumerate(shards):
        write_shard(tmp_path, f"s{number}", records)
    merge_shards(tmp_path)
    merged = read(tmp_path / "rollouts.jsonl") + read(tmp_path / "rollouts_failures.jsonl")
    identities = [(r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX], r.get(keys.ATTEMPT_INDEX, 0)) for r in merged]
    assert identities == expected
    successes, failures = _reference_merge(shards)
    assert merged == successes + failures
    assert all(r["src"] == "a" for r in merged if r[keys.TASK_INDEX] > 0)


def test_a_record_without_integer_identity_is_named_by_file_and_line_word_for_word(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [rec(0, 0)])
    failures = shard_paths(tmp_path, "a").failures
    failures.write_bytes(b'\n{"_ng_task_index": 1, "_ng_rollout_index": "0", "_ng_failure_class": "x"}\n')
    with pytest.raises(InputError) as info:
        merge_shards(tmp_path)
    assert str(info.value) == (
        f"{failures}:2: record has no integer _ng_task_index/_ng_rollout_index (got 1, '0'), so it cannot be "
        "ordered or deduplicated; fix or remove that line and merge again"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"output_prefix": "rollouts-x"},
            "output_prefix='rollouts-x' must be a file stem of letters, digits, '.', '_' and '-' (no path "
            "separators, no '..') that does not start with 'rollouts-' (shard files do); the default is "
            "'rollouts'",
            id="output-prefix",
        ),
        pytest.param(
            {"pool_min_bytes": 1.5},
            "pool_min_bytes=1.5 must be an integer >= 0 (0 uses the process pool whenever there are >= 2 "
            "workers and shards and any shard data)",
            id="pool-min-bytes",
        ),
    ],
)
def test_bad_merge_arguments_are_named_word_for_word(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    write_shard(tmp_path, "a", [rec(0, 0)])
    with pytest.raises(ConfigError) as info:
        merge_shards(tmp_path, **kwargs)
    assert (str(info.value), info.value.key) == (message, next(iter(kwargs)))
