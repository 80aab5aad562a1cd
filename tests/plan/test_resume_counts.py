"""Resume planning's counts of lines that count for nothing, and ``verify_recorded_inputs`` over several
shards. Expected figures are counted by hand from the lines written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_ray.errors import ResumeError
from gym_ray.plan.resume import plan_resume, verify_recorded_inputs
from gym_ray.record.jsonl import encode_line
from gym_ray.record.manifest import build_manifest
from gym_ray.record.shard_files import shard_paths
from gym_ray.record.writer import ShardWriter
from tests.plan.test_resume import fail, row


def _record(run_dir: Path, shard: str, rows: list[dict[str, Any]], *, manifest: bool = True) -> None:
    with ShardWriter(
        run_dir, shard, run_id="run-1", config_identity="cfg", record_omitted_rollouts=True
    ) as w:
        w.write_materialized_inputs(rows)
        if manifest:
            w.write_manifest(build_manifest(run_dir, shard, run_id="run-1", config_identity="cfg"))


def _append(path: Path, *lines: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(b"".join(lines))


def test_corrupt_and_unplanned_lines_of_both_files_are_each_counted(tmp_path: Path) -> None:
    _record(tmp_path, "s0", [row(0, 0), row(0, 1), row(1, 0)])
    paths = shard_paths(tmp_path, "s0")
    _append(
        paths.successes,
        encode_line(row(0, 0, reward=1.0)),
        b"{broken\n",
        encode_line(row(7, 0, reward=1.0)),  # not in the inputs
        encode_line(row(8, 0, reward=1.0)),  # not in the inputs
        b"[1, 2]\n",
    )
    _append(
        paths.failures,
        encode_line(fail(0, 1)),
        encode_line(fail(9, 0)),  # not in the inputs: no attempt
        encode_line(fail(9, 1, terminal=True)),  # not in the inputs: no attempt, nothing done
        b"{also broken\n",
    )
    plan = plan_resume(tmp_path, "s0")
    assert plan.counts() == {
        "num_rows": 3,
        "succeeded": 1,
        "terminal": 0,
        "maxed_out": 0,
        "pending": 2,
        "retrying": 1,
        "prior_failure_attempts": 1,
        "corrupt_lines": 3,
        "ignored_lines": 4,
    }
    assert plan.attempts == {(0, 1): 1}
    assert plan.done == frozenset({(0, 0)})
    assert list(plan.iter_pending()) == [row(0, 1, _ng_attempt_index=1), row(1, 0)]


def test_verify_recorded_inputs_checks_every_shard_with_a_manifest_and_inputs(tmp_path: Path) -> None:
    _record(tmp_path, "s0", [row(0, 0)], manifest=False)  # no manifest: left to plan_resume
    _record(tmp_path, "s1", [row(1, 0)])
    _record(tmp_path, "s2", [row(2, 0)])
    _record(tmp_path, "s3", [row(3, 0)])
    shard_paths(tmp_path, "s3").materialized_inputs.unlink()  # no inputs: left to plan_resume
    assert verify_recorded_inputs(tmp_path) == 2
    _append(shard_paths(tmp_path, "s2").materialized_inputs, encode_line(row(2, 1)))
    with pytest.raises(ResumeError, match=r"^shard 's2': materialized inputs "):
        verify_recorded_inputs(tmp_path)
