"""Collection and a hung ``/run``: every failure record in the shard's failures file states the ``/run``
requests of its attempt, and together they are exactly what the server received (the engine's one retry
ladder; the HTTP client does not replay on its own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.run.collect import acollect_local
from gym_ray.servers import serve_config
from tests.dispatch.test_dispatch import make_config, row


def _rows() -> list[dict[str, Any]]:
    rows = [row(i) for i in range(4)]
    rows[2]["fault"] = "hang"
    for r in rows:
        del r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX]
    return rows


async def test_a_hung_rows_records_state_every_request_the_server_received(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    async with serve_config(make_config()) as dep:
        settings: dict[str, Any] = {"output_dir": str(run_dir), "request_timeout_s": 0.5}
        first = await acollect_local(dep.config, rows=_rows(), **settings)
        after_first = dict(dep.stats("env").request_counts)
        again = await acollect_local(dep.config, rows=_rows(), **settings)  # resumes: attempt 1 of the row
        counts = dep.stats("env").request_counts
    failures = [
        json.loads(line)
        for line in (run_dir / "rollouts_failures.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert [(f[keys.TASK_INDEX], f.get(keys.ATTEMPT_INDEX, 0)) for f in failures] == [(2, 0), (2, 1)]
    assert [f[keys.FAILURE_REQUESTS] for f in failures] == [3, 3]
    assert [f[keys.FAILURE_REQUEST_ERRORS] for f in failures] == [["timeout"] * 3] * 2
    assert all("after 3 attempt(s)" in f[keys.FAILURE_MESSAGE] for f in failures)
    assert after_first == {(0, 0): 1, (1, 0): 1, (2, 0): 3, (3, 0): 1}
    assert counts == {(0, 0): 1, (1, 0): 1, (2, 0): 6, (3, 0): 1}  # the resume sent the hung row only
    assert (first.succeeded, first.failed) == (3, 1)
    assert (again.succeeded, again.failed) == (3, 1)
