"""Ray plumbing with injected shard functions (no servers): failures cross actors typed, dead workers are
replaced and their shards re-run elsewhere, every shard completes exactly once."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.run_config import RunConfig
from gym_ray.dispatch.client import ServerClient
from gym_ray.distributed.api import RunActors, run_actors
from gym_ray.errors import ShardIOError
from gym_ray.run.collect import RunPlan, ShardSpec
from gym_ray.run.result import RunResult, ShardReport

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

RUN = RunConfig.from_dict({"max_resident_tasks": 8})


def fake_plan(run_dir: str, count: int) -> Iterator[ShardSpec]:
    for index in range(count):
        yield ShardSpec(run_dir=run_dir, shard=f"{index:05d}", run_id="r1", config_identity=None, num_rows=5)


async def fake_shard(
    spec: ShardSpec,
    *,
    client: ServerClient,
    run: RunConfig,
    semaphore: asyncio.Semaphore | None = None,
    on_outcome: Any = None,
    worker: str | None = None,
    die_on: str | None = None,
    fail_on: str | None = None,
) -> ShardReport:
    """Writes a marker per completed shard; dies (once) or raises on the named shard.

    Like resume, a shard whose marker is already written runs nothing again: a worker may finish a shard
    and die before its report reaches the driver, which then gives the shard to another worker.
    """
    root = Path(spec.run_dir)
    if spec.shard == die_on and not (root / f"died-{spec.shard}").exists():
        (root / f"died-{spec.shard}").write_text(str(os.getpid()))
        os._exit(1)
    if spec.shard == fail_on:
        raise ShardIOError(f"shard {spec.shard}: fsync failed (disk full); free space and resume")
    finished = await asyncio.to_thread(lambda: any(root.glob(f"done-{spec.shard}-*")))
    already = spec.num_rows if finished else 0
    if not already:
        await asyncio.sleep(0.02)
        (root / f"done-{spec.shard}-{worker}").write_text("")
    return ShardReport(
        shard=spec.shard,
        planned=spec.num_rows,
        already_done=already,
        dispatched=spec.num_rows - already,
        succeeded=spec.num_rows,
        failed=0,
        failed_by_class={},
        omitted=0,
        wall_s=0.02,
        worker=worker,
    )


async def fake_finalize(
    plan: RunPlan,
    reports: Iterable[ShardReport],
    *,
    run: RunConfig,
    client: ServerClient,
    wall_s: float,
    num_workers: int = 1,
    counts_from_reports: bool = False,
) -> RunResult:
    reports = list(reports)
    summary = Path(plan.run_dir) / "rollouts_summary.json"
    summary.write_text("{}")
    return RunResult(
        run_dir=plan.run_dir,
        run_id=plan.run_id,
        rollouts_path="",
        failures_path="",
        metrics_path=None,
        summary_path=str(summary),
        planned=plan.planned,
        succeeded=sum(r.succeeded for r in reports),
        failed=0,
        failed_by_class={},
        omitted=0,
        dispatched=sum(r.dispatched for r in reports),
        already_done=0,
        wall_s=wall_s,
        rollouts_per_s=0.0,
        num_workers=num_workers,
        key_metrics={},
        aggregation_errors={},
        pending=0,
        failure_attempts=0,
        resumable=0,
        complete=True,
    )


def _completed(run_dir: Path) -> list[str]:
    return sorted(p.name.split("-")[1] for p in run_dir.glob("done-*"))


async def test_every_shard_runs_exactly_once_across_four_workers(ray_session: Any, tmp_path: Path) -> None:
    result = await run_actors(
        RUN,
        functools.partial(fake_plan, str(tmp_path), 12),
        run_dir=str(tmp_path),
        num_workers=4,
        shard_fn=fake_shard,
        finalize_fn=fake_finalize,
    )
    assert _completed(tmp_path) == [f"{i:05d}" for i in range(12)]
    assert (result.planned, result.succeeded, result.num_workers) == (60, 60, 4)


async def test_a_worker_that_dies_is_replaced_and_its_shard_reruns(ray_session: Any, tmp_path: Path) -> None:
    seen: list[RunActors] = []
    result = await run_actors(
        RUN,
        functools.partial(fake_plan, str(tmp_path), 8),
        run_dir=str(tmp_path),
        num_workers=2,
        shard_fn=functools.partial(fake_shard, die_on="00003"),
        finalize_fn=fake_finalize,
        on_started=seen.append,
    )
    actors = seen[0]
    assert _completed(tmp_path) == [f"{i:05d}" for i in range(8)]
    assert len(actors.lost) == 1
    assert sorted(actors.workers) == ["w0", "w1", "w2"]  # w2 replaced the dead one
    assert result.succeeded == 40


async def test_a_shard_error_crosses_the_actors_typed(ray_session: Any, tmp_path: Path) -> None:
    with pytest.raises(ShardIOError, match="shard 00001: fsync failed"):
        await run_actors(
            RUN,
            functools.partial(fake_plan, str(tmp_path), 6),
            run_dir=str(tmp_path),
            num_workers=2,
            shard_fn=functools.partial(fake_shard, fail_on="00001"),
            finalize_fn=fake_finalize,
        )
    assert "00001" not in _completed(tmp_path)
