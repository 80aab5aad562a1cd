"""R3: SIGKILL a worker actor mid-run. The run completes (the dead worker's shards are re-queued and a
replacement takes over) and the ledger is clean: lost = 0, missing = 0, duplicates = 0."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.run_config import resolve_run_config
from gym_ray.distributed.api import RunActors, plan_from_config, run_actors
from gym_ray.record.ledger import check_run
from gym_ray.servers import bundled_dataset_path, load_bundled_config, start_in_thread
from tests.distributed.test_distributed import wait_for_completed

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

ENVS = ("arith_env", "arith_env_hard")


def _rows(count: int) -> list[dict[str, Any]]:
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()
    rows = []
    for index in range(count):
        row = json.loads(lines[index % len(lines)])
        row["row_number"] = index
        row[keys.AGENT_REF] = {"name": ("arith_agent", "arith_agent_hard")[index % 2]}
        rows.append(row)
    return rows


async def test_sigkill_of_a_worker_mid_run_loses_nothing(ray_session: Any, tmp_path: Path) -> None:
    cfg = load_bundled_config()
    for env in ENVS:
        cfg[env]["environment_servers"]["example_env"].update(latency_ms=40, latency_jitter_ms=20)
    started: list[RunActors] = []
    with start_in_thread(cfg) as servers:
        run_cfg = await resolve_run_config(
            servers.config,
            settings={
                "output_dir": str(tmp_path),
                "shard_size": 20,
                "max_resident_tasks": 8,
                "num_repeats": 2,
            },
        )
        rows_ref = ray_session.put(_rows(150))
        run = asyncio.ensure_future(
            run_actors(
                run_cfg,
                functools.partial(plan_from_config, run_cfg, rows_ref),
                run_dir=str(tmp_path),
                num_workers=3,
                on_started=started.append,
            )
        )
        await wait_for_completed(servers, ENVS, 60)
        victim = started[0].workers["w1"]
        pid = await victim.pid.remote()
        os.kill(pid, signal.SIGKILL)
        result = await run
        counts: dict[tuple[int, int], int] = {}
        for env in ENVS:
            for identity, n in servers.stats(env).request_counts.items():
                counts[(int(identity[0]), int(identity[1]))] = counts.get(identity, 0) + n
    actors = started[0]
    report = check_run(tmp_path, request_counts=counts)
    print(
        f"R3 worker SIGKILL: lost={report.lost} missing={report.missing} duplicates={report.duplicates} "
        f"wasted_requests={report.wasted_requests} replacements={len(actors.workers) - 3}"
    )
    assert actors.lost == ["w1"]
    assert (result.planned, result.succeeded + result.failed) == (300, 300)
    assert (report.lost, report.missing, report.duplicates, report.unexpected) == (0, 0, 0, 0)
    # every identity was recorded once, at attempt 0 (no failures): each request beyond its first was
    # wasted, so the figure is the requests the servers counted minus the 300 rollouts
    assert result.failed == 0
    assert report.wasted_requests == sum(counts.values()) - 300
