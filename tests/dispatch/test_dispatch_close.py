"""aclose() / aclose_and_drain() of the completion iterator: every case of the contract."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from gym_ray.dispatch._completion import CompletionIterator
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.errors import ServerHTTPError, UsageError
from gym_ray.servers import serve_config
from gym_ray.servers.launch import Deployment
from tests.dispatch.test_dispatch import make_config, row, wait_for


@pytest.fixture
async def dep() -> AsyncIterator[Deployment]:
    async with serve_config(make_config(0)) as deployment:
        yield deployment


@pytest.fixture
async def helper(dep: Deployment) -> AsyncIterator[RolloutCollectionHelper]:
    h = RolloutCollectionHelper(dep.config)
    yield h
    await h.aclose()


async def claim(item: Coroutine[Any, Any, Any]) -> Any:
    """Await a handed-out item; report a CancelledError and whether this task itself was cancelled."""
    try:
        return await item
    except asyncio.CancelledError:
        task = asyncio.current_task()
        assert task is not None
        return ("CancelledError", task.cancelling())


BOUNDS = [pytest.param(None, id="unbounded"), pytest.param(3, id="bounded")]


@pytest.mark.parametrize("bound", BOUNDS)
async def test_close_before_first_use_starts_nothing(
    dep: Deployment, helper: RolloutCollectionHelper, bound: Any
) -> None:
    pulled: list[int] = []

    def rows() -> Any:  # records every row the iterator takes from its input
        for i in range(2):
            pulled.append(i)
            yield row(i)

    it = helper.run_examples(rows(), max_resident_tasks=bound)
    await it.aclose()
    await it.aclose()  # repeated call
    assert list(it) == []
    assert await it.aclose_and_drain() == []
    it2 = helper.run_examples(rows(), max_resident_tasks=bound)
    assert await it2.aclose_and_drain() == []
    assert [x async for x in it2] == []
    # nothing was taken from the input and no row task exists, so nothing can reach the server later
    assert pulled == []
    assert (it.stats().admitted, it2.stats().admitted) == (0, 0)
    assert [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("_Dispatcher.")] == []
    assert dep.stats("env").requests == 0


@pytest.mark.parametrize("bound", BOUNDS)
async def test_aclose_cancels_in_flight_and_the_server_sees_it(
    dep: Deployment, helper: RolloutCollectionHelper, bound: Any
) -> None:
    it = helper.run_examples([row(i, fault="hang") for i in range(3)], max_resident_tasks=bound)
    waiter = asyncio.create_task(claim(next(it)))
    await wait_for(lambda: dep.stats("env").in_flight == 3)
    await it.aclose()
    assert it.stats().in_flight == 0
    assert await waiter == ("CancelledError", 0)  # raised in the waiter's task, which was not cancelled
    await wait_for(lambda: dep.stats("env").cancelled == 3)
    assert dep.stats("env").requests == 3
    with pytest.raises(StopIteration):
        next(it)
    assert [x async for x in it] == []
    await it.aclose()


async def test_bounded_awaitable_first_awaited_after_close_raises_even_if_ready(
    helper: RolloutCollectionHelper,
) -> None:
    it = helper.run_examples([row(i) for i in range(3)], max_resident_tasks=3)
    first_row, _ = await next(it)
    later = next(it)
    await wait_for(lambda: it.stats().completed == 3)
    await it.aclose()
    with pytest.raises(asyncio.CancelledError):
        await later
    assert first_row["_ng_task_index"] in {0, 1, 2}


async def test_bounded_awaitable_after_close_is_cancellation_for_gather(
    helper: RolloutCollectionHelper,
) -> None:
    it = helper.run_examples([row(0), row(1)], max_resident_tasks=1)
    items = list(it)
    await it.aclose()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.gather(*items)


async def test_unbounded_handed_out_awaitables_keep_completed_results(
    dep: Deployment, helper: RolloutCollectionHelper
) -> None:
    it = helper.run_examples([row(0), row(1, fault="hang")])
    items = list(it)
    assert len(items) == 2
    await wait_for(lambda: it.stats().completed == 1 and dep.stats("env").in_flight == 1)
    await it.aclose()
    done_row, result = await items[0]
    assert done_row["_ng_task_index"] == 0
    assert result["reward"] == 1.0
    with pytest.raises(asyncio.CancelledError):
        await items[1]
    await wait_for(lambda: dep.stats("env").cancelled == 1)


async def test_drain_returns_unclaimed_outcomes_once(
    dep: Deployment, helper: RolloutCollectionHelper
) -> None:
    rows = [row(0), row(1), row(2, fault="500"), row(3, fault="hang"), row(4), row(5)]
    it = helper.run_examples(rows, max_resident_tasks=4, retry_requests=False)
    first_row, _ = await next(it)  # admits rows 0-3, claims one, refills one slot (row 4)
    issued = next(it)
    await wait_for(lambda: it.stats().completed + it.stats().failed == 4 and dep.stats("env").in_flight == 1)
    futures = await it.aclose_and_drain()
    outcomes: dict[int, Any] = {}
    for fut in futures:
        try:
            r, result = await fut
            outcomes[r["_ng_task_index"]] = result["reward"]
        except ServerHTTPError as exc:
            outcomes[2] = exc.status
    assert sorted(outcomes) == sorted({0, 1, 2, 4} - {first_row["_ng_task_index"]})
    assert outcomes.get(2, 500) == 500
    with pytest.raises(asyncio.CancelledError):
        await issued
    assert await it.aclose_and_drain() == []
    await it.aclose()
    await wait_for(lambda: dep.stats("env").cancelled == 1)
    assert dep.stats("env").requests == 5  # row 5 never admitted, during or after the drain
    assert list(it) == []


async def test_drained_futures_have_exceptions_retrieved(helper: RolloutCollectionHelper) -> None:
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reports.append(ctx))
    try:
        it = helper.run_examples([row(0, fault="500")], retry_requests=False)
        items = list(it)
        await wait_for(lambda: it.stats().failed == 1)
        futures = await it.aclose_and_drain()
        assert len(futures) == 1
        assert isinstance(futures[0].exception(), ServerHTTPError)
        del futures, items
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert reports == []


async def test_drain_cancels_unclaimed_waiters(dep: Deployment, helper: RolloutCollectionHelper) -> None:
    it = helper.run_examples([row(0, fault="hang"), row(1, fault="hang")], max_resident_tasks=2)
    waiter = asyncio.create_task(claim(next(it)))
    await wait_for(lambda: dep.stats("env").in_flight == 2)
    assert await it.aclose_and_drain() == []
    assert await waiter == ("CancelledError", 0)
    await wait_for(lambda: dep.stats("env").cancelled == 2)


async def test_drain_after_aclose_returns_nothing(helper: RolloutCollectionHelper) -> None:
    it = helper.run_examples([row(0), row(1)])
    items = list(it)
    await wait_for(lambda: it.stats().completed == 2)
    await it.aclose()
    assert await it.aclose_and_drain() == []
    assert [(await i)[0]["_ng_task_index"] for i in items] in ([0, 1], [1, 0])


# --- the bare iterator (outcomes no server can produce) ---------------------------------------------


def started(log: list[int]) -> Callable[[int], Coroutine[Any, Any, int]]:
    async def run(i: int) -> int:
        log.append(i)
        if i < 0:
            raise asyncio.CancelledError
        await asyncio.sleep(0)
        return i

    return run


async def test_outcome_cancelled_before_the_snapshot_is_a_cancelled_future() -> None:
    it: CompletionIterator[int, int] = CompletionIterator([1, -1], started([]))
    items = list(it)
    await asyncio.sleep(0.01)
    futures = await it.aclose_and_drain()
    assert sorted((f.cancelled(), None if f.cancelled() else f.result()) for f in futures) == [
        (False, 1),
        (True, None),
    ]
    with pytest.raises(asyncio.CancelledError):
        await futures[[f.cancelled() for f in futures].index(True)]
    for item in items:
        item.close()


async def test_bounded_admission_is_lazy_and_ordered() -> None:
    log: list[int] = []
    pulled: list[int] = []

    def source() -> Any:
        for i in range(10):
            pulled.append(i)
            yield i

    it: CompletionIterator[int, int] = CompletionIterator(source(), started(log), max_resident_tasks=3)
    first = next(it)
    for _ in range(20):  # the loop gets many turns to start anything it would start (none of them waits)
        await asyncio.sleep(0)
    assert log == []
    assert pulled == [0]
    assert it.admitted == 0  # admission starts when the first item is awaited, not when it is handed out
    assert await first == 0
    for _ in range(200):  # the bound refills as row 0 ends: rows 1-3 start, and no more
        await asyncio.sleep(0)
    assert log == [0, 1, 2, 3]
    assert it.admitted == 4
    assert sorted([await first2 for first2 in it]) == list(range(1, 10))
    assert log == list(range(10))
    await it.aclose()


def test_bound_below_one_is_refused() -> None:
    with pytest.raises(UsageError, match="max_resident_tasks=0"):
        CompletionIterator([1], started([]), max_resident_tasks=0)


async def test_200k_generator_rows_keep_live_tasks_bounded_without_http() -> None:
    async def run(i: int) -> int:
        await asyncio.sleep(0)
        return i

    def rows() -> Any:
        yield from range(200_000)

    it: CompletionIterator[int, int] = CompletionIterator(rows(), run, max_resident_tasks=256)
    baseline = len(asyncio.all_tasks())
    peak = seen = 0
    async for _ in it:
        seen += 1
        if seen % 1000 == 0:
            peak = max(peak, len(asyncio.all_tasks()) - baseline)
    await it.aclose()
    assert seen == 200_000
    assert it.admitted == 200_000
    assert peak <= 256


async def test_an_awaitable_run_as_a_task_can_be_cancelled_and_gives_its_claim_back() -> None:
    gate = asyncio.Event()

    async def run(i: int) -> int:
        await gate.wait()
        return i

    it: CompletionIterator[int, int] = CompletionIterator([7], run, max_resident_tasks=1)
    consumer = asyncio.create_task(next(it))  # a real Coroutine: the task steps it with send() / throw()
    await wait_for(lambda: it.in_flight == 1)
    consumer.cancel()  # the task throws CancelledError into the awaitable
    with pytest.raises(asyncio.CancelledError):
        await consumer
    gate.set()
    assert [await item for item in it] == []  # every row had an awaitable; the row still runs to its end
    await wait_for(lambda: it.in_flight == 0)
    await it.aclose()


def test_throwing_into_an_unstarted_awaitable_raises_there() -> None:
    it: CompletionIterator[int, int] = CompletionIterator([1], started([]), max_resident_tasks=1)
    item = next(it)
    with pytest.raises(RuntimeError, match="stop"):
        item.throw(RuntimeError("stop"))
    item.close()


async def test_abandoned_outcomes_and_cancelled_rows_log_nothing_after_aclose() -> None:
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reports.append(ctx))
    hang = asyncio.Event()

    async def run(i: int) -> int:
        if i == 0:
            raise ValueError("row 0 failed")
        await hang.wait()
        return i

    try:
        for bound in (None, 2):
            it: CompletionIterator[int, int] = CompletionIterator([0, 1], run, max_resident_tasks=bound)
            first = asyncio.create_task(next(it))  # claims row 0's failure
            with pytest.raises(ValueError, match="row 0 failed"):
                await first
            second = next(it)
            await it.aclose()  # row 1 is cancelled: its done callback retrieves nothing from it
            with pytest.raises(asyncio.CancelledError):
                await second
        unclaimed: CompletionIterator[int, int] = CompletionIterator([0, 1], run)
        items = list(unclaimed)  # unbounded: both rows start; row 0 fails and nobody claims it
        await wait_for(lambda: unclaimed.in_flight == 1)
        await unclaimed.aclose()
        for item in items:
            item.close()
        del items, first, second
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert reports == []


async def test_an_admission_error_reaches_every_waiting_consumer() -> None:
    gate = asyncio.Event()

    async def run(i: int) -> int:
        await gate.wait()
        return i

    def validate(batch: list[int]) -> list[int]:
        if 2 in batch:
            raise ValueError("row 2 is bad")
        return batch

    it: CompletionIterator[int, int] = CompletionIterator(
        range(4), run, max_resident_tasks=2, validate_batch=validate, batch_size=2
    )
    consumers = [asyncio.create_task(item) for item in it]
    await wait_for(lambda: it.in_flight == 2)
    gate.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*consumers, return_exceptions=True), timeout=30)
    assert [str(o) for o in outcomes] == ["row 2 is bad"] * 4
    assert it.admitted == 2
    await it.aclose()


async def test_drain_takes_rows_finished_before_their_done_callbacks_ran() -> None:
    async def run(i: int) -> int:
        return i * 10  # finishes in its first step

    it: CompletionIterator[int, int] = CompletionIterator(range(3), run)
    items = list(it)  # unbounded: the three tasks are created now
    await asyncio.sleep(0)  # their first steps run (and finish) before this resumes; callbacks come after
    assert it.in_flight == 3  # finished, but not yet seen as finished
    futures = await it.aclose_and_drain()
    assert sorted(f.result() for f in futures) == [0, 10, 20]
    for item in items:
        item.close()


async def test_aclose_keeps_rows_finished_before_their_done_callbacks_claimable() -> None:
    async def run(i: int) -> int:
        return i * 10

    it: CompletionIterator[int, int] = CompletionIterator(range(3), run)
    items = list(it)
    await asyncio.sleep(0)  # the rows finish; their done callbacks have not run yet
    await it.aclose()
    assert sorted([await item for item in items]) == [0, 10, 20]  # unbounded: finished outcomes stay


async def test_an_outcome_claimed_by_a_consumer_cancelled_before_it_resumed_is_not_lost() -> None:
    consumer: asyncio.Task[int] | None = None

    async def run(i: int) -> int:
        task = asyncio.current_task()
        assert task is not None
        # runs right after the iterator handed this outcome to the waiting consumer, before it resumes
        task.add_done_callback(lambda _: consumer.cancel() if consumer is not None else None)
        await asyncio.sleep(0)
        return i * 10

    it: CompletionIterator[int, int] = CompletionIterator([4], run, max_resident_tasks=1)
    consumer = asyncio.create_task(next(it))
    with pytest.raises(asyncio.CancelledError):
        await consumer
    futures = await it.aclose_and_drain()
    assert [f.result() for f in futures] == [40]  # given back: the drain hands it over


@pytest.mark.parametrize("close", ["aclose", "aclose_and_drain"])
async def test_closing_joins_the_prepare_step(close: str) -> None:
    ended: list[str] = []
    entered = asyncio.Event()

    async def prepare() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("prepare")

    it: CompletionIterator[int, int] = CompletionIterator([1], started([]), prepare=prepare)
    consumer = asyncio.create_task(next(it))
    await entered.wait()
    assert await getattr(it, close)() in (None, [])
    assert ended == ["prepare"]  # cancelled and finished before the close returned
    with pytest.raises(asyncio.CancelledError):
        await consumer


async def test_unbounded_aclose_hands_out_what_rows_end_with_after_the_cancel() -> None:
    running: list[int] = []

    async def run(i: int) -> int:
        running.append(i)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if i == 1:
                return 11  # this row turns the cancel into an outcome
            raise
        return i

    it: CompletionIterator[int, int] = CompletionIterator([0, 1], run)
    items = list(it)
    await wait_for(lambda: len(running) == 2)  # both rows are inside run()
    await it.aclose()
    outcomes = await asyncio.gather(*items, return_exceptions=True)
    assert sorted(repr(o) for o in outcomes) == ["11", "CancelledError('')"]
