"""Collection contracts that planted bugs slipped past: ``retry_requests=False`` means one ``/run`` each.

PROTOCOL.md / RELIABILITY.md: "a ``/run`` whose body may have been delivered is sent again only where
``retry_requests`` allows it". The reference server reads each body, counts the request, then drops the
connection without a byte of reply (fault ``drop``): the body was delivered, so with the setting off every
rollout is sent exactly once and recorded as one failure attempt. The server's per-rollout request counts
are the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_ray.record.ledger import check_run
from gym_ray.run.collect import acollect_local
from gym_ray.servers import calc_config, serve_config


def _config() -> dict[str, Any]:
    return calc_config()


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": f"What is {i} + 1?"},
            "expected_answer": str(i + 1),
            "agent_ref": {"name": "calc_agent"},
            "fault": "drop",
        }
        for i in range(n)
    ]


async def test_collection_with_retry_requests_off_sends_each_run_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with serve_config(_config()) as dep:
        result = await acollect_local(
            dep.config, rows=_rows(4), output_dir=str(out), num_repeats=2, retry_requests=False
        )
        counts = dict(dep.stats("calc_env").request_counts)
    assert counts == {(task, rollout): 1 for task in range(4) for rollout in range(2)}
    assert (result.planned, result.dispatched, result.succeeded, result.failed) == (8, 8, 0, 8)
    assert result.failed_by_class == {"agent_request_failed": 8}
    failures = [json.loads(line) for line in (out / "rollouts_failures.jsonl").read_text().splitlines()]
    assert sorted((f["_ng_task_index"], f["_ng_rollout_index"]) for f in failures) == [
        (task, rollout) for task in range(4) for rollout in range(2)
    ]
    ledger = check_run(out, request_counts=counts)
    assert (ledger.recorded, ledger.duplicates, ledger.wasted_requests) == (8, 0, 0)
