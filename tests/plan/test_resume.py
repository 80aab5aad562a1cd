"""Resume planning: done rules, attempt indices, and the refusals with their messages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import ConfigError, ResumeError
from gym_ray.plan.resume import plan_resume
from gym_ray.record.jsonl import encode_line
from gym_ray.record.manifest import build_manifest
from gym_ray.record.shard_files import shard_paths
from gym_ray.record.writer import ShardWriter


def row(task: int, rollout: int, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, "prompt": f"p{task}", **extra}


def fail(task: int, rollout: int, *, terminal: bool = False, **extra: Any) -> dict[str, Any]:
    record = row(task, rollout, _ng_failure_class="agent_run_error", **extra)
    if terminal:
        record[keys.FAILURE_TERMINAL] = True
    return record


def record_shard(
    run_dir: Path,
    rows: list[dict[str, Any]],
    records: Sequence[dict[str, Any]] = (),
    *,
    config_identity: str | None = "cfg-a",
    manifest: bool = True,
) -> None:
    with ShardWriter(
        run_dir, "s0", run_id="run-1", config_identity=config_identity, record_omitted_rollouts=True
    ) as writer:
        writer.write_materialized_inputs(rows)
        if manifest:
            writer.write_manifest(
                build_manifest(run_dir, "s0", run_id="run-1", config_identity=config_identity)
            )
        for record in records:
            writer.append(record)


ROWS = [row(0, 0), row(0, 1), row(1, 0), row(1, 1), row(2, 0), row(2, 1), row(3, 0, _ng_attempt_index=0)]
RECORDS = [
    row(0, 0, reward=1.0),
    fail(0, 1),
    fail(1, 0, terminal=True),
    fail(1, 1),
    fail(1, 1, _ng_attempt_index=1),
    fail(1, 1, _ng_attempt_index=2),
    fail(2, 0),
    fail(2, 0, _ng_attempt_index=1),
    row(2, 0, reward=0.5, _ng_attempt_index=2),
    row(2, 1, _ng_failure_class="cancelled", _ng_dispatch_drained=True, _ng_no_persist=True),
    row(9, 0, reward=1.0),
    {"_ng_failure_class": "agent_run_error", "note": "no identity"},
]


@pytest.mark.parametrize(
    ("cap", "expected_counts", "expected_pending"),
    [
        pytest.param(
            3,
            {
                "num_rows": 7,
                "succeeded": 2,
                "terminal": 1,
                "maxed_out": 1,
                "pending": 3,
                "retrying": 1,
                "prior_failure_attempts": 7,
                "corrupt_lines": 1,
                "ignored_lines": 3,
            },
            [row(0, 1, _ng_attempt_index=1), row(2, 1), row(3, 0)],
            id="cap-3",
        ),
        pytest.param(
            4,
            {
                "num_rows": 7,
                "succeeded": 2,
                "terminal": 1,
                "maxed_out": 0,
                "pending": 4,
                "retrying": 2,
                "prior_failure_attempts": 7,
                "corrupt_lines": 1,
                "ignored_lines": 3,
            },
            [row(0, 1, _ng_attempt_index=1), row(1, 1, _ng_attempt_index=3), row(2, 1), row(3, 0)],
            id="cap-4",
        ),
        pytest.param(
            1,
            {
                "num_rows": 7,
                "succeeded": 2,
                "terminal": 1,
                "maxed_out": 2,
                "pending": 2,
                "retrying": 0,
                "prior_failure_attempts": 7,
                "corrupt_lines": 1,
                "ignored_lines": 3,
            },
            [row(2, 1), row(3, 0)],
            id="cap-1",
        ),
    ],
)
def test_plan_runs_exactly_what_is_not_done(
    tmp_path: Path, cap: int, expected_counts: dict[str, int], expected_pending: list[dict[str, Any]]
) -> None:
    record_shard(tmp_path, ROWS, RECORDS)
    with shard_paths(tmp_path, "s0").successes.open("ab") as handle:
        handle.write(b'{"_ng_task_index":3,"_ng_rollout_in')  # torn tail: not a success for (3, 0)
    plan = plan_resume(tmp_path, "s0", max_rollout_attempts=cap, config_identity="cfg-a")
    assert plan.counts() == expected_counts
    assert list(plan.iter_pending()) == expected_pending
    assert list(plan.pending) == expected_pending
    assert plan.done_count == 7 - expected_counts["pending"]
    assert plan.attempts == {(0, 1): 1, (1, 0): 1, (1, 1): 3, (2, 0): 2}
    assert plan.manifest is not None
    assert plan.manifest.config_identity == "cfg-a"


def test_plan_of_an_untouched_shard_runs_every_row(tmp_path: Path) -> None:
    rows = [row(0, 0), row(1, 0), row(0, 1), row(1, 1)]  # tasks may interleave
    record_shard(tmp_path, rows, manifest=False)
    plan = plan_resume(tmp_path, "s0")
    assert list(plan.iter_pending()) == rows
    assert plan.manifest is None
    assert (plan.pending_count, plan.done_count) == (4, 0)


def test_pending_rows_are_copies(tmp_path: Path) -> None:
    record_shard(tmp_path, [row(0, 0)])
    plan = plan_resume(tmp_path, "s0")
    first = next(plan.iter_pending())
    first["prompt"] = "changed"
    assert next(plan.iter_pending())["prompt"] == "p0"


def test_manifest_without_identity_verifies_inputs_only(tmp_path: Path) -> None:
    record_shard(tmp_path, [row(0, 0)], config_identity=None)
    assert plan_resume(tmp_path, "s0", config_identity="cfg-b").pending_count == 1
    with pytest.raises(ResumeError, match="recorded under a config gym_ray could not identify"):
        plan_resume(tmp_path, "s0", config_identity="cfg-b", require_config_identity=True)


def _tamper_inputs(run_dir: Path) -> None:
    with shard_paths(run_dir, "s0").materialized_inputs.open("ab") as handle:
        handle.write(encode_line(row(0, 1)))


def _drop_inputs(run_dir: Path) -> None:
    shard_paths(run_dir, "s0").materialized_inputs.unlink()


def _drop_everything(run_dir: Path) -> None:
    paths = shard_paths(run_dir, "s0")
    for path in (paths.materialized_inputs, paths.successes, paths.failures):
        path.unlink()


def _write_inputs(data: bytes) -> Callable[[Path], None]:
    def write(run_dir: Path) -> None:
        shard_paths(run_dir, "s0").manifest.unlink()
        shard_paths(run_dir, "s0").materialized_inputs.write_bytes(data)

    return write


def _foreign_manifest(run_dir: Path) -> None:
    paths = shard_paths(run_dir, "s0")
    data = paths.manifest.read_text().replace('"shard": "s0"', '"shard": "s9"')
    paths.manifest.write_text(data)


@pytest.mark.parametrize(
    ("damage", "kwargs", "message"),
    [
        pytest.param(
            _tamper_inputs,
            {},
            r"shard 's0': materialized inputs .*rollouts-s0_materialized_inputs\.jsonl do not match the "
            r"manifest \(sha256 [0-9a-f]{12}\.\.\. recorded, [0-9a-f]{12}\.\.\. now\).*Restore the original",
            id="inputs-changed",
        ),
        pytest.param(
            lambda run_dir: None,
            {"config_identity": "cfg-b"},
            r"recorded under config identity cfg-a\.\.\. but the current config has cfg-b\.\.\.; "
            r"resuming would mix",
            id="config-changed",
        ),
        pytest.param(
            _drop_inputs,
            {},
            r"shard 's0' has recorded outputs but its materialized inputs .* are missing",
            id="inputs-missing-with-outputs",
        ),
        pytest.param(
            _drop_everything,
            {},
            r"no materialized inputs at .* and nothing recorded: it was never started",
            id="never-started",
        ),
        pytest.param(
            _write_inputs(encode_line(row(0, 0)) + encode_line(row(0, 2))),
            {},
            r"_materialized_inputs\.jsonl:2: task 0 has rollout 2 where rollout 1 was expected; collection "
            r"numbers each task's rollouts 0, 1, \.\.\. in input order",
            id="gap-in-numbering",
        ),
        pytest.param(
            _write_inputs(encode_line(row(0, 0)) + encode_line(row(0, 0))),
            {},
            r"_materialized_inputs\.jsonl:2: task 0 has rollout 0 where rollout 1 was expected",
            id="duplicate-row",
        ),
        pytest.param(
            _write_inputs(encode_line(row(0, 0)) + b"{broken\n"),
            {},
            r"_materialized_inputs\.jsonl:2: not a JSON object .*edited or damaged",
            id="corrupt-inputs-line",
        ),
        pytest.param(
            _write_inputs(encode_line({"prompt": "x"})),
            {},
            r"_materialized_inputs\.jsonl:1: row has no integer _ng_task_index/_ng_rollout_index",
            id="row-without-identity",
        ),
        pytest.param(
            _foreign_manifest,
            {},
            r"its manifest names shard 's9'",
            id="manifest-of-another-shard",
        ),
        pytest.param(
            lambda run_dir: shard_paths(run_dir, "s0").manifest.unlink(),
            {"require_config_identity": True},
            r"shard 's0' has no manifest",
            id="no-manifest-required",
        ),
    ],
)
def test_resume_refuses_with_the_reason(
    tmp_path: Path, damage: Callable[[Path], None], kwargs: dict[str, Any], message: str
) -> None:
    record_shard(tmp_path, [row(0, 0), row(0, 1)], [row(0, 0, reward=1.0)])
    damage(tmp_path)
    with pytest.raises(ResumeError, match=message):
        plan_resume(tmp_path, "s0", **{"config_identity": "cfg-a", **kwargs})


def test_plan_refuses_rows_when_inputs_change_after_planning(tmp_path: Path) -> None:
    record_shard(tmp_path, [row(0, 0)])
    plan = plan_resume(tmp_path, "s0")
    _tamper_inputs(tmp_path)
    with pytest.raises(ResumeError, match="changed after the resume plan was made"):
        list(plan.iter_pending())


@pytest.mark.parametrize("cap", [pytest.param(0, id="zero"), pytest.param(True, id="bool")])
def test_attempt_cap_must_be_a_positive_int(tmp_path: Path, cap: int) -> None:
    with pytest.raises(ConfigError, match=f"max_rollout_attempts={cap!r} must be an integer >= 1"):
        plan_resume(tmp_path, "s0", max_rollout_attempts=cap)


def test_a_task_may_continue_its_numbering_in_a_later_shard(tmp_path: Path) -> None:
    # Identical input lines share a task index; a later duplicate line can land in a later shard, whose
    # rows then continue that task's count instead of starting at 0.
    rows = [row(4, 8), row(4, 9), row(5, 0)]
    record_shard(tmp_path, rows, manifest=False)
    plan = plan_resume(tmp_path, "s0")
    assert list(plan.iter_pending()) == rows


def test_the_default_cap_is_three_failure_attempts(tmp_path: Path) -> None:
    rows = [row(0, 0), row(1, 0)]
    records = [fail(0, 0), fail(0, 0, _ng_attempt_index=1), fail(0, 0, _ng_attempt_index=2)]
    record_shard(tmp_path, rows, [*records, fail(1, 0), fail(1, 0, _ng_attempt_index=1)])
    plan = plan_resume(tmp_path, "s0")
    assert (plan.max_rollout_attempts, plan.maxed_out, plan.pending_count) == (3, 1, 1)
    assert list(plan.iter_pending()) == [row(1, 0, _ng_attempt_index=2)]
    with pytest.raises(ConfigError) as caught:
        plan_resume(tmp_path, "s0", max_rollout_attempts=0)
    assert caught.value.key == "max_rollout_attempts"


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        pytest.param(b"", "has no materialized inputs at .* and nothing recorded", id="empty-outputs"),
        pytest.param(b"x", "has recorded outputs but its materialized inputs .* are missing", id="one-byte"),
    ],
)
def test_missing_inputs_are_refused_saying_whether_anything_was_recorded(
    tmp_path: Path, outputs: bytes, message: str
) -> None:
    shard_paths(tmp_path, "s0").failures.write_bytes(outputs)
    with pytest.raises(ResumeError, match=f"^shard 's0' {message}"):
        plan_resume(tmp_path, "s0")
