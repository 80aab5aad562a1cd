"""run_examples / run_outcomes / dispatch against the reference servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch.engine import LatencyTracker, dispatch, interleave_by_agent
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord
from gym_ray.errors import RoutingError, ServerHTTPError, ValidationError
from gym_ray.servers import serve_config
from gym_ray.servers.launch import Deployment


def make_config(latency_ms: float = 0, *, env_port: int = 0) -> dict[str, Any]:
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": env_port,
                    "latency_ms": latency_ms,
                    "agent_server": {"type": "responses_api_agents", "name": "agent"},
                }
            }
        },
        "environment_server_routes": {"arith": "env"},
    }


def row(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": f"What is {i} + 1?"},
        "expected_answer": str(i + 1),
        "agent_ref": {"name": "agent"},
        "_ng_task_index": i,
        "_ng_rollout_index": 0,
        **extra,
    }


@pytest.fixture
async def instant() -> AsyncIterator[Deployment]:
    async with serve_config(make_config(0)) as dep:
        yield dep


@pytest.fixture
async def slow() -> AsyncIterator[Deployment]:
    async with serve_config(make_config(30)) as dep:
        yield dep


@pytest.fixture
async def helper_of() -> AsyncIterator[Callable[..., RolloutCollectionHelper]]:
    made: list[RolloutCollectionHelper] = []

    def make(dep: Deployment | dict[str, Any], **kw: Any) -> RolloutCollectionHelper:
        h = RolloutCollectionHelper(dep.config if isinstance(dep, Deployment) else dep, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.aclose()


def dispatch_tasks() -> int:
    """Live row tasks of this process (the reference server shares the loop, so its handlers are excluded)."""
    return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("_Dispatcher."))


async def consume_all(it: Any) -> list[Any]:
    """Await every handed-out item in turn."""
    return [await fut for fut in it]


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls counters of another object (server stats)
            await asyncio.sleep(0.005)


# --- results ----------------------------------------------------------------------------------------


async def test_result_is_exactly_what_run_returned(instant: Deployment, helper_of: Any) -> None:
    rows = [row(i) for i in range(3)]
    client_result = await helper_of(instant).setup_server_client()
    direct = await client_result.post_json(instant.url_of("env"), "/run", rows[1])
    it = helper_of(instant).run_examples(rows)
    got = {}
    for fut in it:
        r, result = await fut
        got[r["_ng_task_index"]] = (r, result)
    await it.aclose()

    def stamped_alike(result: dict[str, Any]) -> dict[str, Any]:
        # the server stamps each response with the current second: two calls may straddle one
        return {**result, "response": {**result["response"], "created_at": 0.0}}

    assert stamped_alike(got[1][1]) == stamped_alike(direct)
    assert sorted(got[1][1]) == [
        "expected_answer",
        "extracted_answer",
        "response",
        "responses_create_params",
        "reward",
    ]
    assert all(got[i][0] is rows[i] for i in range(3))  # the row is sent and handed back as is
    assert rows[0] == row(0)  # never mutated


async def test_head_url_helper_fetches_config(instant: Deployment, helper_of: Any) -> None:
    helper = RolloutCollectionHelper(instant.head_url, cache_head_config=True)
    try:
        it = helper.run_examples([row(0), row(1)], max_resident_tasks=1)
        results = [await fut for fut in it]
        await it.aclose()
        assert [r["_ng_task_index"] for r, _ in results] == [0, 1]
        assert [res["reward"] for _, res in results] == [1.0, 1.0]
        assert instant.stats("env").requests == 2
    finally:
        await helper.aclose()


async def test_materialized_row_is_sent_as_episode(instant: Deployment, helper_of: Any) -> None:
    task = {
        "task_id": {"taskset": "arith", "task_id": "t7"},
        "task_input": {"responses_create_params": {"input": "What is 2 + 2?"}, "expected_answer": "4"},
        "_ng_task_index": 3,
        "_ng_rollout_index": 1,
    }
    it = helper_of(instant).run_examples([task])
    [(r, reply)] = [await fut for fut in it]
    assert r is task
    assert reply["episode_id"] == {"rollout_id": "3-1", "attempt": 0}
    assert reply["task_id"] == {"taskset": "arith", "task_id": "t7"}
    assert reply["result"]["reward"] == 1.0
    assert instant.stats("env").request_counts == {(3, 1): 1}


# --- bounds and order -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bound", "sem", "expected"),
    [
        pytest.param(4, None, 4, id="max_resident_tasks"),
        pytest.param(None, 3, 3, id="semaphore"),
        pytest.param(6, 2, 2, id="semaphore_below_bound"),
    ],
)
async def test_server_concurrency_never_exceeds_bound(
    slow: Deployment, helper_of: Any, bound: int | None, sem: int | None, expected: int
) -> None:
    semaphore = asyncio.Semaphore(sem) if sem else None
    it = helper_of(slow).run_examples((row(i) for i in range(24)), None, semaphore, max_resident_tasks=bound)
    n = 0
    async for _ in it:
        n += 1
    await it.aclose()
    assert n == 24
    assert slow.stats("env").max_in_flight == expected
    assert it.stats().completed == 24


@pytest.mark.parametrize(
    ("bound", "sem"),
    [pytest.param(None, 1, id="unbounded_fifo_semaphore"), pytest.param(1, None, id="bounded_1")],
)
async def test_rows_start_in_input_order(instant: Deployment, helper_of: Any, bound: Any, sem: Any) -> None:
    semaphore = asyncio.Semaphore(sem) if sem else None
    order = [5, 2, 9, 0, 7, 1]
    it = helper_of(instant).run_examples([row(i) for i in order], None, semaphore, max_resident_tasks=bound)
    done = [await fut for fut in it]
    await it.aclose()
    assert len(done) == 6
    assert list(instant.stats("env").request_counts) == [(i, 0) for i in order]


def test_interleave_by_agent_round_robins() -> None:
    rows = [{"agent_ref": {"name": a}, "i": i} for i, a in enumerate("aaabbc")]
    assert [r["i"] for r in interleave_by_agent(rows)] == [0, 3, 5, 1, 4, 2]


async def test_generator_rows_keep_live_tasks_bounded(instant: Deployment, helper_of: Any) -> None:
    n, bound, peak = 2000, 64, 0
    it = helper_of(instant).run_examples((row(i) for i in range(n)), max_resident_tasks=bound)
    seen = 0
    async for _ in it:
        seen += 1
        if seen % 50 == 0:
            peak = max(peak, dispatch_tasks())
    await it.aclose()
    assert seen == n
    assert bound // 2 <= peak <= bound


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "n",
    [
        pytest.param(2_560, id="2560-in-ci"),  # ten windows of the same bound: CI-sized
        pytest.param(
            200_000,
            id="200k",
            marks=pytest.mark.skipif(
                not os.environ.get("GYM_RAY_SLOW_TESTS"),
                reason="200k rows take 2+ minutes; the 2,560-row form runs in CI; set GYM_RAY_SLOW_TESTS=1",
            ),
        ),
    ],
)
async def test_many_generator_rows_keep_live_tasks_within_256(
    instant: Deployment, helper_of: Any, n: int
) -> None:
    bound, peak = 256, 0
    it = helper_of(instant).run_examples((row(i) for i in range(n)), max_resident_tasks=bound)
    seen = 0
    async for _ in it:
        seen += 1
        if seen % 100 == 0:
            peak = max(peak, dispatch_tasks())
    await it.aclose()
    assert (seen, it.stats().admitted, it.stats().completed) == (n, n, n)
    assert instant.stats("env").requests == n
    assert peak <= bound


# --- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [pytest.param(None, id="unbounded"), pytest.param(2, id="bounded")])
async def test_nothing_dispatched_when_validation_fails(
    instant: Deployment, helper_of: Any, bound: Any
) -> None:
    rows = [row(0), row(1, agent_ref={"name": "agnet"}), row(2)]
    it = helper_of(instant).run_examples(rows, max_resident_tasks=bound)
    with pytest.raises(ValidationError, match="agnet"):
        await consume_all(it)
    await it.aclose()
    assert instant.stats("env").requests == 0


_UNKNOWN_AGENT = (
    "Rows disagree with the running config:\n"
    "  - unknown agent: 'agnet' is not in the running config (did you mean 'agent'?) "
    "[row 3 (task 3, rollout 0)]\n"
    "Include the agents' configs in the run or re-route the rows with agent_map; for a pairing the verifier "
    "does not accept, route the rows to an accepted agent or set allow_unsupported_pairing=true."
)
_UNKNOWN_SERVER = (
    "Rows cannot be routed to their environment server:\n"
    "  - environment server 'envv' is not in the running config (did you mean 'env'?); environment servers: "
    "env [row 3 (task 3, rollout 0)]\n"
    "Fix the stamps or environment_server_routes in the config, or re-preprocess the rows."
)


@pytest.mark.parametrize("bound", [pytest.param(None, id="unbounded"), pytest.param(2, id="bounded")])
@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        pytest.param({"agent_ref": {"name": "agnet"}}, ValidationError, _UNKNOWN_AGENT, id="unknown-agent"),
        pytest.param({"_ng_environment_server": "envv"}, RoutingError, _UNKNOWN_SERVER, id="unknown-server"),
    ],
)
async def test_run_outcomes_sends_nothing_when_the_last_row_is_bad(
    instant: Deployment, helper_of: Any, bound: Any, bad: dict[str, Any], error: type[Exception], message: str
) -> None:
    # A list is validated whole before its first /run: three good rows are not sent ahead of the bad one.
    rows = [row(0), row(1), row(2), row(3, **bad)]
    it = helper_of(instant).run_outcomes(rows, max_resident_tasks=bound)
    with pytest.raises(error) as raised:
        async for _ in it:
            pass
    await it.aclose()
    assert (instant.stats("env").requests, str(raised.value)) == (0, message)


# --- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "cls", "type_", "status", "body"),
    [
        pytest.param(
            "500",
            "agent_run_error",
            "ServerHTTPError",
            500,
            '{"error": "injected fault: HTTP 500"}',
            id="500",
        ),
        pytest.param(
            "503",
            "agent_request_failed",
            "ServerHTTPError",
            503,
            '{"error": "injected fault: HTTP 503"}',
            id="503",
        ),
        pytest.param(
            "truncated",
            "agent_run_error",
            "ServerResponseError",
            200,
            '{"reward": 1.0, "resp',
            id="truncated",
        ),
        pytest.param(
            "non_object", "agent_run_error", "ServerResponseError", 200, '[{"reward": 1.0}]', id="non_object"
        ),
        pytest.param(
            "disconnect", "agent_request_failed", "ServerConnectionError", None, None, id="disconnect"
        ),
    ],
)
async def test_failure_rows(
    instant: Deployment, helper_of: Any, fault: str, cls: str, type_: str, status: Any, body: Any
) -> None:
    helper = helper_of(instant)
    unrouted = helper.run_examples([row(0, fault=fault)], retry_requests=False)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is asserted below
        await consume_all(unrouted)
    assert type(info.value).__name__ == type_
    routed = helper.run_examples([row(0, fault=fault)], route_failures_to_sidecar=True, retry_requests=False)
    [(_, failure)] = [await fut for fut in routed]
    assert failure == {
        "_ng_failure_class": cls,
        "_ng_failure_type": type_,
        "_ng_failure_message": str(info.value),
        "_ng_failure_http_status": status,
        "_ng_failure_response_body": body,
    }


async def test_connection_refused_failure_row(helper_of: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    cfg = make_config(env_port=dead_port)
    helper = helper_of(cfg, connect_retries=0)
    it = helper.run_examples([row(0)], route_failures_to_sidecar=True)
    [(_, failure)] = [await fut for fut in it]
    assert failure["_ng_failure_class"] == "agent_request_failed"
    assert failure["_ng_failure_type"] == "ServerConnectionError"
    assert failure["_ng_failure_http_status"] is None
    assert failure["_ng_failure_response_body"] is None
    assert f"127.0.0.1:{dead_port}" in failure["_ng_failure_message"]


async def test_record_unrouted_failures(instant: Deployment, helper_of: Any) -> None:
    helper = helper_of(instant)
    it = helper.run_examples([row(0, fault="500")], record_unrouted_failures=True)
    [(_, evidence)] = [await fut for fut in it]
    assert evidence["_ng_failure_class"] == "agent_run_error"
    assert evidence["run_error"] == "ServerHTTPError: " + evidence["_ng_failure_message"]
    recorded: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def record(r: dict[str, Any], failure: dict[str, Any]) -> None:
        recorded.append((r, failure))

    it = helper.run_examples([row(0, fault="500")], record_unrouted_failures=True, record_failure=record)
    with pytest.raises(ServerHTTPError):
        await consume_all(it)
    assert [f for _, f in recorded] == [evidence]


@pytest.mark.parametrize(
    ("retry", "expected"), [pytest.param(False, 1, id="no_replay"), pytest.param(True, 3, id="replayed")]
)
async def test_retry_requests_false_never_replays_run(
    instant: Deployment, helper_of: Any, retry: bool, expected: int
) -> None:
    it = helper_of(instant).run_examples(
        [row(0, fault="disconnect")], route_failures_to_sidecar=True, retry_requests=retry
    )
    [(_, failure)] = [await fut for fut in it]
    assert failure["_ng_failure_class"] == "agent_request_failed"
    assert instant.stats("env").request_counts == {(0, 0): expected}


# --- dispatch budget --------------------------------------------------------------------------------


async def test_budget_exhausted_drains_every_row(instant: Deployment, helper_of: Any) -> None:
    it = helper_of(instant).run_examples([row(0), row(1)], dispatch_budget_s=0)
    results = [res for _, res in [await fut for fut in it]]
    assert (
        results
        == [
            {
                "_ng_failure_class": "cancelled",
                "_ng_no_persist": True,
                "_ng_dispatch_drained": True,
                "error_message": "not dispatched: dispatch budget exhausted",
            }
        ]
        * 2
    )
    assert instant.stats("env").requests == 0
    assert it.stats().drained == 2


async def test_drain_margin_drains_rows_that_would_not_finish(instant: Deployment, helper_of: Any) -> None:
    now = [1000.0]
    helper = helper_of(instant, clock=lambda: now[0])
    it = helper.run_examples([row(0)], dispatch_budget_s=50, drain_margin_s=100)
    [(_, res)] = [await fut for fut in it]
    assert res == {
        "_ng_failure_class": "cancelled",
        "_ng_no_persist": True,
        "_ng_dispatch_drained": True,
        "error_message": "not dispatched: 50s left in dispatch budget, below the 100s drain margin",
    }
    assert instant.stats("env").requests == 0


@pytest.mark.parametrize(
    ("samples", "configured", "expected"),
    [
        pytest.param([1, 2, 3, 4], None, None, id="four_samples"),
        pytest.param([1, 2, 3, 4, 10], None, 4.0, id="p75_of_five"),
        pytest.param([1, 2, 3, 4, 10], 7.5, 7.5, id="explicit_wins"),
        pytest.param([0, -1, 1, 2, 3, 4], None, None, id="non_positive_ignored"),
    ],
)
def test_latency_tracker_drain_margin(samples: list[float], configured: Any, expected: Any) -> None:
    tracker = LatencyTracker()
    for s in samples:
        tracker.record(s)
    assert tracker.drain_margin(configured) == expected


def test_latency_tracker_histogram_mode_stays_close() -> None:
    tracker = LatencyTracker(exact_limit=100)
    for i in range(1, 10_001):
        tracker.record(i / 1000)
    p50 = tracker.quantile(0.5)
    assert p50 is not None
    assert abs(p50 - 5.0005) / 5.0 < 0.01


# --- run_outcomes and internal dispatch -------------------------------------------------------------


async def test_run_outcomes_copies_rows_and_types_failures(instant: Deployment, helper_of: Any) -> None:
    rows = [row(0), row(1, fault="500"), row(2, _ng_run_id="mine")]
    it = helper_of(instant).run_outcomes(rows, retry_requests=False)
    got = {r["_ng_task_index"]: (r, out) async for r, out in it}
    assert rows == [row(0), row(1, fault="500"), row(2, _ng_run_id="mine")]  # inputs untouched
    assert got[0][0] is not rows[0]
    invocation = got[0][0]["_ng_run_id"]
    assert got[1][0]["_ng_run_id"] == invocation
    assert len(invocation) == 32
    assert got[2][0]["_ng_run_id"] == "mine"
    ok = got[0][1]
    assert ok["reward"] == 1.0
    assert {k: ok[k] for k in ("_ng_task_index", "_ng_rollout_index", "agent_ref", "_ng_run_id")} == {
        "_ng_task_index": 0,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "agent"},
        "_ng_run_id": invocation,
    }
    assert ok["_ng_environment_server"] == "env"
    assert ok["_ng_result_type"] == "example_env"
    failure = got[1][1]
    assert isinstance(failure, RolloutFailureRecord)
    assert (failure.failure_class, failure.http_status, failure.task_index, failure.run_id) == (
        "agent_run_error",
        500,
        1,
        invocation,
    )
    it2 = helper_of(instant).run_outcomes([row(3, _ng_run_id="old")], run_id="forced")
    assert [r["_ng_run_id"] async for r, _ in it2] == ["forced"]


async def test_internal_dispatch_yields_completed_rollouts(instant: Deployment) -> None:
    topology = Topology.from_config(instant.config)
    from gym_ray.dispatch.client import ServerClient

    episode_fail = {
        "task_id": {"taskset": "arith", "task_id": "x"},
        "task_input": {"responses_create_params": {"input": "?"}, "force_failure": "nope"},
        "_ng_task_index": 9,
        "_ng_rollout_index": 0,
    }
    async with ServerClient(topology) as client:
        started = time.perf_counter()
        it = dispatch([row(0), episode_fail], client, topology, max_resident_tasks=2)
        outcomes = {r["_ng_task_index"]: o async for r, o in it}
        wall_ms = (time.perf_counter() - started) * 1000.0
        await it.aclose()
    done = outcomes[0]
    assert isinstance(done, CompletedRollout)
    assert done.result["reward"] == 1.0
    assert keys.RESULT_TYPE not in done.result
    # the /run's own latency: measured inside the dispatch, so within the wall time around it
    assert done.rollout_latency_ms is not None
    assert 0 < done.rollout_latency_ms <= wall_ms
    assert (done.environment_server, done.environment_server_type) == ("env", "example_env")
    failed = outcomes[9]
    assert isinstance(failed, RolloutFailureRecord)
    assert (failed.failure_class, failed.terminal, failed.message, failed.stage) == (
        "environment_server_failed",
        True,
        "nope",
        "agent",
    )
    assert it.stats().completed == 1
    assert it.stats().failed == 1
    assert it.stats().admitted == 2
