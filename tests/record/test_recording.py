"""``ShardRecorder`` driven step by step, as the helper drives it (real files, no servers).

The helper-level tests (``tests/dispatch/test_helper_record.py``) run the recorder through real servers;
these pin the parts a helper run cannot reach or cannot tell apart: the ids it stamps, when a shard is
finished (the last row task or the closing, whichever is later), the attempt cap, what a shard holding
records is resumed from, and which refusals leave the shard's files untouched.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.outcomes import CompletedRollout
from gym_ray.errors import InputError, ResumeError, UsageError
from gym_ray.record.manifest import ShardManifest, ShardProgress
from gym_ray.record.recording import ShardRecorder
from gym_ray.record.writer import ShardWriter

SHARD = "s0"


def _row(task: int, rollout: int = 0, **extra: Any) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, "prompt": f"p{task}", **extra}


def _success(row: dict[str, Any]) -> dict[str, Any]:
    return {keys.TASK_INDEX: row[keys.TASK_INDEX], keys.ROLLOUT_INDEX: row[keys.ROLLOUT_INDEX], "reward": 1.0}


def _failure(row: dict[str, Any]) -> dict[str, Any]:
    return {
        keys.TASK_INDEX: row[keys.TASK_INDEX],
        keys.ROLLOUT_INDEX: row[keys.ROLLOUT_INDEX],
        keys.ATTEMPT_INDEX: row.get(keys.ATTEMPT_INDEX, 0),
        keys.FAILURE_CLASS: "agent_run_error",
    }


def _record(
    folder: Path,
    rows: list[dict[str, Any]],
    outcome: Callable[[dict[str, Any]], dict[str, Any]] = _success,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """One helper call's recording, row tasks one after the other; returns the rows that ran."""
    recorder = ShardRecorder(folder, SHARD, **kwargs)
    pending = list(recorder.rows_to_run(recorder.stamp(rows)))
    if pending:
        recorder.start(pending, config_identity="cfg-a")
    for row in pending:
        recorder.enter()
        recorder.record(row, outcome(row))
        recorder.leave()
    recorder.closing()
    return pending


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _progress(folder: Path) -> ShardProgress:
    return ShardProgress.model_validate_json((folder / f"rollouts-{SHARD}.progress.json").read_bytes())


def _manifest(folder: Path) -> ShardManifest:
    return ShardManifest.model_validate_json((folder / f"rollouts-{SHARD}.manifest.json").read_bytes())


# --- stamping ----------------------------------------------------------------------------------------


def test_stamp_prefixes_each_rollout_id_with_the_run_id_and_keeps_the_attempt(tmp_path: Path) -> None:
    rows = [
        _row(0),
        _row(0, 1, _ng_attempt_index=2),
        _row(1, 0, _ng_attempt_index="2"),  # not an integer: attempt 0
        _row(1, 1, _ng_attempt_index=None),
        _row(2, 0, _ng_attempt_index=3, _ng_rollout_id="mine"),
    ]
    originals = json.loads(json.dumps(rows))
    copies = ShardRecorder(tmp_path, SHARD, run_id="r").stamp(rows)
    assert [c[keys.ROLLOUT_ID] for c in copies] == ["r-0-0", "r-0-1-a2", "r-1-0", "r-1-1", "r-mine"]
    assert {c[keys.RUN_ID] for c in copies} == {"r"}
    assert rows == originals


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param(5, "row 1 is a int, not an object; rows must be dicts", id="not-a-dict"),
        pytest.param(
            {keys.TASK_INDEX: 0},
            "row 1 has _ng_task_index=0 and _ng_rollout_index=None; recording shard 's0' needs integer "
            "rollout identities: call preprocess_examples first",
            id="no-identity",
        ),
    ],
)
def test_stamp_names_the_row_it_refuses(tmp_path: Path, bad: Any, message: str) -> None:
    with pytest.raises(InputError) as info:
        ShardRecorder(tmp_path, SHARD, run_id="r").stamp([_row(0), bad])
    assert (str(info.value), info.value.row) == (message, 1)


def test_no_rows_for_a_fresh_shard_touch_nothing(tmp_path: Path) -> None:
    assert _record(tmp_path / "run", []) == []
    assert not (tmp_path / "run").exists() or _files(tmp_path / "run") == {}


# --- finishing the shard -----------------------------------------------------------------------------


def test_the_last_row_task_to_end_finishes_the_shard(tmp_path: Path) -> None:
    recorder = ShardRecorder(tmp_path, SHARD, run_id="r")
    pending = list(recorder.rows_to_run(recorder.stamp([_row(0), _row(1), _row(2)])))
    recorder.start(pending, config_identity=None)
    progress = tmp_path / f"rollouts-{SHARD}.progress.json"
    for number, row in enumerate(pending):
        assert not progress.exists(), f"finished after {number} of 3 rows"
        recorder.enter()
        recorder.record(row, _success(row))
        recorder.leave()
    assert (_progress(tmp_path).planned, _progress(tmp_path).succeeded) == (3, 3)
    with pytest.raises(UsageError, match="is closed"):  # the writer is closed: nothing more is appended
        recorder.record(pending[0], _success(pending[0]))


def test_closing_while_rows_run_finishes_when_the_last_one_ends(tmp_path: Path) -> None:
    recorder = ShardRecorder(tmp_path, SHARD, run_id="r")
    rows = list(recorder.rows_to_run(recorder.stamp([_row(0), _row(1), _row(2)])))
    recorder.start(rows, config_identity=None)
    progress = tmp_path / f"rollouts-{SHARD}.progress.json"
    recorder.enter()
    recorder.enter()
    recorder.closing()  # the consumer closed early: two row tasks still run, the third never started
    recorder.record(rows[0], _success(rows[0]))
    recorder.leave()
    assert not progress.exists()
    recorder.record(rows[1], _success(rows[1]))
    recorder.leave()
    assert (_progress(tmp_path).planned, _progress(tmp_path).succeeded) == (3, 2)
    assert [(r[keys.TASK_INDEX], r["reward"]) for r in _lines(tmp_path / f"rollouts-{SHARD}.jsonl")] == [
        (0, 1.0),
        (1, 1.0),
    ]


def test_a_shard_whose_rows_were_never_started_gets_no_progress(tmp_path: Path) -> None:
    recorder = ShardRecorder(tmp_path, SHARD, run_id="r")
    list(recorder.rows_to_run(recorder.stamp([_row(0)])))  # pulled, then validation failed: no start()
    recorder.closing()
    assert not (tmp_path / f"rollouts-{SHARD}.progress.json").exists()
    assert not (tmp_path / f"rollouts-{SHARD}_materialized_inputs.jsonl").exists()


def test_start_runs_once(tmp_path: Path) -> None:
    recorder = ShardRecorder(tmp_path, SHARD, run_id="r")
    rows = list(recorder.rows_to_run(recorder.stamp([_row(0)])))
    recorder.start(rows, config_identity=None)
    with pytest.raises(UsageError) as info:
        recorder.start(rows, config_identity=None)
    assert str(info.value) == "shard 's0': rows are recorded once per call; start() ran already"
    recorder.closing()


# --- what is written ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "expected"), [(False, []), (True, [(0, True)])], ids=["default", "kept"])
def test_drained_rows_go_to_the_sidecar_only_when_asked(
    tmp_path: Path, keep: bool, expected: list[tuple[int, bool]]
) -> None:
    kwargs = {"record_omitted_rollouts": True} if keep else {}

    def drained(row: dict[str, Any]) -> dict[str, Any]:
        return {**_success(row), keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True}

    _record(tmp_path, [_row(0)], drained, run_id="r", **kwargs)
    failures = _lines(tmp_path / f"rollouts-{SHARD}_failures.jsonl")
    assert [(r[keys.TASK_INDEX], r[keys.NO_PERSIST]) for r in failures] == expected
    assert (_progress(tmp_path).omitted, _progress(tmp_path).attempts) == (1, 0)


async def test_a_completed_rollout_is_recorded_with_its_row_identity(tmp_path: Path) -> None:
    recorder = ShardRecorder(tmp_path, SHARD, run_id="r")
    (row,) = list(recorder.rows_to_run(recorder.stamp([_row(4, 2)])))
    recorder.start([row], config_identity=None)

    async def run(row: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        return row, CompletedRollout(row, {"reward": 0.5}, 3.0, "calc_env", "example_env")

    assert await recorder.wrap(run)(row) == (
        row,
        CompletedRollout(row, {"reward": 0.5}, 3.0, "calc_env", "example_env"),
    )
    recorder.closing()
    assert _lines(tmp_path / f"rollouts-{SHARD}.jsonl") == [
        {
            "reward": 0.5,
            keys.TASK_INDEX: 4,
            keys.ROLLOUT_INDEX: 2,
            keys.ROLLOUT_ID: "r-4-2",
            keys.RUN_ID: "r",
            keys.ENVIRONMENT_SERVER: "calc_env",
            keys.RESULT_TYPE: "example_env",
        }
    ]


async def test_the_failure_hook_keeps_the_line_then_calls_the_callers_hook(tmp_path: Path) -> None:
    recorder = ShardRecorder(tmp_path, SHARD, run_id="r")
    rows = list(recorder.rows_to_run(recorder.stamp([_row(0), _row(1), _row(2)])))
    recorder.start(rows, config_identity=None)
    seen: list[tuple[str, int, int]] = []

    def sync_hook(row: dict[str, Any], line: dict[str, Any]) -> None:
        seen.append(("sync", row[keys.TASK_INDEX], line[keys.TASK_INDEX]))

    async def async_hook(row: dict[str, Any], line: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        seen.append(("async", row[keys.TASK_INDEX], line[keys.TASK_INDEX]))

    await recorder.failure_recorder(None)(rows[0], _failure(rows[0]))
    await recorder.failure_recorder(sync_hook)(rows[1], _failure(rows[1]))
    await recorder.failure_recorder(async_hook)(rows[2], _failure(rows[2]))
    recorder.closing()
    assert seen == [("sync", 1, 1), ("async", 2, 2)]
    assert [r[keys.TASK_INDEX] for r in _lines(tmp_path / f"rollouts-{SHARD}_failures.jsonl")] == [0, 1, 2]


# --- resuming ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "runs"), [(None, 3), (1, 1), (4, 4)], ids=["default-3", "cap-1", "cap-4"])
def test_a_failing_rollout_runs_at_most_the_attempt_cap(tmp_path: Path, cap: int | None, runs: int) -> None:
    kwargs = {} if cap is None else {"max_rollout_attempts": cap}
    attempts = []
    for _ in range(6):
        ran = _record(
            tmp_path,
            [_row(0), _row(1)],
            lambda r: _failure(r) if r[keys.TASK_INDEX] else _success(r),
            **kwargs,
        )
        attempts.append([(r[keys.TASK_INDEX], r.get(keys.ATTEMPT_INDEX, 0)) for r in ran])
        if ran:
            assert _manifest(tmp_path).max_rollout_attempts == (cap or 3)
    assert attempts == [[(0, 0), (1, 0)], *[[(1, n)] for n in range(1, runs)], *[[]] * (6 - runs)]


def test_a_complete_shard_resumed_gets_its_progress_written_again(tmp_path: Path) -> None:
    _record(tmp_path, [_row(0), _row(1)], run_id="r")
    (tmp_path / f"rollouts-{SHARD}.progress.json").unlink()
    assert _record(tmp_path, [_row(0), _row(1)]) == []
    assert (_progress(tmp_path).run_id, _progress(tmp_path).planned, _progress(tmp_path).succeeded) == (
        "r",
        2,
        2,
    )


def test_values_that_read_back_alike_resume_the_shard(tmp_path: Path) -> None:
    rows = [_row(0, tags=("a", "b"))]  # a tuple is written as a list
    _record(tmp_path, rows, run_id="r")
    assert _record(tmp_path, rows) == []


def test_a_key_given_as_null_that_the_shard_lacks_is_another_row(tmp_path: Path) -> None:
    _record(tmp_path, [_row(0)], run_id="r")
    with pytest.raises(ResumeError, match=r"_materialized_inputs\.jsonl: row 0 differs in note\)"):
        ShardRecorder(tmp_path, SHARD).stamp([_row(0, note=None)])


def test_inputs_without_a_manifest_name_the_run_to_resume(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, SHARD, run_id="r1", config_identity=None) as writer:
        writer.write_materialized_inputs([{**_row(0), keys.RUN_ID: "r1"}])  # crashed before the manifest
    assert ShardRecorder(tmp_path, SHARD).run_id == "r1"
    with pytest.raises(ResumeError, match="recorded under run id 'r1', so run_id='r2' names other rows"):
        ShardRecorder(tmp_path, SHARD, run_id="r2")


def test_a_manifest_names_the_run_even_without_its_inputs(tmp_path: Path) -> None:
    _record(tmp_path, [_row(0)], run_id="r1")
    (tmp_path / f"rollouts-{SHARD}_materialized_inputs.jsonl").unlink()
    (tmp_path / f"rollouts-{SHARD}.jsonl").write_bytes(b"")
    with pytest.raises(ResumeError, match="recorded under run id 'r1', so run_id='r2' names other rows"):
        ShardRecorder(tmp_path, SHARD, run_id="r2")


def test_an_unreadable_manifest_is_a_resume_error_naming_the_shard(tmp_path: Path) -> None:
    (tmp_path / f"rollouts-{SHARD}.manifest.json").write_text("{", encoding="utf-8")
    with pytest.raises(ResumeError, match=r"^record_shard='s0': .*rollouts-s0\.manifest\.json"):
        ShardRecorder(tmp_path, SHARD)


@pytest.mark.parametrize("manifest", [False, True], ids=["inputs-only", "with-manifest"])
def test_a_corrupt_materialized_row_names_its_file_and_line(tmp_path: Path, manifest: bool) -> None:
    _record(tmp_path, [_row(0), _row(1)], run_id="r")
    inputs = tmp_path / f"rollouts-{SHARD}_materialized_inputs.jsonl"
    good = inputs.read_bytes().splitlines(keepends=True)
    bad_line = 2 if manifest else 1
    good[bad_line - 1] = b"{not json\n"
    inputs.write_bytes(b"".join(good))
    if not manifest:
        (tmp_path / f"rollouts-{SHARD}.manifest.json").unlink()
    with pytest.raises(InputError, match=rf"_materialized_inputs\.jsonl:{bad_line}: not a JSON object"):
        ShardRecorder(tmp_path, SHARD).stamp([_row(0), _row(1)])


@pytest.mark.parametrize(
    ("content", "refused"), [(b"", False), (b"{", True)], ids=["empty-files", "one-torn-byte"]
)
def test_records_without_inputs_are_refused_only_when_a_file_holds_bytes(
    tmp_path: Path, content: bytes, refused: bool
) -> None:
    (tmp_path / f"rollouts-{SHARD}.jsonl").write_bytes(content)
    (tmp_path / f"rollouts-{SHARD}_failures.jsonl").write_bytes(b"")
    if refused:
        with pytest.raises(ResumeError, match="holds records of that shard but not its materialized inputs"):
            ShardRecorder(tmp_path, SHARD)
    else:
        assert [r[keys.TASK_INDEX] for r in _record(tmp_path, [_row(0)])] == [0]


def test_a_resume_whose_inputs_changed_writes_nothing(tmp_path: Path) -> None:
    _record(tmp_path, [_row(0), _row(1)], lambda r: _failure(r), run_id="r")
    inputs = tmp_path / f"rollouts-{SHARD}_materialized_inputs.jsonl"
    lines = inputs.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'{"', b'{"extra":1,"', 1)  # a key the caller does not give: digest differs
    inputs.write_bytes(b"".join(lines))
    before = _files(tmp_path)
    recorder = ShardRecorder(tmp_path, SHARD)
    with pytest.raises(ResumeError, match="do not match the manifest"):
        list(recorder.rows_to_run(recorder.stamp([_row(0), _row(1)])))
    recorder.closing()
    after = _files(tmp_path)
    assert {k: v for k, v in after.items() if k != f"rollouts-{SHARD}.lock"} == {
        k: v for k, v in before.items() if k != f"rollouts-{SHARD}.lock"
    }


def test_a_resume_under_another_config_writes_nothing(tmp_path: Path) -> None:
    _record(tmp_path, [_row(0), _row(1)], lambda r: _failure(r), run_id="r")
    before = _files(tmp_path)
    recorder = ShardRecorder(tmp_path, SHARD)
    pending = list(recorder.rows_to_run(recorder.stamp([_row(0), _row(1)])))
    assert [r[keys.ATTEMPT_INDEX] for r in pending] == [1, 1]
    with pytest.raises(
        ResumeError, match=r"was recorded under config identity cfg-a\.\.\. but the current config"
    ):
        recorder.start(pending, config_identity="cfg-b")
    recorder.closing()
    after = _files(tmp_path)
    assert {k: v for k, v in after.items() if k != f"rollouts-{SHARD}.lock"} == {
        k: v for k, v in before.items() if k != f"rollouts-{SHARD}.lock"
    }


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        pytest.param(lambda rows: rows[:1], "2 rows are pending, this call would run 1", id="fewer"),
        pytest.param(
            lambda rows: [rows[0], {**rows[1], "prompt": "other"}],
            "pending row 1 differs once validated against the config",
            id="other-content",
        ),
    ],
)
def test_a_resume_runs_exactly_the_pending_rows(tmp_path: Path, change: Any, problem: str) -> None:
    _record(tmp_path, [_row(0), _row(1)], lambda r: _failure(r), run_id="r")
    recorder = ShardRecorder(tmp_path, SHARD)
    pending = list(recorder.rows_to_run(recorder.stamp([_row(0), _row(1)])))
    with pytest.raises(ResumeError) as info:
        recorder.start(change(pending), config_identity="cfg-a")
    assert f"(rollouts-{SHARD}_materialized_inputs.jsonl: {problem})" in str(info.value)
    recorder.closing()
