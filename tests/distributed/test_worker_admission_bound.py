"""``max_resident_tasks`` bounds the rollouts in flight per worker, whatever number of shards the worker runs
at once (RELIABILITY.md R2, on the distributed run).

``max_resident_tasks`` is documented as "rollouts in flight per worker (admission bound)"
(``RunSettings``), and a worker's shard lanes share one admission semaphore of that size
(``gym_ray.distributed.worker``). So ``num_workers`` workers, each running two shards at once, never have
more than ``num_workers * max_resident_tasks`` ``/run`` requests open at the environment server.

The server holds every ``/run`` until it holds that many at once and every lane of every worker has opened
its shard (so is sending), then answers each request after 200 ms. Nothing finishes before then, so each
lane holds one shard and the bound is reached whatever the machine's speed; a worker whose lanes together
send more than ``max_resident_tasks`` puts its extra requests at the server while the others are held.
``max_connections`` is set above the bound so that the HTTP pool's own limit cannot hide a window that is
too wide.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gym_ray.distributed.api import acollect
from gym_ray.servers import serve_config
from gym_ray.servers.example_env import ExampleEnvServer
from tests.dispatch.test_contracts import _config
from tests.summaries import workers_that_dispatched

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

WORKERS = 2
LANES = 2  # shards each worker runs at once (gym_ray.distributed.worker.DEFAULT_SHARDS_IN_FLIGHT)
RESIDENT = 3  # max_resident_tasks: one shard's worth of rows


def _rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "responses_create_params": {"input": f"What is {i} + 1?"},
            "expected_answer": str(i + 1),
            "agent_ref": {"name": "agent"},
            "row_number": i,  # distinct rows, distinct tasks
        }
        for i in range(count)
    ]


def _lane_writers(run_dir: Path) -> dict[str, int]:
    """Lock file -> pid of the writer that opened its shard (its token); a shard not opened yet has none."""
    opened = {}
    for lock in run_dir.glob("rollouts-*.lock"):
        try:
            token = json.loads(lock.read_bytes())
        except ValueError:  # empty (planned only) or being written
            continue
        opened[lock.name] = token["pid"]
    return opened


async def test_servers_see_at_most_max_resident_tasks_per_worker_with_parallel_shards(
    ray_session: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = WORKERS * RESIDENT
    rows = 2 * WORKERS * LANES * RESIDENT  # 8 shards of RESIDENT rows for the 4 lanes
    run_dir = tmp_path / "run"
    async with serve_config(_config(latency_ms=200)) as dep:
        env = dep.servers["env"]
        assert isinstance(env, ExampleEnvServer)
        solve = env.solve
        gate = asyncio.Event()

        async def gated(row: Any, key: Any, *, where: str) -> dict[str, Any]:
            await gate.wait()
            return await solve(row, key, where=where)

        async def open_gate() -> None:
            # Nothing finishes before the gate opens, so each lane holds one shard: the gate opens once the
            # server holds `bound` requests and every lane of every worker has opened its shard (is sending).
            while True:
                writers = _lane_writers(run_dir)
                lanes_sending = len(writers) == WORKERS * LANES and len(set(writers.values())) == WORKERS
                if env.stats.in_flight >= bound and lanes_sending:
                    gate.set()
                    return
                await asyncio.sleep(0.01)  # polls the server's counter and the run folder

        monkeypatch.setattr(env, "solve", gated)
        async with asyncio.timeout(90), asyncio.TaskGroup() as tasks:  # a narrower window never opens it
            tasks.create_task(open_gate())
            result = await acollect(
                dep.config,
                rows=_rows(rows),
                output_dir=str(run_dir),
                num_workers=WORKERS,
                shard_size=RESIDENT,
                max_resident_tasks=RESIDENT,
                max_connections=4 * bound,
                progress=False,
            )
        stats = dep.stats("env")
    assert (result.planned, result.succeeded, result.failed) == (rows, rows, 0)
    assert (stats.requests, stats.completed) == (rows, rows)
    assert stats.max_in_flight == bound
    assert workers_that_dispatched(result.summary_path) == {f"w{i}" for i in range(WORKERS)}
