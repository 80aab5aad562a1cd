"""Planning runs in a worker thread, which cannot be cancelled: a cancelled caller (Ctrl-C, SIGTERM, a
notebook interrupt) sets a stop event that the pass checks every ``STOP_CHECK_ROWS`` rows, and waits for
the thread to end before the cancellation goes on, so the process exits at once instead of after the
whole pass. Real files, real threads."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from gym_ray.plan import first_pass, shards
from gym_ray.plan.first_pass import validate_ahead
from gym_ray.plan.load import STOP_CHECK_ROWS, Stopped, until_stopped
from gym_ray.plan.run_manifest import read_run_manifest
from gym_ray.plan.shards import prepare_run
from gym_ray.run._tasks import in_stoppable_thread
from tests.plan.test_common_rows import _config, _row


def _owned_folders() -> set[str]:
    tag = f"gym_ray-dedupe-{os.getpid()}@"
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(tag)}


def test_rows_stop_at_the_next_check_after_the_event_is_set() -> None:
    stop = threading.Event()
    seen: list[int] = []

    def read_all() -> None:
        for row in until_stopped(range(10 * STOP_CHECK_ROWS), stop):
            seen.append(row)
            if row == 10:
                stop.set()

    with pytest.raises(Stopped):
        read_all()
    assert seen == list(range(STOP_CHECK_ROWS))  # row 1024 is where the event is looked at again
    assert list(until_stopped(range(5), None)) == [0, 1, 2, 3, 4]
    ended = threading.Event()
    ended.set()
    with pytest.raises(Stopped):  # set after the last check: seen at the end, not taken for a whole pass
        list(until_stopped(range(3), ended))


async def test_a_cancelled_caller_stops_the_thread_and_waits_for_it() -> None:
    started, events = threading.Event(), []

    def work(*, stop: threading.Event) -> str:
        started.set()
        stop.wait(60)  # returns once the cancelled caller sets it
        events.append("thread ended")
        return "late result"

    discarded: list[str] = []

    async def caller() -> str:
        try:
            return await in_stoppable_thread(work, discard=discarded.append)
        except asyncio.CancelledError:
            events.append("cancellation seen")
            raise

    task = asyncio.create_task(caller())
    assert await asyncio.to_thread(started.wait, 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["thread ended", "cancellation seen"]  # joined before the cancellation went on
    assert discarded == ["late result"]


async def test_an_uncancelled_call_returns_the_threads_result() -> None:
    def work(value: int, *, stop: threading.Event) -> int:
        return value * 2 if not stop.is_set() else -1

    assert await in_stoppable_thread(work, 21) == 42


def _input(tmp_path: Path, rows: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(_row(f"q{i}")) + "\n" for i in range(rows)), encoding="utf-8")
    return path


def test_a_stopped_validation_pass_leaves_nothing(tmp_path: Path) -> None:
    run = _config(tmp_path, "run", _input(tmp_path, 3000), shard_size=500)
    before = _owned_folders()
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        validate_ahead(run, stop=stop)
    with pytest.raises(Stopped):
        prepare_run(run, stop=stop)
    assert _owned_folders() == before
    assert not (tmp_path / "run").exists()


def test_a_plan_stopped_while_cutting_resumes_with_the_same_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _config(tmp_path, "run", _input(tmp_path, 3000), shard_size=500)
    stop = threading.Event()
    real = first_pass.first_pass

    def then_stop(*args: Any, **kwargs: Any) -> Any:
        parts = real(*args, **kwargs)
        stop.set()  # the caller is cancelled between the passes
        return parts

    monkeypatch.setattr(shards, "first_pass", then_stop)
    with pytest.raises(Stopped):
        prepare_run(run, stop=stop)
    stopped = read_run_manifest(tmp_path / "run")
    assert stopped is not None
    assert stopped["num_shards"] is None  # the plan was not completed
    monkeypatch.setattr(shards, "first_pass", real)
    plan = prepare_run(run)
    assert plan.run_id == stopped["run_id"]
    assert [spec.num_rows for spec in plan.shards] == [500] * 6
