"""ShardDriver hand-out logic, in one event loop (no Ray): pull order, waiting, loss, failures, lookahead."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.distributed.driver import ShardDriver, ShardFailure, driver_max_concurrency
from gym_ray.errors import (
    InputError,
    InternalError,
    NoProgressError,
    RecordError,
    ShardIOError,
    ShardLockError,
)
from gym_ray.plan.run_manifest import RUN_MANIFEST
from gym_ray.plan.shards import iter_plan
from gym_ray.record.shard_files import shard_paths
from gym_ray.run.collect import ShardSpec

# Each test takes well under a second; a driver bug that never wakes a waiter (a mutant under
# scripts/mutation.py) fails here instead of hanging for the suite's 120 s (30 s leaves room for a
# loaded CI machine).
pytestmark = pytest.mark.timeout(30)


def _specs(count: int, pulled: list[str] | None = None) -> Iterator[ShardSpec]:
    for index in range(count):
        label = f"{index:05d}"
        if pulled is not None:
            pulled.append(label)
        yield ShardSpec(run_dir="/unused", shard=label, run_id="r1", config_identity=None, num_rows=10)


async def _settle() -> None:
    # Let the planner task (which steps through a thread) make all the progress it can.
    for _ in range(50):
        await asyncio.sleep(0.005)


async def test_shards_are_handed_out_in_plan_order_and_none_after_the_last_completes() -> None:
    driver = ShardDriver(lambda: _specs(3), lookahead=4)
    got = [await driver.next_shard("w0"), await driver.next_shard("w1"), await driver.next_shard("w0")]
    assert [spec.shard for spec in got if spec is not None] == ["00000", "00001", "00002"]
    waiting = asyncio.ensure_future(driver.next_shard("w1"))
    await _settle()
    assert not waiting.done()  # shards are in flight elsewhere: w1 waits (their worker might die)
    for worker, spec in zip(["w0", "w1", "w0"], got, strict=True):
        assert spec is not None
        assert await driver.shard_finished(worker, spec.shard) is True
    assert await waiting is None
    status = await driver.status()
    assert (status.completed, status.planned_rows, status.finished, status.plan_done) == (3, 30, True, True)
    assert status.assignments == {"w0": ("00000", "00002"), "w1": ("00001",)}
    await driver.close()


async def test_a_lost_workers_shards_go_back_to_the_front_and_the_lost_worker_gets_none() -> None:
    driver = ShardDriver(lambda: _specs(4), lookahead=4)
    first = await driver.next_shard("w0")
    second = await driver.next_shard("w0")
    assert (first and first.shard, second and second.shard) == ("00000", "00001")
    assert await driver.worker_lost("w0") == ["00000", "00001"]
    assert await driver.next_shard("w0") is None
    taken = [await driver.next_shard("w1") for _ in range(4)]
    assert [spec.shard for spec in taken if spec is not None] == ["00000", "00001", "00002", "00003"]
    # A late completion from the dead worker does not count.
    assert await driver.shard_finished("w0", "00000") is False
    status = await driver.status()
    assert (status.requeued_total, status.lost_workers, status.in_flight) == (
        2,
        ("w0",),
        {"w1": ("00000", "00001", "00002", "00003")},
    )
    await driver.close()


async def test_a_retired_worker_keeps_its_shards_and_gets_none_and_its_waiting_lane_is_released() -> None:
    driver = ShardDriver(lambda: _specs(3), lookahead=4)
    held = [await driver.next_shard("w0"), await driver.next_shard("w1")]
    assert [spec.shard for spec in held if spec is not None] == ["00000", "00001"]
    await driver.retire("w0")
    assert await driver.next_shard("w0") is None
    third = await driver.next_shard("w1")
    assert third is not None
    assert third.shard == "00002"
    waiting = asyncio.ensure_future(driver.next_shard("w1"))  # nothing queued: w1's second lane waits
    await _settle()
    assert not waiting.done()
    status = await driver.status()
    assert (status.requeued_total, status.in_flight) == (0, {"w0": ("00000",), "w1": ("00001", "00002")})
    for worker, shard in (("w0", "00000"), ("w1", "00001"), ("w1", "00002")):
        assert await driver.shard_finished(worker, shard) is True  # the retired worker's completion counts
    assert await waiting is None
    assert (await driver.status()).finished is True
    await driver.close()


async def test_retiring_a_worker_releases_its_waiting_lane() -> None:
    driver = ShardDriver(lambda: _specs(1), lookahead=2)
    assert (await driver.next_shard("w1")) is not None
    waiting = asyncio.ensure_future(driver.next_shard("w0"))
    await _settle()
    assert not waiting.done()
    await driver.retire("w0")
    assert await waiting is None
    await driver.close()


async def test_a_waiting_worker_takes_over_a_dead_workers_shard() -> None:
    driver = ShardDriver(lambda: _specs(1), lookahead=2)
    spec = await driver.next_shard("w0")
    assert spec is not None
    waiting = asyncio.ensure_future(driver.next_shard("w1"))
    await _settle()
    assert not waiting.done()
    await driver.worker_lost("w0")
    taken = await waiting
    assert taken == spec
    assert await driver.shard_finished("w1", spec.shard) is True
    assert await driver.next_shard("w1") is None
    await driver.close()


async def test_planning_stays_at_most_lookahead_shards_ahead_of_the_hand_out() -> None:
    pulled: list[str] = []
    driver = ShardDriver(lambda: _specs(100, pulled), lookahead=3)
    await driver.start()
    await _settle()
    assert len(pulled) == 3
    await driver.next_shard("w0")
    await _settle()
    assert len(pulled) == 4
    await driver.close()
    assert len(pulled) == 4


async def test_a_planning_error_is_kept_and_stops_the_hand_out(caplog: pytest.LogCaptureFixture) -> None:
    def planner() -> Iterator[ShardSpec]:
        yield from _specs(1)
        raise InputError("rows.jsonl line 7: not JSON; fix the line", path="rows.jsonl", line=7)

    driver = ShardDriver(planner, lookahead=1)
    caplog.set_level(logging.INFO, logger=driver_logger)
    first = await driver.next_shard("w0")
    assert first is not None
    await _settle()
    assert await driver.next_shard("w1") is None
    status = await driver.status()
    assert isinstance(status.plan_error, InputError)
    assert (status.plan_error.line, status.finished) == (7, True)
    await driver.close()
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == driver_logger] == [
        ("ERROR", "driver: planning failed: rows.jsonl line 7: not JSON; fix the line")
    ]


def _lazy_planner(run_dir: Path, consumed: list[int]) -> Any:
    """iter_plan over 100 rows in shards of 10, streamed: it cuts one shard per step."""

    def rows() -> Iterator[dict[str, Any]]:
        for task in range(100):
            consumed.append(task)
            yield {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: 0}

    return functools.partial(iter_plan, rows(), run_dir, config_identity=None, shard_size=10)


async def test_stop_planning_returns_once_the_lazy_planner_is_closed(tmp_path: Path) -> None:
    consumed: list[int] = []
    driver = ShardDriver(_lazy_planner(tmp_path, consumed), lookahead=1)
    assert (await driver.next_shard("w0")) is not None
    await driver.stop_planning()
    # joined: the planner was closed before stop_planning returned (staging folder gone, no more rows read)
    assert _leftovers(tmp_path) == ([], None)
    read = len(consumed)
    await _settle()
    assert len(consumed) == read
    await driver.close()


async def test_a_lazy_planner_stopped_by_an_error_is_closed_at_once(tmp_path: Path) -> None:
    """The error kept as ``plan_error`` holds the planning frame (its traceback), so the planner is not
    freed; it is closed all the same once planning is joined: its staging folder goes now, not when the
    driver is dropped."""

    async def on_planned(spec: ShardSpec | None) -> None:
        raise RecordError("the coordinator could not record shard 00000")

    driver = ShardDriver(_lazy_planner(tmp_path, []), lookahead=1, on_planned=on_planned)
    status = await driver.wait_finished()
    assert str(status.plan_error) == "the coordinator could not record shard 00000"
    await driver.stop_planning()
    assert _leftovers(tmp_path) == ([], None)
    await driver.close()


async def test_a_planner_that_returns_a_list_hands_out_every_shard_and_closes_cleanly() -> None:
    driver = ShardDriver(lambda: list(_specs(2)), lookahead=1)
    for _ in range(2):
        spec = await driver.next_shard("w0")
        assert spec is not None
        assert await driver.shard_finished("w0", spec.shard) is True
    status = await driver.wait_finished()
    assert (status.completed, status.plan_done, status.plan_error) == (2, True, None)
    await driver.close()  # a list's iterator has no close(): nothing to close, nothing raised


@pytest.mark.parametrize(
    ("worker", "error_type", "aborts"),
    [
        pytest.param("w0", ShardIOError.__name__, True, id="io-error-from-owner-aborts"),
        pytest.param("w0", ShardLockError.__name__, True, id="lock-error-from-owner-aborts"),
        pytest.param("w9", ShardLockError.__name__, False, id="lock-error-from-superseded-worker-ignored"),
        pytest.param("w9", NoProgressError.__name__, False, id="stall-of-superseded-worker-ignored"),
        pytest.param("w9", ShardIOError.__name__, False, id="io-error-of-superseded-worker-ignored"),
    ],
)
async def test_shard_failures(
    worker: str, error_type: str, aborts: bool, caplog: pytest.LogCaptureFixture
) -> None:
    driver = ShardDriver(lambda: _specs(3), lookahead=3)
    spec = await driver.next_shard("w0")
    assert spec is not None
    failure = ShardFailure(shard=spec.shard, worker=worker, error_type=error_type, message="boom")
    with caplog.at_level(logging.INFO, logger="gym_ray.distributed.driver"):
        assert await driver.shard_failed(failure) is aborts
    status = await driver.status()
    assert (status.failures, status.finished) == (((failure,), True) if aborts else ((), False))
    assert status.in_flight == ({} if aborts else {"w0": ("00000",)})
    if aborts:
        expected = ("ERROR", "driver: shard 00000 failed in w0: boom")
    else:
        # a superseded worker's lock error is the expected end of a zombie: info, anything else a warning
        level = "INFO" if error_type == ShardLockError.__name__ else "WARNING"
        expected = (
            level,
            f"driver: ignoring {error_type} of shard 00000 from w9, which no longer holds it (holder now: "
            "w0): boom",
        )
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == driver_logger] == [expected]
    assert (await driver.next_shard("w1") is None) is aborts
    await driver.close()


driver_logger = "gym_ray.distributed.driver"


async def test_a_failure_of_a_shard_nobody_holds_names_no_holder(caplog: pytest.LogCaptureFixture) -> None:
    driver = ShardDriver(lambda: _specs(1), lookahead=1)
    spec = await driver.next_shard("w0")
    assert spec is not None
    assert await driver.shard_finished("w0", spec.shard) is True
    failure = ShardFailure(shard=spec.shard, worker="w0", error_type="ShardIOError", message="late")
    with caplog.at_level(logging.INFO, logger=driver_logger):
        assert await driver.shard_failed(failure) is False
        assert await driver.shard_finished("w1", spec.shard) is False
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == driver_logger] == [
        (
            "WARNING",
            "driver: ignoring ShardIOError of shard 00000 from w0, which no longer holds it (holder now: "
            "none, re-queued or complete): late",
        ),
        ("WARNING", "driver: ignoring completion of shard 00000 by w1 (not its owner)"),
    ]
    await driver.close()


async def test_status_counts_the_queue_the_holders_and_every_requeue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = ShardDriver(lambda: _specs(5), lookahead=5)
    held = [await driver.next_shard(w) for w in ("w0", "w0", "w1", "w1", "w1")]
    assert [spec.shard for spec in held if spec is not None] == ["00000", "00001", "00002", "00003", "00004"]
    assert await driver.shard_finished("w0", "00000") is True
    with caplog.at_level(logging.INFO, logger=driver_logger):
        assert await driver.worker_lost("w0") == ["00001"]
        assert await driver.worker_lost("w1") == ["00002", "00003", "00004"]
        assert await driver.worker_lost("never-seen") == []
    status = await driver.status()
    assert (status.queued, status.requeued_total, status.completed, status.in_flight) == (4, 4, 1, {})
    assert status.lost_workers == ("never-seen", "w0", "w1")
    assert [r.getMessage() for r in caplog.records if r.name == driver_logger] == [
        "driver: worker w0 lost; re-queued shards 00001",
        "driver: worker w1 lost; re-queued shards 00002, 00003, 00004",
    ]
    assert [(await driver.next_shard("w2")) is not None for _ in range(4)] == [True] * 4
    assert (await driver.status()).in_flight == {"w2": ("00001", "00002", "00003", "00004")}
    await driver.close()


async def test_a_lazy_plan_hands_out_shard_0_before_the_input_is_cut_and_is_closed_on_close(
    tmp_path: Path,
) -> None:
    consumed: list[int] = []

    def rows() -> Iterator[dict[str, Any]]:
        for task in range(100):
            consumed.append(task)
            yield {keys.TASK_INDEX: task, keys.ROLLOUT_INDEX: 0}

    planner = functools.partial(iter_plan, rows(), tmp_path, config_identity=None, shard_size=10)
    driver = ShardDriver(planner, lookahead=1)
    first = await driver.next_shard("w0")
    assert first is not None
    assert (first.shard, first.num_rows) == ("00000", 10)
    assert shard_paths(tmp_path, "00000").materialized_inputs.exists()
    await _settle()
    assert len(consumed) < 40  # at most lookahead shards are cut ahead of the hand-out
    assert not shard_paths(tmp_path, "00009").materialized_inputs.exists()
    await driver.close()
    # the unfinished planner was closed: its staging folder is gone, the run manifest not completed
    assert _leftovers(tmp_path) == ([], None)


def _leftovers(run_dir: Path) -> tuple[list[str], Any]:
    """(staging folders left in ``run_dir``, the run manifest's ``num_shards``)."""
    staging = [p.name for p in run_dir.iterdir() if p.name.startswith(".staging")]
    return staging, json.loads((run_dir / RUN_MANIFEST).read_text(encoding="utf-8"))["num_shards"]


def test_the_actor_concurrency_lets_every_worker_lane_wait_at_once() -> None:
    # two waits per lane (a lane may ask again while its last answer is in flight) plus 16 spare
    assert [driver_max_concurrency(1, 1), driver_max_concurrency(3, 2), driver_max_concurrency(10, 4)] == [
        18,
        28,
        96,
    ]


def test_a_lookahead_below_one_is_refused() -> None:
    with pytest.raises(InternalError, match=r"^driver lookahead must be >= 1, got 0$"):
        ShardDriver(lambda: _specs(1), lookahead=0)


async def test_an_untyped_planning_error_is_kept_as_an_internal_error_and_stops_the_hand_out() -> None:
    def planner() -> Iterator[ShardSpec]:
        yield from _specs(1)
        raise ValueError("boom")

    driver = ShardDriver(planner, lookahead=1)
    assert (await driver.next_shard("w0")) is not None
    status = await driver.wait_finished()
    assert isinstance(status.plan_error, InternalError)
    assert str(status.plan_error) == "planning failed: ValueError: boom"
    assert (status.finished, status.plan_done, status.planned_shards) == (True, False, 1)
    assert await driver.next_shard("w1") is None
    with contextlib.suppress(ValueError):  # joining the planner task may re-raise its error
        await driver.close()


class _Coordinator:
    """Records what the driver reports about planning (the coordinator's ``plan_progress``)."""

    def __init__(self) -> None:
        self.reported: list[str | None] = []

    async def plan_progress(self, spec: ShardSpec | None) -> None:
        self.reported.append(None if spec is None else spec.shard)


async def test_the_coordinator_hears_of_each_planned_shard_then_the_end_of_the_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    coordinator = _Coordinator()
    driver = ShardDriver(lambda: _specs(3), lookahead=5, on_planned=coordinator.plan_progress)
    caplog.set_level(logging.INFO, logger="gym_ray.distributed.driver")
    await driver.start()
    for _ in range(3):
        spec = await driver.next_shard("w0")
        assert spec is not None
        await driver.shard_finished("w0", spec.shard)
    status = await driver.wait_finished()
    assert (status.planned_shards, status.planned_rows, status.completed, status.plan_done) == (
        3,
        30,
        3,
        True,
    )
    await driver.close()
    assert coordinator.reported == ["00000", "00001", "00002", None]
    assert [r.getMessage() for r in caplog.records if r.name == "gym_ray.distributed.driver"] == [
        "driver: plan complete, 3 shards, 30 rows"
    ]


async def test_a_shard_report_is_counted_once_with_its_accepted_completion() -> None:
    # The run host counts a worker's report inside `accepted`: only for the completion the driver takes,
    # so a shard re-run after its worker was lost is counted once (the re-run's report), never twice.
    driver = ShardDriver(lambda: _specs(1), lookahead=2)
    counted: list[str] = []
    first = await driver.next_shard("w0")
    assert first is not None
    assert await driver.worker_lost("w0") == ["00000"]
    late = await driver.shard_finished("w0", "00000", accepted=lambda: counted.append("w0"))
    assert (late, counted) == (False, [])
    again = await driver.next_shard("w1")
    assert again is not None
    done = await driver.shard_finished("w1", "00000", accepted=lambda: counted.append("w1"))
    assert (done, counted) == (True, ["w1"])
    status = await driver.wait_finished()
    assert (status.completed, status.requeued_total) == (1, 1)
    await driver.close()


def test_a_planner_cancelled_during_a_step_is_not_closed_under_that_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The actor's loop shutting down cancels the planner task while a planning step runs in its thread:
    the planner is then left to finish that step (closing an executing generator raises), nothing logged."""
    stepping, release = threading.Event(), threading.Event()
    steps: list[str] = []

    def planner() -> Iterator[ShardSpec]:
        yield from _specs(1)
        stepping.set()
        steps.append("released" if release.wait(30) else "timed out")
        yield from _specs(1)

    async def serve() -> None:
        driver = ShardDriver(planner, lookahead=5)
        await driver.start()
        await asyncio.to_thread(stepping.wait, 30)
        # returning leaves the planner task mid-step: asyncio.run cancels it, then waits for the
        # step's thread, which this releases
        asyncio.get_running_loop().call_later(0.05, release.set)

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        asyncio.run(serve())
    assert steps == ["released"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
