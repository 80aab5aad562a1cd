"""``gym-ray status`` on a live run: a running shard rewrites its progress file as it goes, so the rate
and ETA status reads are computed from counts and a timestamp that describe the same moment (not from
the lines on disk now divided by the time of the last *finished* shard). The shard runs while this process
holds the folder's run lock, as a run does: status gives a rate and an ETA only while the run is running."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import resolve_run_config
from gym_ray.plan.shards import prepare_run
from gym_ray.record.run_lock import RunLock
from gym_ray.record.status import run_status
from gym_ray.run import collect
from gym_ray.servers import Deployment, calc_config, calc_rows, serve_config

ROWS = 6


def _config() -> dict[str, Any]:
    return calc_config(seed=3, latency_ms=0)


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    async with serve_config(_config()) as dep:
        yield dep


async def test_status_of_a_running_shard_reads_its_fresh_progress_file(
    deployment: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collect, "PROGRESS_FILE_INTERVAL_S", 0.0)  # rewrite after every record
    rows = calc_rows(ROWS)
    run = await resolve_run_config(
        deployment.config, settings={"output_dir": str(tmp_path / "run"), "max_resident_tasks": 1}
    )
    plan = prepare_run(run, rows=rows)
    (spec,) = plan.shards
    seen: list[tuple[int | None, int, float | None, float | None, float | None, float | None]] = []

    def look(row: dict[str, Any], record: dict[str, Any]) -> None:
        status = run_status(plan.run_dir)  # mid-run, as `gym-ray status` would
        (shard,) = status.shards
        seen.append(
            (
                shard.progress_attempts,
                status.pending,
                status.rate_per_s,
                status.eta_s,
                shard.updated_at,
                shard.created_at,
            )
        )

    with RunLock(plan.run_dir, what="collect"):
        async with collect.client_for(run) as client:
            report = await collect.run_shard(spec, client=client, run=run, on_outcome=look)
        final = run_status(plan.run_dir)
    assert report.succeeded == ROWS

    # At the k-th outcome (1-based) its record is on disk, and the progress file holds the k - 1 before it.
    assert [attempts for attempts, *_ in seen] == [None, *range(1, ROWS)]
    assert [pending for _, pending, *_ in seen] == [ROWS - k for k in range(1, ROWS + 1)]
    assert seen[0][2:4] == (None, None)  # no progress file yet: no rate
    for attempts, pending, rate, eta, updated_at, created_at in seen[1:]:
        assert updated_at is not None
        assert created_at is not None
        assert rate == pytest.approx(attempts / (updated_at - created_at))  # attempts == k - 1
        assert eta == pytest.approx(pending / rate)  # type: ignore[operator]
    assert (final.state, final.shards[0].progress_attempts, final.pending, final.eta_s) == (
        "running",
        ROWS,
        0,
        0.0,
    )
    after = run_status(plan.run_dir)  # the lock is free and no state file says how the run ended
    assert (after.state, after.rate_per_s, after.eta_s) == ("unknown", None, None)
