"""R18: a worker frozen (SIGSTOP) while its shard is handed to another worker, then resumed (SIGCONT).

The frozen worker is a zombie: alive, holding open files, with rollouts in flight. Its shard is re-queued
(``worker_lost``, as when its node stops answering) and taken over by the other worker, which finishes the
run. Once resumed, the zombie's next write to the shard raises ``ShardLockError`` naming the new holder and
adds nothing: every line of the shard belongs to exactly one writer's period, and the ledger is all 0.

Deterministic by construction: the test holds the shard's lock (the same ``flock`` the writers take)
while it checks that the worker holds the shard with work left and while it freezes the worker, so the
worker cannot finish the shard in between; it waits on the driver's status, never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.run_config import resolve_run_config
from gym_ray.distributed.api import RunActors, plan_from_config, run_actors
from gym_ray.distributed.driver import DriverStatus
from gym_ray.errors import ShardLockError
from gym_ray.plan.resume import plan_resume
from gym_ray.record.ledger import check_run
from gym_ray.record.shard_files import shard_paths
from gym_ray.servers import load_bundled_config, start_in_thread
from tests.chaos.test_worker_kill import ENVS, _rows

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

POLL_S = 0.02
WAIT_S = 120.0


async def _until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds (the deadline only turns a hang into a failure naming ``what``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(POLL_S)


def _state(pid: int) -> str:
    """The process state letter from /proc (``T`` = stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _identities(path: Path) -> list[tuple[int, int]]:
    return [
        (record[keys.TASK_INDEX], record[keys.ROLLOUT_INDEX])
        for record in (json.loads(line) for line in path.read_bytes().splitlines())
    ]


@contextlib.contextmanager
def _lock_fd(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)  # closing the descriptor also releases a flock still held through it


async def _freeze_mid_shard(
    driver: Any, pid: int, run_dir: Path, lock: contextlib.ExitStack
) -> tuple[str, bytes, bytes]:
    """SIGSTOP worker w1 while it holds a shard it has written to and not finished; keep that shard locked.

    With the shard's lock held here, w1 can neither append to the shard nor finish it (writing its
    progress takes the lock too), so what is checked under the lock still holds once w1 is frozen.

    Returns:
        The shard, and its successes and failures files as w1 left them.
    """
    caught: list[tuple[str, bytes, bytes]] = []

    async def try_once() -> bool:
        status: DriverStatus = await driver.status.remote()
        for shard in status.in_flight.get("w1", ()):
            paths = shard_paths(run_dir, shard)
            if not paths.successes.exists() or paths.successes.stat().st_size == 0:
                continue
            fd = lock.enter_context(_lock_fd(paths.lock))
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            now: DriverStatus = await driver.status.remote()
            if shard in now.in_flight.get("w1", ()) and plan_resume(run_dir, shard).pending_count > 0:
                os.kill(pid, signal.SIGSTOP)
                caught.append((shard, paths.successes.read_bytes(), paths.failures.read_bytes()))
                return True
            lock.close()  # w1 finished it meanwhile: release it and try another shard
        return False

    await _until("w1 to hold a shard it has written to", try_once)
    return caught[0]


async def test_a_frozen_worker_whose_shard_was_taken_over_fails_its_next_write(
    ray_session: Any, tmp_path: Path
) -> None:
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
        run = asyncio.ensure_future(
            run_actors(
                run_cfg,
                functools.partial(plan_from_config, run_cfg, ray_session.put(_rows(150))),
                run_dir=str(tmp_path),
                num_workers=2,
                on_started=started.append,
            )
        )

        async def actors_started() -> bool:
            return bool(started)

        await _until("the actors to start", actors_started)
        actors = started[0]
        driver, zombie = actors.driver, actors.workers["w1"]
        zombie_pid, holder_pid = await asyncio.gather(zombie.pid.remote(), actors.workers["w0"].pid.remote())
        lock = contextlib.ExitStack()
        try:
            shard, zombie_successes, zombie_failures = await _freeze_mid_shard(
                driver, zombie_pid, tmp_path, lock
            )

            async def stopped() -> bool:
                return _state(zombie_pid) == "T"

            await _until("w1 to stop", stopped)
            requeued = await driver.worker_lost.remote("w1")
            assert shard in requeued
            lock.close()  # release the lock: w0 takes the shard over, and the rest of the run

            async def run_complete_without_w1() -> bool:
                status: DriverStatus = await driver.status.remote()
                assert status.failures == ()
                return status.finished and shard in status.assignments.get("w0", ())

            await _until("w0 to finish the re-queued shard and the run", run_complete_without_w1)
        finally:
            lock.close()
            os.kill(zombie_pid, signal.SIGCONT)
        result = await run
        counts: dict[tuple[int, int], int] = {}
        for env in ENVS:
            for identity, n in servers.stats(env).request_counts.items():
                key = (int(identity[0]), int(identity[1]))
                counts[key] = counts.get(key, 0) + n

    # The zombie's next write to the shard was refused, naming the shard and its new holder.
    zombie_totals = actors.totals["w1"]
    refused = [f for f in zombie_totals.failures if f.shard == shard]
    assert [f.error_type for f in refused] == [ShardLockError.__name__]
    error = refused[0].error
    assert isinstance(error, ShardLockError)
    assert (error.shard, error.holder_pid) == (shard, holder_pid)
    # Every line of the shard parses and belongs to one period: the zombie's lines as they were when it
    # froze, then the holder's, each identity once (a zombie line after the takeover would repeat one).
    paths = shard_paths(tmp_path, shard)
    for path, before in ((paths.successes, zombie_successes), (paths.failures, zombie_failures)):
        after = path.read_bytes()
        assert after.startswith(before)
        assert not set(_identities(path)[: before.count(b"\n")]) & set(
            _identities(path)[before.count(b"\n") :]
        )
    lines = _identities(paths.successes)
    assert len(lines) == len(set(lines))
    report = check_run(tmp_path, request_counts=counts)
    print(
        f"R18 worker SIGSTOP/SIGCONT: shard {shard} taken over; lost={report.lost} missing={report.missing} "
        f"duplicates={report.duplicates} wasted_requests={report.wasted_requests}"
    )
    assert (report.lost, report.missing, report.duplicates, report.unexpected) == (0, 0, 0, 0)
    assert (result.planned, result.succeeded + result.failed) == (300, 300)
