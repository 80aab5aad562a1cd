"""A trainer that runs as a Ray actor and owns a stream (as NeMo RL's collector, verl's rollouter and
AReaL's controller do): the stream joins the actor's Ray instead of starting one, and its worker actors
are the trainer's children. Real parts: the reference servers on 127.0.0.1 and the session's Ray."""

from __future__ import annotations

from typing import Any

import pytest

from gym_ray.servers import serve_config
from tests.streaming.test_stream import _config, _row

pytestmark = pytest.mark.ray


class Trainer:
    """A toy trainer: each step takes 2 groups, then moves the policy version on."""

    async def train(self, config: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
        import gym_ray

        tasks: list[int] = []
        versions: list[tuple[int, int]] = []
        async with gym_ray.stream(rows, config=config, group_size=2, num_workers=2, max_staleness=1) as s:
            while batch := await s.next_batch(2):
                tasks += [group.task_index for group in batch]
                versions += [(group.oldest_version, group.newest_version) for group in batch]
                await s.pause("drain")
                await s.set_policy_version(s.policy_version + 1)
                await s.resume()
            stats = s.stats()
        return {"tasks": sorted(tasks), "versions": versions, "delivered": stats.delivered}


async def test_a_trainer_actor_owns_a_stream(ray_session: Any) -> None:
    trainer = ray_session.remote(num_cpus=0)(Trainer).remote()
    try:
        async with serve_config(_config()) as servers:
            out = await trainer.train.remote(servers.config, [_row(i) for i in range(6)])
    finally:
        ray_session.kill(trainer)
    assert out["tasks"] == [0, 1, 2, 3, 4, 5]
    assert out["delivered"] == 12
    assert all(new - old <= 1 for old, new in out["versions"])
