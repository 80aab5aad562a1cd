"""A stream's ``timeout_s`` bounds the time from a hung ``/run`` to its failure record, and the record
states the number of ``/run`` requests the server received (issue: one retry ladder per rollout).

Real parts: the reference servers on 127.0.0.1 (a row's ``fault: hang`` makes its ``/run`` never answer)
and the session's local Ray.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.servers import serve_config
from gym_ray.streaming.api import stream
from tests.streaming.test_stream import _config, _row

pytestmark = pytest.mark.ray

TIMEOUT_S = 1.5


@pytest.mark.parametrize(("retry_requests", "sends"), [(True, 3), (False, 1)])
async def test_a_hung_run_reaches_the_trainer_as_one_failure_record_within_the_bound(
    ray_session: Any, retry_requests: bool, sends: int
) -> None:
    rows = [_row(0), {**_row(1), "fault": "hang"}, _row(2)]
    async with serve_config(_config()) as servers:
        started = time.monotonic()
        seen: dict[int, tuple[Any, float]] = {}
        async with stream(
            rows, config=servers.config, timeout_s=TIMEOUT_S, retry_requests=retry_requests, num_workers=1
        ) as rollouts:
            async for row, outcome in rollouts:  # type: ignore[misc]
                seen[row[keys.TASK_INDEX]] = (outcome, time.monotonic() - started)
        counts = servers.stats("fast_env").request_counts
    assert sorted(seen) == [0, 1, 2]
    assert all(not isinstance(seen[i][0], RolloutFailureRecord) for i in (0, 2))
    record, arrived_s = seen[1]
    assert isinstance(record, RolloutFailureRecord)
    assert counts == {(0, 0): 1, (1, 0): sends, (2, 0): 1}  # the server saw what the record states
    assert record.requests == sends
    assert record.request_errors == ("timeout",) * sends
    assert f"within the request timeout ({TIMEOUT_S} s) after {sends} attempt(s)" in record.message
    # the documented bound: timeout x sends + backoffs (<= 1 s each with the defaults) + a few seconds for
    # the stream's start (Ray actors) and the probes
    assert arrived_s < TIMEOUT_S * sends + (sends - 1) * 1.0 + 10.0
