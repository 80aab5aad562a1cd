"""R15/R16 for the stream API: an environment server stops mid-stream.

Back before ``server_outage_timeout_s``: every row is delivered exactly once and none as a failure record
(the stream workers' rows wait while the server is down). Down past the timeout: iterating the stream
raises ``ServerOutageError`` naming the server. Real parts: the reference servers on 127.0.0.1 (a real
stop and restart on the same port) and the session's local Ray (stream workers are real processes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import ServerOutageError
from gym_ray.servers import calc_config, calc_rows, serve_config
from gym_ray.streaming.api import stream
from gym_ray.streaming.worker import STREAM_STOP_HINT

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


async def test_a_short_outage_mid_stream_delivers_every_row_once_and_no_failure(ray_session: Any) -> None:
    async with serve_config(calc_config(seed=3, latency_ms=10, latency_jitter_ms=0)) as dep:
        config = {**dep.config, "server_outage_timeout_s": 120.0}
        tasks: list[int] = []
        failures = 0
        outage: asyncio.Task[None] | None = None
        stopped_at = recovered_s = 0.0

        async def outage_of(seconds: float) -> None:
            await dep.stop_server("calc_env")
            await asyncio.sleep(seconds)  # the length of the outage (the fault itself)
            await dep.restart_server("calc_env")

        try:
            async with stream(calc_rows(200), config=config, num_workers=2, max_in_flight=8) as rollouts:
                async for row, outcome in rollouts:
                    tasks.append(row[keys.TASK_INDEX])
                    failures += isinstance(outcome, RolloutFailureRecord)
                    if len(tasks) == 40:
                        stopped_at = time.monotonic()
                        outage = asyncio.create_task(outage_of(3.0))
                    if outage is not None and outage.done() and not recovered_s:
                        recovered_s = time.monotonic() - stopped_at
        finally:
            if outage is not None:
                await outage
        requests = dep.stats("calc_env").requests
    print(
        f"[chaos R15 stream] delivered={len(tasks)} distinct={len(set(tasks))} failure_records={failures} "
        f"requests={requests} recovered_after_s={recovered_s:.1f}"
    )
    assert sorted(tasks) == list(range(200))  # every row exactly once
    assert failures == 0
    assert recovered_s > 0  # rows were still being delivered after the server came back


async def test_a_server_down_past_the_timeout_ends_the_stream_with_server_outage_error(
    ray_session: Any,
) -> None:
    async with serve_config(calc_config(seed=3, latency_ms=10, latency_jitter_ms=0)) as dep:
        config = {**dep.config, "server_outage_timeout_s": 2.0}
        delivered: list[Any] = []

        async def consume() -> None:
            async with stream(calc_rows(200), config=config, num_workers=2, max_in_flight=8) as rollouts:
                async for _row, outcome in rollouts:
                    delivered.append(outcome)
                    if len(delivered) == 40:
                        await dep.stop_server("calc_env")

        with pytest.raises(
            ServerOutageError,
            match=r"^environment server 'calc_env' \(http://127\.0\.0\.1:\d+\) has not answered",
        ) as caught:
            await consume()
    assert caught.value.server == "calc_env"
    assert str(caught.value).endswith(f"; {STREAM_STOP_HINT}")
    assert "\n" not in str(caught.value)  # one line, not a worker's traceback
    assert 40 <= len(delivered) < 200
    assert not [o for o in delivered if isinstance(o, RolloutFailureRecord)]
