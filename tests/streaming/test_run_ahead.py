"""Run-ahead follows ``max_staleness``: while a trainer holds a batch, generation runs ahead of it by at most
``max_staleness`` batches, and a synchronous trainer finds that much ready after a long step (the sync
stream's loop keeps pulling on its own thread while the step runs)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import pytest

from gym_ray.servers import serve_config, start_in_thread
from gym_ray.streaming.api import stream
from gym_ray.streaming.row_feed import RowFeed
from gym_ray.streaming.sync import stream_sync
from tests.streaming.test_stream import _config, _row

pytestmark = pytest.mark.ray


def test_a_sync_trainer_finds_a_batch_ready_after_a_long_step(ray_session: Any) -> None:
    """max_in_flight=4, batches of 4 groups of 2 (8 rollouts), max_staleness=1: the window is 16 rollouts;
    while the trainer holds a batch the other 8 run and finish, so a 3 s step finds 8 ready (> 4). The
    loop-in-the-caller's-thread stream found at most max_in_flight (its default buffer) after a step."""
    ready: list[int] = []
    with start_in_thread(_config(fast_ms=50)) as servers:
        with stream_sync(
            [_row(i) for i in range(40)],
            config=servers.config,
            group_size=2,
            max_in_flight=4,
            max_staleness=1,
        ) as rollouts:
            for version in range(3):
                assert len(rollouts.next_batch(4)) == 4
                time.sleep(3.0)  # the trainer's step
                ready.append(rollouts.stats().buffered)
                rollouts.set_policy_version(version + 1)
            stats = rollouts.stats()
    assert ready == [8, 8, 8]
    assert stats.run_ahead == 16
    assert (stats.stale, stats.staleness) == (0, {0: 8, 1: 16})


async def test_staleness_zero_runs_nothing_ahead_of_the_trainer(ray_session: Any) -> None:
    """max_staleness=0 is on-policy: nothing runs while the trainer holds its batch; a second batch under
    the same version (gradient accumulation) is still generated, not waited for forever. The rows come
    through a RowFeed filled once the first next_batch waits, so nothing was read before the window."""
    feed = RowFeed()
    async with serve_config(_config()) as servers:
        async with stream(
            feed, config=servers.config, group_size=2, max_in_flight=8, max_staleness=0
        ) as rollouts:
            first = asyncio.create_task(rollouts.next_batch(2))
            await asyncio.sleep(0)  # the call has set the window and waits
            feed.put_many(_row(i) for i in range(20))
            assert len(await first) == 2
            await asyncio.sleep(0.5)  # the trainer's step
            during = servers.stats("fast_env").requests, rollouts.stats()
            await rollouts.set_policy_version(1)
            assert len(await rollouts.next_batch(2)) == 2
            assert len(await asyncio.wait_for(rollouts.next_batch(2), 30)) == 2  # same version
            await asyncio.sleep(0.5)
            after = servers.stats("fast_env").requests, rollouts.stats()
            feed.close()
    assert (during[0], during[1].buffered, during[1].at_workers, during[1].queued) == (4, 0, 0, 0)
    assert (after[0], after[1].run_ahead, after[1].stale, after[1].staleness) == (12, 4, 0, {0: 12})


async def test_iteration_has_no_window(ray_session: Any) -> None:
    """A stream read by iteration has no batch size: max_staleness filters stale rollouts, no window holds
    the reader."""
    async with serve_config(_config()) as servers:
        async with stream(
            [_row(i) for i in range(6)], config=servers.config, max_in_flight=2, max_staleness=0
        ) as rollouts:
            tasks = sorted([item[0]["_ng_task_index"] async for item in rollouts])  # type: ignore[index]
            assert rollouts.stats().run_ahead is None
    assert tasks == list(range(6))


async def test_a_batch_whose_groups_are_filtered_out_is_still_filled(ray_session: Any) -> None:
    """The window never starves a waiting batch: groups a filter drops are replaced by new input rows, also
    for a second batch under the same version (its window is spent: only the batch's own need is read)."""

    def odd_tasks(group: Any) -> bool:
        return int(group[0][0]["_ng_task_index"]) % 2 == 1

    async with serve_config(_config()) as servers:
        async with stream(
            [_row(i) for i in range(12)],
            config=servers.config,
            group_size=2,
            max_staleness=0,
            group_filter=odd_tasks,
        ) as rollouts:
            first = await asyncio.wait_for(rollouts.next_batch(3), 30)
            second = await asyncio.wait_for(rollouts.next_batch(3), 30)
            stats = rollouts.stats()
    assert sorted(int(group[0][0]["_ng_task_index"]) for group in first) == [1, 3, 5]
    assert sorted(int(group[0][0]["_ng_task_index"]) for group in second) == [7, 9, 11]
    assert (stats.run_ahead, stats.filtered) == (6, {"odd_tasks": 6})


def test_ctrl_c_in_a_sync_next_batch_leaves_the_stream_open(ray_session: Any) -> None:
    """Ctrl-C while a sync ``next_batch`` waits cancels that call on the stream's thread; the stream stays
    open and the next call delivers (the interrupted call's groups were put back, none is lost)."""
    main = threading.main_thread().ident
    assert main is not None
    with start_in_thread(_config(fast_ms=300)) as servers:
        with stream_sync(
            [_row(i) for i in range(6)], config=servers.config, group_size=2, max_in_flight=2
        ) as rollouts:
            rollouts.start()
            timer = threading.Timer(0.5, signal.pthread_kill, args=(main, signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                rollouts.next_batch(3)  # 6 rollouts of 300 ms, 2 at a time: about 0.9 s
            timer.join()
            batch = rollouts.next_batch(3, timeout_s=30)
    assert sorted(int(group[0][0]["_ng_task_index"]) for group in batch) == [0, 1, 2]
