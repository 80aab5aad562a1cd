"""The completion iterator's admission contract on plain coroutines (no HTTP: each test runs in milliseconds).

Batches given to ``validate_batch``, when an admission error reaches waiting consumers, how far the input is
read, and the constructor's checks. Expected values are worked out by hand from the documented contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gym_ray.dispatch._completion import CompletionIterator
from gym_ray.errors import InternalError, UsageError
from tests.dispatch.test_dispatch import wait_for


async def echo(i: int) -> int:
    await asyncio.sleep(0)
    return i


class CountingRows(Iterator[int]):
    """``n`` rows, then StopIteration on every later call; counts the calls made after the end."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.given = 0
        self.calls_after_end = 0

    def __next__(self) -> int:
        if self.given >= self.n:
            self.calls_after_end += 1
            raise StopIteration
        self.given += 1
        return self.given - 1


@pytest.mark.parametrize(
    ("bound", "expected"),
    [
        # bounded: batches of batch_size rows, the last one shorter; never a row more than batch_size
        pytest.param(1, [[0, 1], [2, 3], [4]], id="bounded"),
        pytest.param(3, [[0, 1], [2, 3], [4]], id="bounded-3"),
        # unbounded: every row validated in one call, whatever batch_size says
        pytest.param(None, [[0, 1, 2, 3, 4]], id="unbounded"),
    ],
)
async def test_validate_batch_gets_batch_size_rows_bounded_and_every_row_unbounded(
    bound: int | None, expected: list[list[int]]
) -> None:
    calls: list[list[int]] = []

    def validate(batch: list[int]) -> list[int]:
        calls.append(list(batch))
        return [i * 10 for i in batch]  # the rows admitted are the validated ones

    it: CompletionIterator[int, int] = CompletionIterator(
        range(5), echo, max_resident_tasks=bound, validate_batch=validate, batch_size=2
    )
    outcomes = [outcome async for outcome in it]
    await it.aclose()
    assert calls == expected
    assert sorted(outcomes) == [0, 10, 20, 30, 40]
    assert it.admitted == 5


async def test_validate_batch_returning_another_row_count_is_refused_with_both_counts() -> None:
    it: CompletionIterator[int, int] = CompletionIterator(
        range(4), echo, max_resident_tasks=2, validate_batch=lambda batch: batch[:1], batch_size=2
    )
    with pytest.raises(InternalError, match=r"^row validation returned 1 rows for 2$"):
        async for _ in it:
            pass
    assert it.admitted == 0  # nothing of the refused batch was started
    await it.aclose()


async def test_waiting_consumers_get_the_admission_error_only_after_the_running_rows_ended() -> None:
    # bound 2, one row per validation batch: rows 0 and 1 run; row 2 fails validation when row 0's slot frees
    gates = {0: asyncio.Event(), 1: asyncio.Event()}

    async def run(i: int) -> int:
        await gates[i].wait()
        return i

    def validate(batch: list[int]) -> list[int]:
        if 2 in batch:
            raise ValueError("row 2 is bad")
        return batch

    it: CompletionIterator[int, int] = CompletionIterator(
        range(3), run, max_resident_tasks=2, validate_batch=validate, batch_size=1
    )
    in_flight_at_error: dict[int, int] = {}

    async def consume(k: int, item: Any) -> str:
        try:
            return f"outcome {await item}"
        except ValueError as exc:
            in_flight_at_error[k] = it.in_flight
            return str(exc)

    consumers = [asyncio.create_task(consume(k, item)) for k, item in enumerate(it)]
    await wait_for(lambda: it.in_flight == 2 and all(not c.done() for c in consumers))
    gates[0].set()  # consumer 0 claims row 0; admitting row 2 then fails while row 1 still runs
    assert await asyncio.wait_for(consumers[0], timeout=30) == "row 2 is bad"
    assert in_flight_at_error == {0: 1}
    gates[1].set()  # row 1 ends: the two consumers still waiting get the admission error now
    outcomes = await asyncio.wait_for(asyncio.gather(*consumers[1:]), timeout=30)
    assert outcomes == ["row 2 is bad", "row 2 is bad"]
    assert in_flight_at_error == {0: 1, 1: 0, 2: 0}
    assert it.admitted == 2
    await it.aclose()


@pytest.mark.parametrize("bound", [None, 2])
async def test_the_input_is_not_read_again_after_it_ended(bound: int | None) -> None:
    rows = CountingRows(3)
    it: CompletionIterator[int, int] = CompletionIterator(rows, echo, max_resident_tasks=bound, batch_size=2)
    assert sorted([await item for item in it]) == [0, 1, 2]
    assert [item for item in it] == []  # iterating again hands out nothing more
    await it.aclose()
    assert rows.calls_after_end == 1


@pytest.mark.parametrize("bound", [None, 1, 4])
async def test_sync_iteration_hands_out_one_awaitable_per_row_and_none_after_close(bound: int | None) -> None:
    it: CompletionIterator[int, int] = CompletionIterator(iter(range(4)), echo, max_resident_tasks=bound)
    assert (it.admitted, it.in_flight, it.closed) == (0, 0, False)
    items = list(it)
    assert len(items) == 4
    assert sorted([await item for item in items]) == [0, 1, 2, 3]
    assert (it.admitted, it.in_flight) == (4, 0)
    await it.aclose()
    assert it.closed is True
    assert list(it) == []
    assert [outcome async for outcome in it] == []


async def test_closing_before_the_input_is_read_hands_out_nothing() -> None:
    rows = CountingRows(3)
    it: CompletionIterator[int, int] = CompletionIterator(rows, echo, max_resident_tasks=2)
    await it.aclose()
    assert list(it) == []
    assert (rows.given, it.admitted) == (0, 0)


@pytest.mark.parametrize("bad", [0, -1, True, False])
def test_a_residency_bound_that_is_not_an_int_of_at_least_one_is_refused(bad: int) -> None:
    with pytest.raises(UsageError) as caught:
        CompletionIterator([1], echo, max_resident_tasks=bad)
    assert str(caught.value) == (
        f"max_resident_tasks={bad!r} must be an int >= 1 (or None to schedule every row up front)"
    )


async def test_a_batch_size_below_one_validates_one_row_at_a_time() -> None:
    calls: list[list[int]] = []

    def validate(batch: list[int]) -> list[int]:
        calls.append(list(batch))
        return batch

    it: CompletionIterator[int, int] = CompletionIterator(
        range(3), echo, max_resident_tasks=1, validate_batch=validate, batch_size=0
    )
    assert [outcome async for outcome in it] == [0, 1, 2]
    await it.aclose()
    assert calls == [[0], [1], [2]]


def test_an_exception_thrown_into_an_unstarted_awaitable_with_its_value_is_raised_there() -> None:
    it: CompletionIterator[int, int] = CompletionIterator([1], echo, max_resident_tasks=1)
    item = next(it)
    error = RuntimeError("stop here")
    with pytest.raises(RuntimeError, match=r"^stop here$") as caught:
        item.throw(error)
    assert caught.value is error
    item.close()


async def test_a_consumer_cancelled_after_claiming_while_the_iterator_closes_gets_cancellation() -> None:
    consumer: asyncio.Task[int] | None = None
    it: CompletionIterator[int, int]

    def close_now(_: object) -> None:
        # runs right after the iterator handed the outcome to the waiting consumer, before it resumes:
        # cancel the consumer and close the iterator (aclose() finishes without suspending: nothing runs)
        assert consumer is not None
        consumer.cancel()
        closing = it.aclose()
        with pytest.raises(StopIteration):
            closing.send(None)

    async def run(i: int) -> int:
        task = asyncio.current_task()
        assert task is not None
        task.add_done_callback(close_now)
        await asyncio.sleep(0)
        raise ValueError(f"row {i} failed")

    it = CompletionIterator([4], run, max_resident_tasks=1)
    consumer = asyncio.create_task(next(it))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(consumer), timeout=30)
    assert it.closed is True
    assert it.in_flight == 0
    assert await it.aclose_and_drain() == []  # closed: the claimed outcome is not handed out again


async def test_the_default_validation_batch_is_1024_rows() -> None:
    sizes: list[int] = []

    def validate(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        return batch

    it: CompletionIterator[int, int] = CompletionIterator(
        range(1030), echo, max_resident_tasks=8, validate_batch=validate
    )
    assert sum([1 async for _ in it]) == 1030
    await it.aclose()
    assert sizes == [1024, 6]
