"""Counts that mean one thing: rows (succeeded, failed, pending) apart from failure attempts; the plan's full
size known to status and the ledger before planning ends; the exit status contract in Python.

Real reference servers on 127.0.0.1; a row with ``"fault": "non_object"`` makes the server answer 200 with
a JSON list, a failure of that row on every attempt (PROTOCOL's "not a JSON object" case).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import resolve_run_config
from gym_ray.errors import IncompleteRunError
from gym_ray.plan.shards import iter_prepare_run
from gym_ray.record.ledger import check_run
from gym_ray.record.status import format_status, run_status
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment


def _rows(n: int, *, failing: set[int] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    rows = []
    for i in range(n):
        row: dict[str, Any] = {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "expected_answer": str(i + 1),
            "agent_ref": {"name": "calc_agent"},
        }
        if i in failing:
            row["fault"] = "non_object"
        rows.append(row)
    return rows


async def test_failed_rows_and_failed_attempts_are_counted_apart(
    tmp_path: Path, deployment: Deployment
) -> None:
    inputs = tmp_path / "rows.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in _rows(8, failing={2, 5})))
    settings = {"input_jsonl_fpath": str(inputs), "output_dir": str(tmp_path / "out")}

    first = await acollect_local(deployment.config, **settings)
    assert (first.planned, first.succeeded, first.failed, first.pending) == (8, 6, 2, 0)
    assert (first.failure_attempts, first.resumable, first.complete) == (2, 2, False)

    second = await acollect_local(deployment.config, **settings)  # resume: only the 2 failed rows run again
    assert (second.planned, second.succeeded, second.failed, second.pending) == (8, 6, 2, 0)
    assert (second.failure_attempts, second.resumable, second.dispatched) == (4, 2, 2)
    assert json.loads((tmp_path / "out" / "rollouts_summary.json").read_text())["failed"] == 2

    with pytest.raises(IncompleteRunError) as raised:
        await acollect_local(deployment.config, require_complete=True, **settings)  # third attempt of each
    assert str(raised.value) == (
        f"run folder {tmp_path / 'out'} is incomplete: 2 failed and 0 pending of 8 planned rollouts "
        "(6 succeeded, 6 failed attempts); none has attempts left (max_rollout_attempts); raise "
        "max_rollout_attempts and rerun to retry them, or accept them with max_failed_fraction"
    )
    assert (raised.value.failed, raised.value.pending, raised.value.resumable) == (2, 0, 0)

    accepted = await acollect_local(deployment.config, max_failed_fraction=0.25, **settings)  # 2 <= 8 x 0.25
    assert (accepted.failed, accepted.dispatched, accepted.complete) == (2, 0, True)
    stricter = await acollect_local(deployment.config, max_failed_fraction=0.2, **settings)  # 2 > 1.6
    assert stricter.complete is False


async def test_a_run_interrupted_while_planning_knows_its_full_size(tmp_path: Path) -> None:
    """The validation pass counts every row before the first shard is cut; status and ledger use it."""
    inputs = tmp_path / "rows.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in _rows(25)))
    out = tmp_path / "out"
    config = {
        "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 9}}},
        "calc_env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 9,
                    "agent_server": {"type": "responses_api_agents", "name": "calc_agent"},
                }
            }
        },
    }
    run = await resolve_run_config(
        config,
        settings={
            "input_jsonl_fpath": str(inputs),
            "output_dir": str(out),
            "num_repeats": 4,
            "shard_size": 20,
        },
    )
    planning = iter_prepare_run(run)
    first = next(planning)  # one shard cut (20 rows = 5 tasks x 4), then the planner is stopped
    planning.close()
    assert first.num_rows == 20

    status = run_status(out)
    assert (status.planned, status.unplanned, status.pending, status.complete) == (100, 80, 100, False)
    assert (
        "resume would run: 100 rollout(s) (0 with earlier failed attempts, 80 not cut into shards yet)"
        in (format_status(status))
    )
    report = check_run(out)
    assert (report.planned, report.unplanned, report.missing, report.ok) == (100, 80, 20, False)
    assert str(report).startswith(f"ledger of {out} (shards): NOT ok: lost 0, missing 20, duplicates 0, ")
