"""The worker's loop is ``run_shards``: per-shard error hook, injectable shard function; and the live
progress counters (per outcome in the worker, per finished shard in the coordinator), also across a
worker replacement on a real local Ray."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.run_config import RunConfig
from gym_ray.dispatch.client import ServerClient
from gym_ray.distributed.api import run_actors
from gym_ray.distributed.live import ProgressSnapshot
from gym_ray.distributed.worker import OutcomeTally
from gym_ray.errors import ShardIOError
from gym_ray.run.collect import OutcomeHook, RunPlan, ShardSpec, run_shards
from gym_ray.run.result import RunResult, ShardReport

RUN = RunConfig.from_dict({"max_resident_tasks": 4})
TOPOLOGY = RUN.topology
SERVERS = ("env_a", "env_b")


def _specs(run_dir: str, count: int, *, rows: int = 4) -> list[ShardSpec]:
    return [
        ShardSpec(
            run_dir=run_dir,
            shard=f"{i:05d}",
            run_id="r1",
            config_identity=None,
            num_rows=rows,
            run_rows=count * rows,
        )
        for i in range(count)
    ]


def _record(index: int) -> dict[str, Any]:
    """Row ``index``'s record: even rows succeed on env_a (reward 1.0) / env_b (0.5); every 4th+3 fails."""
    if index % 4 == 3:
        return {keys.FAILURE_CLASS: "agent_run_error"}
    return {keys.ENVIRONMENT_SERVER: SERVERS[index % 2], keys.REWARD: 1.0 if index % 2 == 0 else 0.5}


async def fake_shard(
    spec: ShardSpec,
    *,
    client: ServerClient,
    run: RunConfig,
    semaphore: asyncio.Semaphore | None = None,
    on_outcome: OutcomeHook | None = None,
    worker: str | None = None,
    fail_on: str | None = None,
    die_on: str | None = None,
    pause_s: float = 0.0,
    fail_after: int = 0,
) -> ShardReport:
    """Emits ``num_rows`` outcomes through ``on_outcome``; raises (after ``fail_after`` outcomes) on / dies
    once in the named shard."""
    marker = Path(spec.run_dir) / f"died-{spec.shard}"
    if spec.shard == die_on and not marker.exists():
        marker.write_text(str(os.getpid()))
        os._exit(1)
    failed = 0
    for index in range(spec.num_rows):
        if spec.shard == fail_on and index == fail_after:
            raise ShardIOError(f"shard {spec.shard}: fsync failed (disk full); free space and resume")
        await asyncio.sleep(pause_s)
        record = _record(index)
        failed += keys.FAILURE_CLASS in record
        if on_outcome is not None:
            on_outcome({}, record)
    return ShardReport(
        shard=spec.shard,
        planned=spec.num_rows,
        already_done=0,
        dispatched=spec.num_rows,
        succeeded=spec.num_rows - failed,
        failed=failed,
        failed_by_class={"agent_run_error": failed} if failed else {},
        omitted=0,
        wall_s=0.0,
        worker=worker,
    )


def _hand_out(specs: list[ShardSpec]) -> Any:
    queue = iter(specs)

    async def next_spec() -> ShardSpec | None:
        return next(queue, None)

    return next_spec


async def test_run_shards_with_on_error_keeps_the_other_lanes_going(tmp_path: Path) -> None:
    errors: list[tuple[str, str]] = []

    async def on_error(spec: ShardSpec, exc: Exception) -> None:
        errors.append((spec.shard, type(exc).__name__))

    async with ServerClient(TOPOLOGY) as client:
        reports = await run_shards(
            _hand_out(_specs(str(tmp_path), 6)),
            client=client,
            run=RUN,
            shard_fn=functools.partial(fake_shard, fail_on="00001"),
            on_error=on_error,
            worker="w9",
        )
    assert sorted(r.shard for r in reports) == ["00000", "00002", "00003", "00004", "00005"]
    assert {r.worker for r in reports} == {"w9"}
    assert errors == [("00001", "ShardIOError")]


async def test_run_shards_without_on_error_raises_the_first_error(tmp_path: Path) -> None:
    async with ServerClient(TOPOLOGY) as client:
        with pytest.raises(ShardIOError, match="shard 00002: fsync failed"):
            await run_shards(
                _hand_out(_specs(str(tmp_path), 6)),
                client=client,
                run=RUN,
                shard_fn=functools.partial(fake_shard, fail_on="00002"),
            )


def test_outcome_tally_counts_successes_by_server_with_reward_sums() -> None:
    tally = OutcomeTally()
    for index in range(8):
        tally.add(_record(index))
    tally.add({keys.FAILURE_CLASS: "cancelled", keys.NO_PERSIST: True})  # drained: not settled
    tally.add({keys.REWARD: True})  # no server, a bool is not a reward
    assert (tally.succeeded, tally.failed) == (7, 2)
    assert tally.servers() == {"env_a": (4, 4.0), "env_b": (2, 1.0), "?": (1, 0.0)}


def fake_plan(run_dir: str, count: int) -> Iterator[ShardSpec]:
    yield from _specs(run_dir, count)


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
        dispatched=0,
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


@pytest.mark.ray
@pytest.mark.timeout(120)
async def test_progress_is_absolute_and_exact_at_the_end_across_a_worker_replacement(
    ray_session: Any, tmp_path: Path
) -> None:
    snapshots: list[ProgressSnapshot] = []
    await run_actors(
        RUN,
        functools.partial(fake_plan, str(tmp_path), 10),
        run_dir=str(tmp_path),
        num_workers=2,
        shard_fn=functools.partial(fake_shard, die_on="00004", pause_s=0.03),
        finalize_fn=fake_finalize,
        on_progress=snapshots.append,
        progress_interval_s=0.05,
    )
    # 10 shards x 4 rows: per shard rows 0, 2 on env_a (1.0 each), row 1 on env_b (0.5), row 3 failed
    assert snapshots[-1] == ProgressSnapshot(
        total=40,
        done=40,
        failed=10,
        by_server={"env_a": (20, 20.0), "env_b": (10, 5.0)},
        failed_by_class={"agent_run_error": 10},
    )
    assert len(snapshots) >= 2
    assert all(s.total == 40 and 0 <= s.failed <= s.done <= 40 for s in snapshots)
    assert any(0 < s.done < 40 for s in snapshots[:-1])


@pytest.mark.ray
@pytest.mark.timeout(120)
async def test_the_last_snapshot_of_a_failed_run_counts_what_the_failed_shard_wrote(
    ray_session: Any, tmp_path: Path
) -> None:
    """Issue 30: a run stopped by a server outage ended its progress with "0/2400 (0.0%)" after 80 rows were
    written: a failed shard is never reported, and its worker's tally was dropped. Shard 00000 finishes
    (4 rows), shard 00001 writes 3 rows and fails, which ends the hand-out (00002 never runs)."""
    snapshots: list[ProgressSnapshot] = []
    with pytest.raises(ShardIOError, match="shard 00001: fsync failed"):
        await run_actors(
            RUN,
            functools.partial(fake_plan, str(tmp_path), 3),
            run_dir=str(tmp_path),
            num_workers=1,
            shards_in_flight=1,
            shard_fn=functools.partial(fake_shard, fail_on="00001", fail_after=3),
            finalize_fn=fake_finalize,
            on_progress=snapshots.append,
            progress_interval_s=60.0,
        )
    # 00000: rows 0, 2 on env_a (1.0 each), row 1 on env_b (0.5), row 3 failed; 00001: rows 0, 1, 2
    assert snapshots[-1] == ProgressSnapshot(
        total=12,
        done=7,
        failed=1,
        by_server={"env_a": (4, 4.0), "env_b": (2, 1.0)},
        failed_by_class={"agent_run_error": 1},
    )
