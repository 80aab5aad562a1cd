"""The ledger check: exact figures on crafted run folders, before and after merging and repair."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import ConfigError, InputError
from gym_ray.finalize.merge import merge_shards
from gym_ray.record.ledger import check_run
from gym_ray.record.shard_files import shard_paths
from gym_ray.record.writer import ShardWriter


def rec(task: int, rollout: int, attempt: int = 0, **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, **extra}
    if attempt:
        record[keys.ATTEMPT_INDEX] = attempt
    return record


def fail(task: int, rollout: int, attempt: int = 0, **extra: Any) -> dict[str, Any]:
    return rec(task, rollout, attempt, _ng_failure_class="agent_run_error", **extra)


def write_shard(
    run_dir: Path, shard: str, inputs: list[tuple[int, int]], records: list[dict[str, Any]]
) -> None:
    with ShardWriter(run_dir, shard, run_id="run-1", config_identity=None, record_omitted_rollouts=True) as w:
        w.write_materialized_inputs([rec(task, rollout) for task, rollout in inputs])
        for record in records:
            w.append(record)


def crafted_run(run_dir: Path) -> None:
    write_shard(
        run_dir,
        "a",
        [(0, 0), (0, 1), (1, 0), (1, 1)],
        [
            rec(0, 0),
            fail(0, 1, _ng_failure_terminal=True),
            fail(1, 0),
            fail(1, 0, 1),
            fail(1, 0, 2),
            rec(1, 1, _ng_failure_class="cancelled", _ng_dispatch_drained=True, _ng_no_persist=True),
        ],
    )
    write_shard(
        run_dir,
        "b",
        [(2, 0), (3, 0), (3, 1)],
        [rec(2, 0), rec(2, 0, 1), rec(9, 9), fail(3, 0)],
    )
    with shard_paths(run_dir, "b").successes.open("ab") as handle:
        handle.write(b'{"_ng_task_index":3,"_ng_rol')


ACKNOWLEDGED = [(0, 0), (2, 0), (3, 1)]
REQUESTS = {(0, 0): 1, (0, 1): 2, (1, 0): 3, (2, 0): 3, (3, 1): 1, (1, 1): 1}


def test_figures_over_shard_files(tmp_path: Path) -> None:
    crafted_run(tmp_path)
    report = check_run(tmp_path, acknowledged=ACKNOWLEDGED, request_counts=REQUESTS)
    assert report.as_dict() == {
        "lost": 1,
        "missing": 3,
        "duplicates": 1,
        "unexpected": 1,
        "corrupt_lines": 1,
        "unidentified_lines": 0,
        "wasted_requests": 4,
        "unplanned": 0,
        "planned": 7,
        "recorded": 6,
        "settled": 5,
        "source": "shards",
        "ok": False,
    }
    assert report.lost_ids == ((3, 1),)
    assert report.missing_ids == ((1, 1), (3, 0), (3, 1))
    assert report.duplicate_ids == ((2, 0),)
    assert report.unexpected_ids == ((9, 9),)
    assert report.corrupt_by_file == {"rollouts-b.jsonl": 1}


def test_figures_over_merged_output_then_after_repair(tmp_path: Path) -> None:
    crafted_run(tmp_path)
    merge_shards(tmp_path)
    report = check_run(tmp_path, acknowledged=ACKNOWLEDGED)
    assert report.as_dict() == {
        "lost": 1,
        "missing": 3,
        "duplicates": 0,
        "unexpected": 1,
        "corrupt_lines": 1,
        "unidentified_lines": 0,
        "wasted_requests": None,
        "unplanned": 0,
        "planned": 7,
        "recorded": 6,
        "settled": 5,
        "source": "merged",
        "ok": False,
    }
    ShardWriter(tmp_path, "b", run_id="run-1", config_identity=None).open().close()  # repairs the tail
    assert check_run(tmp_path).corrupt_lines == 0


def test_complete_run_is_ok(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [(0, 0), (0, 1)], [rec(0, 1), fail(0, 0), rec(0, 0, 1)])
    write_shard(tmp_path, "b", [(1, 0)], [fail(1, 0, _ng_failure_terminal=True)])
    report = check_run(
        tmp_path, acknowledged=[(0, 0), (0, 1), (1, 0)], request_counts={(0, 0): 2, (0, 1): 1, (1, 0): 1}
    )
    assert report.ok
    assert report.as_dict()["wasted_requests"] == 0
    assert (report.planned, report.recorded, report.settled) == (3, 3, 3)
    merge_shards(tmp_path)
    assert check_run(tmp_path).ok


@pytest.mark.parametrize(
    ("max_attempts", "missing_ids"),
    [
        pytest.param(3, (), id="cap-3-settles"),
        pytest.param(4, ((0, 0),), id="cap-4-still-missing"),
    ],
)
def test_attempt_cap_settles_by_failures(
    tmp_path: Path, max_attempts: int, missing_ids: tuple[tuple[int, int], ...]
) -> None:
    write_shard(tmp_path, "a", [(0, 0)], [fail(0, 0), fail(0, 0, 1), fail(0, 0, 2)])
    assert check_run(tmp_path, max_rollout_attempts=max_attempts).missing_ids == missing_ids


def test_explicit_plan_and_unidentified_lines(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [(0, 0), (0, 1)], [rec(0, 0), rec(0, 1), {"reward": 1.0}])
    report = check_run(tmp_path, planned=[(0, 0), (5, 0)])
    assert (report.missing_ids, report.unexpected_ids, report.unidentified_lines) == (((5, 0),), ((0, 1),), 1)
    assert not report.ok


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist or is not a folder") as missing:
        check_run(tmp_path / "nope")
    assert missing.value.path == str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="max_rollout_attempts=0") as zero:
        check_run(tmp_path, max_rollout_attempts=0)
    assert zero.value.key == "max_rollout_attempts"
    assert check_run(tmp_path, max_rollout_attempts=1).run_dir == str(tmp_path)  # 1 is the smallest cap


def test_unidentified_and_omitted_lines_are_passed_over_and_the_lines_after_them_read(tmp_path: Path) -> None:
    drained = rec(3, 0, _ng_failure_class="cancelled", _ng_dispatch_drained=True, _ng_no_persist=True)
    write_shard(
        tmp_path,
        "a",
        [(0, 0), (1, 0), (2, 0), (3, 0)],
        [
            rec(0, 0),
            {"reward": 1.0},  # no identity
            rec(1, 0),
            {"_ng_task_index": "1", "_ng_rollout_index": 0},  # not an integer identity
            rec(2, 0),
            drained,  # omitted: in the failures file, never a record
            fail(3, 0, _ng_failure_terminal=True),
        ],
    )
    report = check_run(tmp_path)
    assert (report.recorded, report.settled, report.missing, report.unidentified_lines) == (4, 4, 0, 2)


def test_wasted_requests_count_a_non_integer_attempt_as_attempt_0(tmp_path: Path) -> None:
    # (0,0): a success at attempt 0 and a failure whose attempt index is not an int (read as 0): one
    # distinct recorded attempt, so 3 requests waste 2. (1,0): failures at attempts 0 and 1: 2 requests, 0.
    write_shard(
        tmp_path,
        "a",
        [(0, 0), (1, 0)],
        [rec(0, 0), fail(0, 0, _ng_attempt_index="1"), fail(1, 0), fail(1, 0, 1)],
    )
    report = check_run(tmp_path, request_counts={(0, 0): 3, (1, 0): 2})
    assert report.wasted_requests == 2


def test_an_omitted_line_in_the_merged_failures_is_not_a_record(tmp_path: Path) -> None:
    write_shard(tmp_path, "a", [(0, 0), (1, 0)], [rec(0, 0)])
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(rec(0, 0)) + "\n", encoding="utf-8")
    drained = rec(1, 0, _ng_failure_class="cancelled", _ng_dispatch_drained=True, _ng_no_persist=True)
    (tmp_path / "rollouts_failures.jsonl").write_text(json.dumps(drained) + "\n", encoding="utf-8")
    report = check_run(tmp_path)
    assert (report.source, report.recorded, report.missing_ids) == ("merged", 1, ((1, 0),))


def test_a_stream_record_dir_is_judged_by_what_it_recorded(tmp_path: Path) -> None:
    """A stream's shards have no materialized inputs: its records are the plan, not 'unexpected'."""
    for shard, records in (("w0-1", [rec(0, 0), rec(0, 1), rec(2, 0)]), ("w1-1", [rec(1, 0), rec(1, 0)])):
        with ShardWriter(tmp_path, shard, run_id="stream", config_identity=None) as writer:
            for record in records:
                writer.append(record)
    report = check_run(tmp_path)
    assert (report.planned, report.recorded, report.unexpected, report.missing, report.duplicates) == (
        4,
        4,
        0,
        0,
        1,
    )
    assert report.duplicate_ids == ((1, 0),)
    assert report.ok is False  # the duplicate still counts


def test_the_report_reads_as_one_line_and_names_wasted_requests_only_when_measured(tmp_path: Path) -> None:
    """Issue 30: the demo printed the ledger as a raw dict, with "wasted_requests None"."""
    crafted_run(tmp_path)
    measured = check_run(tmp_path, acknowledged=ACKNOWLEDGED, request_counts=REQUESTS)
    assert measured.describe() == (
        "NOT ok: lost 1, missing 3, duplicates 1, unexpected 1, corrupt lines 1, unidentified lines 0, "
        "unplanned 0; planned 7, recorded 6, settled 5, wasted requests 4"
    )
    unmeasured = check_run(tmp_path, acknowledged=ACKNOWLEDGED)
    assert str(unmeasured) == (
        f"ledger of {tmp_path} (shards): NOT ok: lost 1, missing 3, duplicates 1, unexpected 1, "
        "corrupt lines 1, unidentified lines 0, unplanned 0; planned 7, recorded 6, settled 5"
    )
