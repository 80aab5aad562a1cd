"""Failures a trainer can handle: data retries in a stream (``max_rollout_attempts``) and the
``drop_failed`` group filter, against a reference server failing 10% of its ``/run`` (seeded per task,
rollout and attempt, so a retry draws again). The server's request count must close exactly."""

from __future__ import annotations

from typing import Any

import pytest

import gym_ray
from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.servers import serve_config
from gym_ray.streaming.api import stream
from tests.streaming.test_stream import _config, _row

pytestmark = pytest.mark.ray

GROUP = 4
TASKS = 20


def _failing_config() -> dict[str, Any]:
    cfg = _config()
    env = cfg["fast_env"]["environment_servers"]["example_env"]
    env["faults"] = {"error_rate": 0.1, "seed": 11}
    return cfg


async def test_with_data_retries_no_delivered_group_holds_a_failure_and_the_count_closes(
    ray_session: Any,
) -> None:
    async with serve_config(_failing_config()) as servers:
        async with stream(
            [_row(i) for i in range(TASKS)],
            config=servers.config,
            group_size=GROUP,
            max_in_flight=16,
            max_rollout_attempts=4,
            group_filter=gym_ray.drop_failed,
        ) as rollouts:
            groups = [group async for group in rollouts]
            stats = rollouts.stats()
        server = servers.stats("fast_env")
    assert stats.retried > 0  # about 10% of the 80 rollouts failed a first time
    assert all(not group.failures for group in groups)  # type: ignore[union-attr]
    delivered = sum(len(group) for group in groups)  # type: ignore[arg-type]
    dropped = sum(stats.filtered.values()) * GROUP
    assert delivered + dropped == TASKS * GROUP
    assert server.requests == delivered + dropped + stats.retried  # every /run is accounted for
    attempts = {
        (row[keys.TASK_INDEX], row[keys.ROLLOUT_INDEX]): row.get(keys.ATTEMPT_INDEX, 0)
        for group in groups  # type: ignore[union-attr]
        for row, _ in group
    }
    assert sum(attempts.values()) <= stats.retried
    assert max(attempts.values()) >= 1  # a delivered rollout that succeeded on a retry


async def test_without_data_retries_a_failure_is_delivered_with_its_group(ray_session: Any) -> None:
    async with serve_config(_failing_config()) as servers:
        async with stream(
            [_row(i) for i in range(TASKS)], config=servers.config, group_size=GROUP, max_in_flight=16
        ) as rollouts:
            groups = [group async for group in rollouts]
            stats = rollouts.stats()
        server = servers.stats("fast_env")
    failures = [o for group in groups for _, o in group if isinstance(o, RolloutFailureRecord)]  # type: ignore[union-attr]
    assert stats.retried == 0
    assert len(failures) == server.faults.get("status", 0) > 0
    assert server.requests == TASKS * GROUP
