"""``run_examples`` / ``run_outcomes`` recording a shard (real servers, real files)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import InputError, ResumeError, ServerHTTPError, ShardLockError, UsageError
from gym_ray.plan.resume import plan_resume
from gym_ray.record.manifest import ShardManifest, ShardProgress
from gym_ray.record.status import run_status
from gym_ray.record.writer import ShardWriter
from gym_ray.servers import Deployment, calc_config, serve_config

SHARD = "helper-0"


def _config() -> dict[str, Any]:
    return calc_config(seed=3, latency_ms=0)


def _rows(n: int, *, repeats: int = 1, fault_task: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for task in range(n):
        for rollout in range(repeats):
            row: dict[str, Any] = {
                "responses_create_params": {"input": [{"role": "user", "content": f"What is {task} + 1?"}]},
                "expected_answer": str(task + 1),
                "difficulty": 0.0,
                "agent_ref": {"name": "calc_agent"},
                keys.TASK_INDEX: task,
                keys.ROLLOUT_INDEX: rollout,
            }
            if task == fault_task:
                row["fault"] = "500"
            rows.append(row)
    return rows


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _key(record: dict[str, Any]) -> tuple[int, int]:
    return (record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX])


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    async with serve_config(_config()) as dep:
        yield dep


async def test_run_examples_records_the_shard_like_collection(deployment: Deployment, tmp_path: Path) -> None:
    rows = _rows(3, repeats=2)
    rows[1][keys.ROLLOUT_ID] = "mine"
    originals = json.loads(json.dumps(rows))
    async with RolloutCollectionHelper(deployment.config) as helper:
        completions = helper.run_examples(rows, record_output_dir=tmp_path, record_shard=SHARD)
        try:
            outcomes = [item async for item in completions]
        finally:
            await completions.aclose()
    assert rows == originals  # the caller's rows are never modified
    run_ids = {row[keys.RUN_ID] for row, _ in outcomes}
    assert len(run_ids) == 1
    (run_id,) = run_ids
    by_key = {_key(row): (row, result) for row, result in outcomes}
    # every copy names the shard's run and carries its own id prefixed with the run id
    assert {k: row[keys.ROLLOUT_ID] for k, (row, _) in by_key.items()} == {
        (0, 0): f"{run_id}-0-0",
        (0, 1): f"{run_id}-mine",
        (1, 0): f"{run_id}-1-0",
        (1, 1): f"{run_id}-1-1",
        (2, 0): f"{run_id}-2-0",
        (2, 1): f"{run_id}-2-1",
    }
    # the successes file holds exactly the returned records, one line each
    successes = _lines(tmp_path / f"rollouts-{SHARD}.jsonl")
    assert sorted(successes, key=_key) == [by_key[k][1] for k in sorted(by_key)]
    first = by_key[(0, 1)][1]
    assert sorted(first) == sorted(
        [
            "responses_create_params",
            "response",
            "reward",
            "expected_answer",
            "extracted_answer",
            keys.TASK_INDEX,
            keys.ROLLOUT_INDEX,
            keys.AGENT_REF,
            keys.ROLLOUT_ID,
            keys.RUN_ID,
            keys.ENVIRONMENT_SERVER,
            keys.RESULT_TYPE,
            keys.NG_TRAJECTORY,
            keys.NG_PERF,
        ]
    )
    assert (first[keys.ROLLOUT_ID], first[keys.RUN_ID], first[keys.ENVIRONMENT_SERVER]) == (
        f"{run_id}-mine",
        run_id,
        "calc_env",
    )
    assert (first[keys.RESULT_TYPE], first["reward"]) == ("example_env", 1.0)
    assert (tmp_path / f"rollouts-{SHARD}_failures.jsonl").read_bytes() == b""
    # materialized inputs: the dispatched copies, in input order
    inputs = _lines(tmp_path / f"rollouts-{SHARD}_materialized_inputs.jsonl")
    assert inputs == [
        {**row, keys.RUN_ID: run_id, keys.ROLLOUT_ID: by_key[_key(row)][0][keys.ROLLOUT_ID]}
        for row in originals
    ]
    manifest = ShardManifest.model_validate_json((tmp_path / f"rollouts-{SHARD}.manifest.json").read_bytes())
    assert (manifest.run_id, manifest.shard, manifest.num_rows) == (run_id, SHARD, 6)
    assert manifest.attempt_plan == ((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0))
    assert manifest.config_identity is not None
    progress = ShardProgress.model_validate_json((tmp_path / f"rollouts-{SHARD}.progress.json").read_bytes())
    assert (progress.planned, progress.succeeded, progress.failed, progress.attempts) == (6, 6, {}, 6)
    # resume (and status) read the shard like a collection shard: nothing left to run
    plan = plan_resume(tmp_path, SHARD, config_identity=manifest.config_identity)
    assert plan.counts() == {
        "num_rows": 6,
        "succeeded": 6,
        "terminal": 0,
        "maxed_out": 0,
        "pending": 0,
        "retrying": 0,
        "prior_failure_attempts": 0,
        "corrupt_lines": 0,
        "ignored_lines": 0,
    }
    (status,) = run_status(tmp_path).shards
    assert (status.shard, status.planned, status.succeeded, status.pending, status.failed_attempts) == (
        SHARD,
        6,
        6,
        0,
        0,
    )


async def test_run_outcomes_routes_a_failure_to_the_sidecar(deployment: Deployment, tmp_path: Path) -> None:
    async with RolloutCollectionHelper(deployment.config) as helper:
        completions = helper.run_outcomes(
            _rows(3, fault_task=1), run_id="r7", record_output_dir=tmp_path, record_shard=SHARD
        )
        try:
            outcomes = {_key(row): outcome async for row, outcome in completions}
        finally:
            await completions.aclose()
    failure = outcomes[(1, 0)]
    assert isinstance(failure, RolloutFailureRecord)
    (line,) = _lines(tmp_path / f"rollouts-{SHARD}_failures.jsonl")
    assert line == failure.to_row()
    assert {
        k: line[k] for k in (keys.FAILURE_CLASS, keys.FAILURE_HTTP_STATUS, keys.ROLLOUT_ID, keys.RUN_ID)
    } == {
        keys.FAILURE_CLASS: "agent_run_error",
        keys.FAILURE_HTTP_STATUS: 500,
        keys.ROLLOUT_ID: "r7-1-0",
        keys.RUN_ID: "r7",
    }
    assert sorted(_key(r) for r in _lines(tmp_path / f"rollouts-{SHARD}.jsonl")) == [(0, 0), (2, 0)]
    plan = plan_resume(tmp_path, SHARD)
    assert (plan.succeeded, plan.pending_count, plan.retrying, plan.attempts) == (2, 1, 1, {(1, 0): 1})
    assert [r[keys.ROLLOUT_ID] for r in plan.iter_pending()] == ["r7-1-0"]
    (status,) = run_status(tmp_path).shards
    assert (status.succeeded, status.failed_by_class, status.failed, status.pending, status.resumable) == (
        2,
        {"agent_run_error": 1},
        1,
        0,
        1,
    )


async def test_unrouted_failure_is_kept_in_the_sidecar_then_raised(
    deployment: Deployment, tmp_path: Path
) -> None:
    async with RolloutCollectionHelper(deployment.config) as helper:
        completions = helper.run_examples(
            _rows(1, fault_task=0), max_resident_tasks=1, record_output_dir=tmp_path, record_shard=SHARD
        )
        try:
            with pytest.raises(ServerHTTPError):
                async for _ in completions:
                    pass
        finally:
            await completions.aclose()
    (line,) = _lines(tmp_path / f"rollouts-{SHARD}_failures.jsonl")
    assert (line[keys.FAILURE_CLASS], line[keys.FAILURE_HTTP_STATUS], line[keys.TASK_INDEX]) == (
        "agent_run_error",
        500,
        0,
    )
    assert line[keys.RUN_ERROR].startswith("ServerHTTPError: ")
    progress = json.loads((tmp_path / f"rollouts-{SHARD}.progress.json").read_text(encoding="utf-8"))
    assert (progress["succeeded"], progress["failed"]) == (0, {"agent_run_error": 1})


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        pytest.param({"record_output_dir": "x"}, UsageError, "recording needs both", id="dir-only"),
        pytest.param({"record_shard": "s"}, UsageError, "recording needs both", id="shard-only"),
        pytest.param(
            {"record_output_dir": "x", "record_shard": "../s"}, UsageError, "'../s'", id="bad-label"
        ),
    ],
)
def test_bad_recording_arguments_are_refused_at_call(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    helper = RolloutCollectionHelper(_config())
    with pytest.raises(error, match=fragment.replace(".", r"\.")):
        helper.run_examples(_rows(1), **kwargs)


def test_rows_without_identity_and_a_shard_without_inputs_are_refused(tmp_path: Path) -> None:
    helper = RolloutCollectionHelper(_config())
    row = _rows(1)[0]
    del row[keys.ROLLOUT_INDEX]
    with pytest.raises(InputError, match="row 0 has _ng_task_index=0 and _ng_rollout_index=None"):
        helper.run_examples([row], record_output_dir=tmp_path, record_shard=SHARD)
    (tmp_path / f"rollouts-{SHARD}.jsonl").write_text("{}\n", encoding="utf-8")
    with pytest.raises(ResumeError) as info:
        helper.run_examples(_rows(1), record_output_dir=tmp_path, record_shard=SHARD)
    assert str(info.value) == (
        f"record_shard='{SHARD}': {tmp_path} holds records of that shard but not its materialized inputs "
        f"(rollouts-{SHARD}_materialized_inputs.jsonl), so it cannot be resumed; restore that file, or "
        "record into a new shard label or folder"
    )


async def test_a_newer_writer_makes_the_helper_fail_on_its_next_append(
    deployment: Deployment, tmp_path: Path
) -> None:
    async with RolloutCollectionHelper(deployment.config) as helper:
        completions = helper.run_examples(
            _rows(3), max_resident_tasks=1, record_output_dir=tmp_path, record_shard=SHARD
        )
        try:
            first_row, _ = await anext(aiter(completions))
            with ShardWriter(tmp_path, SHARD, run_id="newer", config_identity=None):
                pass  # a newer owner opened the shard: the helper's writer is stale now
            with pytest.raises(ShardLockError, match="opened by another writer"):
                async for _ in completions:
                    pass
        finally:
            await completions.aclose()
    assert [_key(r) for r in _lines(tmp_path / f"rollouts-{SHARD}.jsonl")] == [_key(first_row)]


# --- recording a shard that already holds records: resume, refusal, takeover -----------------------


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


async def _collect(completions: Any) -> list[tuple[dict[str, Any], Any]]:
    try:
        return [item async for item in completions]
    finally:
        await completions.aclose()


async def test_the_same_rows_again_resume_the_shard(deployment: Deployment, tmp_path: Path) -> None:
    rows = _rows(3, fault_task=1)
    rows[1]["fault_until_attempt"] = 1  # attempt 0 answers 500, attempt 1 succeeds
    async with RolloutCollectionHelper(deployment.config) as helper:
        first = dict(
            (_key(row), outcome)
            for row, outcome in await _collect(
                helper.run_outcomes(rows, record_output_dir=tmp_path, record_shard=SHARD)
            )
        )
        assert isinstance(first[(1, 0)], RolloutFailureRecord)
        manifest = ShardManifest.model_validate_json(
            (tmp_path / f"rollouts-{SHARD}.manifest.json").read_bytes()
        )
        second = await _collect(helper.run_outcomes(rows, record_output_dir=tmp_path, record_shard=SHARD))
    # only the missing rollout ran again, with its next attempt, under the shard's own run id
    ((row, outcome),) = second
    assert (_key(row), row[keys.ATTEMPT_INDEX], row[keys.RUN_ID]) == ((1, 0), 1, manifest.run_id)
    assert isinstance(outcome, dict)
    assert (outcome["reward"], outcome[keys.ROLLOUT_ID]) == (1.0, f"{manifest.run_id}-1-0")
    assert deployment.stats("calc_env").request_counts == {(0, 0): 1, (1, 0): 2, (2, 0): 1}
    successes = _lines(tmp_path / f"rollouts-{SHARD}.jsonl")
    assert sorted(_key(r) for r in successes) == [(0, 0), (1, 0), (2, 0)]
    assert {r[keys.RUN_ID] for r in successes} == {manifest.run_id}
    resumed = ShardManifest.model_validate_json((tmp_path / f"rollouts-{SHARD}.manifest.json").read_bytes())
    assert (resumed.run_id, resumed.inputs_digest, resumed.config_identity) == (
        manifest.run_id,
        manifest.inputs_digest,
        manifest.config_identity,
    )
    assert resumed.attempt_plan == ((0, 0, 0), (1, 0, 1), (2, 0, 0))
    progress = ShardProgress.model_validate_json((tmp_path / f"rollouts-{SHARD}.progress.json").read_bytes())
    assert (progress.planned, progress.succeeded, progress.failed, progress.attempts) == (
        3,
        3,
        {"agent_run_error": 1},
        4,
    )
    assert plan_resume(tmp_path, SHARD, config_identity=manifest.config_identity).pending_count == 0


async def test_a_complete_shard_resumed_runs_nothing(deployment: Deployment, tmp_path: Path) -> None:
    async with RolloutCollectionHelper(deployment.config) as helper:
        await _collect(helper.run_examples(_rows(2), record_output_dir=tmp_path, record_shard=SHARD))
        before = (tmp_path / f"rollouts-{SHARD}.jsonl").read_bytes()
        again = await _collect(helper.run_examples(_rows(2), record_output_dir=tmp_path, record_shard=SHARD))
    assert again == []
    assert deployment.stats("calc_env").request_counts == {(0, 0): 1, (1, 0): 1}
    assert (tmp_path / f"rollouts-{SHARD}.jsonl").read_bytes() == before


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        pytest.param(lambda rows: rows[:2], "it holds 3 rows, this call gave 2", id="fewer-rows"),
        pytest.param(
            lambda rows: [rows[0], {**rows[1], "expected_answer": "7"}, rows[2]],
            "row 1 differs in expected_answer",
            id="other-content",
        ),
        pytest.param(
            lambda rows: [rows[1], rows[0], rows[2]],
            f"row 0 differs in {keys.ROLLOUT_ID}, {keys.TASK_INDEX}, expected_answer, "
            "responses_create_params",
            id="other-order",
        ),
    ],
)
async def test_other_rows_are_refused_as_other_materialized_inputs(
    deployment: Deployment, tmp_path: Path, change: Any, problem: str
) -> None:
    rows = _rows(3)
    async with RolloutCollectionHelper(deployment.config) as helper:
        await _collect(helper.run_examples(rows, record_output_dir=tmp_path, record_shard=SHARD))
        files = _files(tmp_path)
        with pytest.raises(ResumeError) as info:
            helper.run_examples(change(rows), record_output_dir=tmp_path, record_shard=SHARD)
    assert str(info.value) == (
        f"record_shard='{SHARD}': {tmp_path} already holds that shard, recorded from other rows "
        f"(rollouts-{SHARD}_materialized_inputs.jsonl: {problem}); these are other materialized inputs, so "
        "this call cannot resume the shard. Pass the shard's own rows to resume it, or record into a new "
        "shard label or folder"
    )
    assert _files(tmp_path) == files
    assert deployment.stats("calc_env").requests == 3


async def test_another_run_id_for_a_recorded_shard_is_refused(deployment: Deployment, tmp_path: Path) -> None:
    async with RolloutCollectionHelper(deployment.config) as helper:
        await _collect(
            helper.run_outcomes(_rows(1), run_id="r1", record_output_dir=tmp_path, record_shard=SHARD)
        )
        with pytest.raises(ResumeError) as info:
            helper.run_outcomes(_rows(1), run_id="r2", record_output_dir=tmp_path, record_shard=SHARD)
    assert str(info.value) == (
        f"record_shard='{SHARD}': {tmp_path} holds that shard recorded under run id 'r1', so run_id='r2' "
        "names other rows; pass run_id='r1' (or none) to resume it, or record into a new shard label or "
        "folder"
    )


async def test_a_second_call_takes_the_shard_over_from_a_running_one(
    deployment: Deployment, tmp_path: Path
) -> None:
    rows = _rows(4)
    async with RolloutCollectionHelper(deployment.config) as helper:
        older = helper.run_examples(
            rows, max_resident_tasks=1, record_output_dir=tmp_path, record_shard=SHARD
        )
        try:
            await anext(aiter(older))
            newer = await _collect(helper.run_examples(rows, record_output_dir=tmp_path, record_shard=SHARD))
            with pytest.raises(ShardLockError) as info:
                async for _ in older:
                    pass
        finally:
            await older.aclose()
    assert (info.value.shard, info.value.holder_pid) == (SHARD, os.getpid())
    lines = _lines(tmp_path / f"rollouts-{SHARD}.jsonl")
    # every rollout exactly once; the older call's lines come first, then the newer call's (its outcomes)
    assert sorted(_key(r) for r in lines) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [_key(r) for r in lines[len(lines) - len(newer) :]] == [_key(row) for row, _ in newer]
    assert len(newer) >= 2  # the older call had recorded at most rows 0 and 1 when the newer one took over
