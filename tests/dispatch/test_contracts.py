"""Dispatch contracts that planted bugs slipped past: the adaptive drain margin, validation before sending.

Written from PROTOCOL.md section 4 ("Validation, all before the first request") and the engine's contract
(a row with less budget left than the drain margin, the p75 of successful ``/run`` latencies once 5 exist,
is not sent). Real reference servers on 127.0.0.1; the server's own request counters are the oracle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.errors import ValidationError
from gym_ray.servers import serve_config
from gym_ray.servers.launch import Deployment

LATENCY_MS = 100


def _config(latency_ms: float) -> dict[str, Any]:
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "latency_ms": latency_ms,
                    "latency_jitter_ms": 0,
                    "agent_server": {"type": "responses_api_agents", "name": "agent"},
                }
            }
        },
    }


def _row(i: int, agent: str = "agent") -> dict[str, Any]:
    return {
        "responses_create_params": {"input": f"What is {i} + 1?"},
        "expected_answer": str(i + 1),
        "agent_ref": {"name": agent},
        "_ng_task_index": i,
        "_ng_rollout_index": 0,
    }


@pytest.fixture
async def slow_env() -> AsyncIterator[Deployment]:
    async with serve_config(_config(LATENCY_MS)) as dep:
        yield dep


@pytest.fixture
async def instant_env() -> AsyncIterator[Deployment]:
    async with serve_config(_config(0)) as dep:
        yield dep


class _StepClock:
    """The budget clock: reads 0.0 for the first ``calls_at_start`` reads, then ``later``.

    The engine reads the clock once when the dispatcher is built (the budget's start) and once per row
    just before sending it, so with one row resident at a time read ``k`` (k >= 1) belongs to row k-1.
    """

    def __init__(self, calls_at_start: int, later: float) -> None:
        self.calls = 0
        self._calls_at_start = calls_at_start
        self._later = later

    def __call__(self) -> float:
        self.calls += 1
        return 0.0 if self.calls <= self._calls_at_start else self._later


async def test_rows_with_less_budget_left_than_the_adaptive_margin_are_drained_not_sent(
    slow_env: Deployment,
) -> None:
    # Budget 100 s. Rows 0-4 go out at t=0 and each takes >= 100 ms (the server sleeps that long), so the
    # margin after them (p75 of 5 latencies) is >= 0.1 s. Rows 5-9 find t=99.95: 0.05 s left, more than
    # zero (the budget alone would send them) but less than the margin: drained, never sent.
    clock = _StepClock(calls_at_start=1 + 5, later=99.95)
    helper = RolloutCollectionHelper(slow_env.config, clock=clock)
    try:
        it = helper.run_examples([_row(i) for i in range(10)], dispatch_budget_s=100.0, max_resident_tasks=1)
        outcomes = {}
        async for row, result in it:
            outcomes[row[keys.TASK_INDEX]] = result
        await it.aclose()
    finally:
        await helper.aclose()
    assert clock.calls == 1 + 10
    assert slow_env.stats("env").request_counts == {(i, 0): 1 for i in range(5)}
    assert [outcomes[i]["reward"] for i in range(5)] == [1.0] * 5
    for i in range(5, 10):
        drained = outcomes[i]
        assert set(drained) == {
            keys.FAILURE_CLASS,
            keys.NO_PERSIST,
            keys.DISPATCH_DRAINED,
            keys.ERROR_MESSAGE,
        }
        assert (drained[keys.FAILURE_CLASS], drained[keys.NO_PERSIST], drained[keys.DISPATCH_DRAINED]) == (
            "cancelled",
            True,
            True,
        )
        assert "drain margin" in drained[keys.ERROR_MESSAGE]
    assert it.stats().drained == 5


def _rows_with_a_bad_last(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n - 1):
        yield _row(i)
    yield _row(n - 1, agent="agnet")


@pytest.mark.parametrize(
    ("make_rows", "bad"),
    [
        # a list is validated whole before the first request
        pytest.param(lambda: list(_rows_with_a_bad_last(5000)), 4999, id="list-of-5000"),
        # a one-shot iterator is validated in batches of 1024, each before any of its rows is sent
        pytest.param(lambda: _rows_with_a_bad_last(1024), 1023, id="iterator-first-batch"),
    ],
)
@pytest.mark.parametrize("bound", [pytest.param(None, id="unbounded"), pytest.param(8, id="bounded")])
async def test_a_bad_row_at_the_end_of_the_input_sends_nothing(
    instant_env: Deployment, make_rows: Any, bad: int, bound: int | None
) -> None:
    helper = RolloutCollectionHelper(instant_env.config)
    try:
        it = helper.run_examples(make_rows(), max_resident_tasks=bound)
        with pytest.raises(ValidationError) as caught:
            async for _ in it:
                pass
        await it.aclose()
    finally:
        await helper.aclose()
    assert instant_env.stats("env").requests == 0
    assert "'agnet'" in str(caught.value)
    assert f"row {bad} " in str(caught.value)
