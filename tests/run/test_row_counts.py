"""A shard call's row counts (``ShardReport.rows``) against ``plan_resume`` reading the shard's files again.

A single-process run finishes with the failed / pending / resumable rows its shard calls counted while
they recorded (:mod:`gym_ray.run.row_counts`) instead of parsing every shard again. The oracle is
``plan_resume`` on the files after the call, and the hand-counted states of each row. Real reference
servers on 127.0.0.1; rows force their outcome: ``"fault": "non_object"`` fails every attempt (not
terminal; with ``fault_until_attempt`` only the attempts before it), ``force_failure`` fails terminally.
A call with a drain margin as long as its dispatch budget (:data:`DRAIN_ALL`) drains every row it would
send (no record: a row stays pending, or failed when it has earlier attempts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.config.run_config import resolve_run_config
from gym_ray.plan.resume import plan_resume
from gym_ray.plan.shards import RunPlan, prepare_run
from gym_ray.record.shard_files import list_shards
from gym_ray.record.writer import ShardWriter
from gym_ray.run.collect import acollect_local, client_for, run_shard
from gym_ray.run.result import ShardReport, ShardRows
from gym_ray.run.row_counts import ShardRowTally, rows_of_plan
from gym_ray.servers import Deployment

# Row i's outcome on every attempt (rows not named succeed): 2 fails (non-terminal) every attempt, 5 fails
# terminally, 7 fails its first attempt only.
FAULTS: dict[int, dict[str, Any]] = {
    2: {"fault": "non_object"},
    5: {"force_failure": "no answer for this one"},
    7: {"fault": "non_object", "fault_until_attempt": 1},
}
#: Settings under which every row's turn comes with less time left than the drain margin: all drained.
DRAIN_ALL = {"dispatch_budget_s": 600.0, "drain_margin_s": 600.0}


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "expected_answer": str(i + 1),
            "agent_ref": {"name": "calc_agent"},
            **FAULTS.get(i, {}),
        }
        for i in range(n)
    ]


def _settings(tmp_path: Path) -> dict[str, Any]:
    inputs = tmp_path / "rows.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in _rows(10)))
    return {
        "input_jsonl_fpath": str(inputs),
        "output_dir": str(tmp_path / "out"),
        "shard_size": 4,  # rows 0-3, 4-7, 8-9: three shards
        "max_rollout_attempts": 2,
    }


def _reread(run_dir: str | Path, max_rollout_attempts: int) -> dict[str, ShardRows]:
    return {
        shard: rows_of_plan(plan_resume(run_dir, shard, max_rollout_attempts=max_rollout_attempts))
        for shard in list_shards(run_dir)
    }


def _total(rows: list[ShardRows]) -> tuple[int, int, int]:
    return sum(r.failed for r in rows), sum(r.pending for r in rows), sum(r.resumable for r in rows)


async def _run_each_shard(plan: RunPlan, settings: dict[str, Any], config: Any) -> list[ShardReport]:
    run = await resolve_run_config(config, settings=settings)
    async with client_for(run) as client:
        return [await run_shard(spec, client=client, run=run) for spec in plan.shards]


async def test_each_shard_calls_counts_match_plan_resume_over_failures_retries_and_drains(
    tmp_path: Path, deployment: Deployment
) -> None:
    settings = _settings(tmp_path)
    run = await resolve_run_config(deployment.config, settings=settings)
    plan = prepare_run(run)
    assert [spec.num_rows for spec in plan.shards] == [4, 4, 2]

    async def each_shard(extra: dict[str, Any]) -> list[ShardReport]:
        reports = await _run_each_shard(plan, {**settings, **extra}, deployment.config)
        assert {r.shard: r.rows for r in reports} == _reread(plan.run_dir, 2)
        return reports

    drained = await each_shard(DRAIN_ALL)  # every row drained: all pending, no attempt used
    assert [(r.dispatched, r.omitted) for r in drained] == [(4, 4), (4, 4), (2, 2)]
    assert [r.rows for r in drained] == [
        ShardRows(failed=0, pending=4, resumable=4),
        ShardRows(failed=0, pending=4, resumable=4),
        ShardRows(failed=0, pending=2, resumable=2),
    ]
    first = await each_shard({})  # row 2 fails once (retrying); row 5 terminal, row 7 fails once
    assert [r.rows for r in first] == [
        ShardRows(failed=1, pending=0, resumable=1),
        ShardRows(failed=2, pending=0, resumable=1),
        ShardRows(failed=0, pending=0, resumable=0),
    ]
    again = await each_shard(DRAIN_ALL)  # rows 2 and 7 drained: still failed, still resumable
    assert [(r.dispatched, r.omitted) for r in again] == [(1, 1), (1, 1), (0, 0)]
    assert [r.rows for r in again] == [r.rows for r in first]
    second = await each_shard({})  # row 2 reaches the attempt cap, row 7 succeeds on its second attempt
    assert [(r.dispatched, r.succeeded, r.failed) for r in second] == [(1, 0, 1), (1, 1, 0), (0, 0, 0)]
    assert [r.rows for r in second] == [
        ShardRows(failed=1, pending=0, resumable=0),
        ShardRows(failed=1, pending=0, resumable=0),
        ShardRows(failed=0, pending=0, resumable=0),
    ]


async def test_a_resumed_local_run_reports_the_counts_the_files_give(
    tmp_path: Path, deployment: Deployment
) -> None:
    """Earlier failures on disk, this run completes some: the summary's counts are plan_resume's."""
    settings = _settings(tmp_path)
    drained = await acollect_local(deployment.config, **settings, **DRAIN_ALL)
    assert (drained.succeeded, drained.failed, drained.pending, drained.resumable) == (0, 0, 10, 10)
    assert _total(list(_reread(drained.run_dir, 2).values())) == (0, 10, 10)

    first = await acollect_local(deployment.config, **settings)
    assert (first.planned, first.succeeded, first.failed, first.pending) == (10, 7, 3, 0)
    assert (first.failure_attempts, first.resumable, first.complete) == (3, 2, False)
    assert _total(list(_reread(first.run_dir, 2).values())) == (3, 0, 2)

    second = await acollect_local(deployment.config, **settings)  # rows 2 and 7 run again; 7 succeeds
    assert (second.planned, second.succeeded, second.failed, second.pending) == (10, 8, 2, 0)
    # failure lines of the failed rows: row 2 twice, row 5 once (row 7's failed attempt belongs to a success)
    assert (second.failure_attempts, second.resumable, second.dispatched) == (3, 0, 2)
    assert (second.already_done, second.complete) == (8, False)
    assert _total(list(_reread(second.run_dir, 2).values())) == (2, 0, 0)
    summary = json.loads((tmp_path / "out" / "rollouts_summary.json").read_text())
    assert (summary["failed"], summary["pending"], summary["resumable"]) == (2, 0, 0)


def _identity_row(task: int, rollout: int) -> dict[str, Any]:
    return {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: rollout, "prompt": f"p{task}"}


def test_the_tally_follows_every_record_kind_a_writer_appends(tmp_path: Path) -> None:
    """Success, attempt, terminal failure, omitted line kept in the sidecar, row with no record."""
    rows = [_identity_row(task, 0) for task in range(7)]
    earlier = [
        {**_identity_row(0, 0), "reward": 1.0},  # done: succeeded
        {**_identity_row(1, 0), keys.FAILURE_CLASS: "agent_run_error"},  # one attempt so far
        {**_identity_row(2, 0), keys.FAILURE_CLASS: "agent_run_error", keys.FAILURE_TERMINAL: True},
        {**_identity_row(3, 0), keys.FAILURE_CLASS: "agent_run_error"},
    ]
    with ShardWriter(
        tmp_path, "s0", run_id="r", config_identity=None, record_omitted_rollouts=True
    ) as writer:
        writer.write_materialized_inputs(rows)
        for record in earlier:
            writer.append(record)
    later = [
        {**_identity_row(1, 0), keys.FAILURE_CLASS: "agent_run_error", keys.ATTEMPT_INDEX: 1},  # maxed (2)
        {**_identity_row(3, 0), "reward": 0.0, keys.ATTEMPT_INDEX: 1},  # succeeds on its second attempt
        {**_identity_row(4, 0), keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True},  # kept, no attempt
        {**_identity_row(5, 0), keys.FAILURE_CLASS: "agent_run_error", keys.FAILURE_TERMINAL: True},
        # row 6: no record (never answered)
    ]
    with ShardWriter(
        tmp_path, "s0", run_id="r", config_identity=None, record_omitted_rollouts=True
    ) as writer:
        plan = plan_resume(tmp_path, "s0", max_rollout_attempts=2)
        pending = plan.pending
        assert [(r[keys.TASK_INDEX], r.get(keys.ATTEMPT_INDEX, 0)) for r in pending] == [
            (1, 1), (3, 1), (4, 0), (5, 0), (6, 0)
        ]  # fmt: skip
        tally = ShardRowTally(plan, pending, writer.paths.successes)
        for record in later:
            tally.add(record, writer.append(record))
    # failed: 1 (maxed), 2 (terminal), 5 (terminal); pending: 4 (only an omitted line), 6; resumable: 4, 6.
    assert tally.rows() == ShardRows(failed=3, pending=2, resumable=2)
    assert tally.rows() == rows_of_plan(plan_resume(tmp_path, "s0", max_rollout_attempts=2))


def test_the_tally_gives_up_on_a_record_it_did_not_dispatch(tmp_path: Path) -> None:
    rows = [_identity_row(task, 0) for task in range(3)]
    with ShardWriter(tmp_path, "s0", run_id="r", config_identity=None) as writer:
        writer.write_materialized_inputs(rows)
        writer.append({**_identity_row(0, 0), "reward": 1.0})
    with ShardWriter(tmp_path, "s0", run_id="r", config_identity=None) as writer:
        plan = plan_resume(tmp_path, "s0")
        tally = ShardRowTally(plan, plan.pending, writer.paths.successes)
        record = {**_identity_row(1, 0), "reward": 1.0}
        tally.add(record, writer.append(record))
        assert tally.rows() == ShardRows(failed=0, pending=1, resumable=1)
        tally.add(record, writer.append(record))  # a second record of one row
        assert tally.rows() is None
    with ShardWriter(tmp_path, "s0", run_id="r", config_identity=None) as writer:
        plan = plan_resume(tmp_path, "s0")
        tally = ShardRowTally(plan, plan.pending, writer.paths.successes)
        record = {**_identity_row(0, 0), "reward": 0.5}  # row 0 was done before this call
        tally.add(record, writer.append(record))
        assert tally.rows() is None
