"""``one_version_groups``: with a pause("abort") and a new policy version at every step, every delivered
group ran under one version, and nothing is lost or duplicated (the server's own request count closes:
requests = delivered + aborted + stale re-runs)."""

from __future__ import annotations

from typing import Any

import pytest

from gym_ray import keys
from gym_ray.servers import serve_config
from gym_ray.streaming.api import stream
from gym_ray.streaming.groups import RolloutGroup
from tests.streaming.test_stream import _config, _row

pytestmark = pytest.mark.ray

TASKS = 16
GROUP = 4


async def test_every_group_has_one_policy_version_across_aborts(ray_session: Any) -> None:
    delivered: list[RolloutGroup] = []
    async with serve_config(_config(fast_ms=300)) as servers:
        async with stream(
            [_row(i) for i in range(TASKS)],
            config=servers.config,
            group_size=GROUP,
            max_in_flight=6,  # fewer than two groups: a group's members run at different times
            num_workers=2,
            one_version_groups=True,
        ) as rollouts:
            version = 0
            while batch := await rollouts.next_batch(2):
                delivered.extend(batch)  # type: ignore[arg-type]
                await rollouts.pause("abort")
                version += 1
                await rollouts.set_policy_version(version)
                await rollouts.resume()
            stats = rollouts.stats()
        server = servers.stats("fast_env")
    assert all(group.oldest_version == group.newest_version for group in delivered)
    keys_seen = [(row[keys.TASK_INDEX], row[keys.ROLLOUT_INDEX]) for group in delivered for row, _ in group]
    assert sorted(keys_seen) == [(t, r) for t in range(TASKS) for r in range(GROUP)]  # each once
    assert stats.aborted > 0
    assert server.requests == stats.delivered + stats.aborted + stats.stale
    assert server.cancelled == stats.aborted
