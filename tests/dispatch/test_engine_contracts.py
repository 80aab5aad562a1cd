"""The dispatch engine's own contract, pinned where mutation testing found the suite blind.

Pure parts (``LatencyTracker``, ``episode_request_body``, ``interleave_by_agent``) are checked against values
computed by hand; the rest goes through :func:`~gym_ray.dispatch.engine.dispatch` against the reference
servers on 127.0.0.1, whose request counters (which rows, how many times, in what order) are the oracle.
Every test takes milliseconds to a second.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import (
    INTERLEAVE_WINDOW,
    DispatchStats,
    LatencyTracker,
    dispatch,
    episode_request_body,
    interleave_by_agent,
)
from gym_ray.dispatch.health import ServerHealth
from gym_ray.dispatch.helper import RolloutCollectionHelper
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord
from gym_ray.errors import (
    InputError,
    RoutingError,
    ServerConnectionError,
    ServerHTTPError,
    ServerResponseError,
)
from gym_ray.observe.tracing import TracingSettings, setup_tracing, shutdown_tracing
from gym_ray.servers import serve_config
from gym_ray.servers.launch import Deployment
from tests.dispatch.test_dispatch import make_config, row
from tests.dispatch.test_health import FakeTime

# every test here takes under a second; a mutant that makes a resend loop spin is cut short
pytestmark = pytest.mark.timeout(30)

DRAINED_BY_BUDGET = {
    keys.FAILURE_CLASS: "cancelled",
    keys.NO_PERSIST: True,
    keys.DISPATCH_DRAINED: True,
    keys.ERROR_MESSAGE: "not dispatched: dispatch budget exhausted",
}


@pytest.fixture
async def env() -> AsyncIterator[Deployment]:
    async with serve_config(make_config(0)) as dep:
        yield dep


@pytest.fixture
async def wired(env: Deployment) -> AsyncIterator[tuple[Deployment, Topology, ServerClient]]:
    topology = Topology.from_config(env.config)
    # fast replays: a replayed /run waits 10 ms, 20 ms (not 0.5 s, 1 s)
    async with ServerClient(topology, backoff_base_s=0.01) as client:
        yield env, topology, client


def task_row(i: int, *, taskset: str = "arith", **extra: Any) -> dict[str, Any]:
    """A materialized task row (routed by its taskset: ``arith`` goes to ``env``)."""
    return {
        keys.TASK_ID: {keys.TASKSET: taskset, "task_id": f"t{i}"},
        keys.TASK_INPUT: {
            "responses_create_params": {"input": f"What is {i} + 1?"},
            "expected_answer": str(i + 1),
        },
        keys.TASK_INDEX: i,
        keys.ROLLOUT_INDEX: 0,
        **extra,
    }


async def outcomes_of(it: Any) -> list[tuple[dict[str, Any], Any]]:
    try:
        return [await fut for fut in it]
    finally:
        await it.aclose()


# --- LatencyTracker: exact quantiles, the histogram past exact_limit, the margin's refresh -----------


def test_exact_quantiles_interpolate_between_the_sorted_samples() -> None:
    tracker = LatencyTracker()
    assert (tracker.count, tracker.quantile(0.5), tracker.drain_margin(None)) == (0, None, None)
    for s in (4.0, 1.0, 3.0, 2.0):  # out of order: the tracker sorts
        tracker.record(s)
    # position (n-1)*q = 3q in [1, 2, 3, 4], linear between neighbours
    assert tracker.count == 4
    assert [tracker.quantile(q) for q in (0.0, 0.5, 0.75, 1.0)] == [1.0, 2.5, 3.25, 4.0]
    assert tracker.quantile(0.99) == pytest.approx(3.97)


def test_the_histogram_starts_at_the_sample_past_exact_limit_with_one_percent_buckets() -> None:
    tracker = LatencyTracker(exact_limit=3)
    for s in (1.0, 2.0, 3.0):
        tracker.record(s)
    assert tracker.quantile(0.5) == 2.0  # still exact: 3 samples, limit 3
    tracker.record(4.0)
    # buckets of 1 % width: a value v falls in floor(log(v) / log(1.01)); a quantile is its bucket's middle,
    # 1.01 ** (index + 0.5). 1.0 -> 0, 2.0 -> 69, 3.0 -> 110, 4.0 -> 139 (log(2)/log(1.01) = 69.66 ...).
    # The q quantile is the first bucket whose running count exceeds (n-1)*q.
    assert tracker.count == 4
    assert tracker.quantile(0.0) == pytest.approx(1.01**0.5, rel=1e-12)
    assert tracker.quantile(1 / 3) == pytest.approx(1.01**69.5, rel=1e-12)  # (n-1)*q = 1: past bucket 0
    assert tracker.quantile(0.5) == pytest.approx(1.01**69.5, rel=1e-12)
    assert tracker.quantile(0.75) == pytest.approx(1.01**110.5, rel=1e-12)
    assert tracker.quantile(1.0) == pytest.approx(1.01**139.5, rel=1e-12)


def test_the_default_tracker_is_exact_for_4096_samples() -> None:
    tracker = LatencyTracker()
    for i in range(1, 4097):
        tracker.record(i / 1000)
    assert tracker.quantile(0.0) == 0.001  # exact
    tracker.record(5.0)
    # the 4097th sample turns on the histogram: 0.001 lies in bucket floor(-694.2) = -695
    assert tracker.quantile(0.0) == pytest.approx(1.01**-694.5, rel=1e-12)
    assert tracker.quantile(0.0) != 0.001


def test_the_adaptive_margin_follows_every_sample_while_exact_and_every_64th_in_the_histogram() -> None:
    exact = LatencyTracker()
    for s in (1.0, 2.0, 3.0, 4.0, 10.0):
        exact.record(s)
    assert exact.drain_margin(None) == 4.0  # p75 of 5
    exact.record(10.0)
    assert exact.drain_margin(None) == 8.5  # p75 of 6: position 3.75 between 4 and 10
    assert exact.drain_margin(2.0) == 2.0  # an explicit margin wins

    hist = LatencyTracker(exact_limit=4)
    for _ in range(5):
        hist.record(1.0)
    first = hist.drain_margin(None)
    assert first == pytest.approx(1.01**0.5, rel=1e-12)
    for _ in range(58):
        hist.record(10.0)
    assert hist.count == 63
    assert hist.drain_margin(None) == first  # kept until the 64th sample
    hist.record(10.0)
    # 64 samples, 59 of them 10.0: p75 is in 10.0's bucket, floor(log(10) / log(1.01)) = 231
    assert hist.drain_margin(None) == pytest.approx(1.01**231.5, rel=1e-12)


# --- episode_request_body ---------------------------------------------------------------------------


def test_an_episode_body_carries_the_rows_rollout_id_and_attempt() -> None:
    row_ = task_row(3, **{keys.ROLLOUT_ID: "my-id", keys.ATTEMPT_INDEX: 2})
    assert episode_request_body(row_) == {
        "episode_id": {"rollout_id": "my-id", "attempt": 2},
        "task": {"task_id": {"taskset": "arith", "task_id": "t3"}, "task_input": row_[keys.TASK_INPUT]},
    }


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="no-id-no-attempt"),
        pytest.param({keys.ROLLOUT_ID: "", keys.ATTEMPT_INDEX: None}, id="empty-id-null-attempt"),
    ],
)
def test_an_episode_body_without_a_rollout_id_uses_task_and_rollout_indices(extra: dict[str, Any]) -> None:
    row_ = {**task_row(3), keys.ROLLOUT_INDEX: 1, **extra}
    assert episode_request_body(row_)["episode_id"] == {"rollout_id": "3-1", "attempt": 0}


@pytest.mark.parametrize("attempt", [-1, True, "1", 1.0])
def test_an_episode_body_refuses_an_attempt_that_is_not_an_int_of_at_least_0(attempt: Any) -> None:
    with pytest.raises(InputError) as info:
        episode_request_body(task_row(3, **{keys.ATTEMPT_INDEX: attempt}))
    assert str(info.value) == (
        f"materialized row {{'taskset': 'arith', 'task_id': 't3'}} has _ng_attempt_index={attempt!r}; "
        "it must be an int >= 0 (leave it out on a first attempt)"
    )


@pytest.mark.parametrize(
    ("missing", "indices"), [(keys.TASK_INDEX, "(None, 0)"), (keys.ROLLOUT_INDEX, "(3, None)")]
)
def test_an_episode_body_refuses_a_row_without_rollout_id_nor_indices(missing: str, indices: str) -> None:
    row_ = task_row(3)
    del row_[missing]
    with pytest.raises(InputError) as info:
        episode_request_body(row_)
    assert str(info.value) == (
        "materialized row {'taskset': 'arith', 'task_id': 't3'} has no _ng_rollout_id and no "
        f"_ng_task_index/_ng_rollout_index {indices}; run preprocess_examples first or give it an explicit "
        "rollout id"
    )


# --- interleave_by_agent ----------------------------------------------------------------------------


def test_interleave_groups_by_agent_then_taskset_then_server_and_keeps_other_items_in_order() -> None:
    rows: list[Any] = [
        {"agent_ref": {"name": "a"}, "i": 0},
        {"agent_ref": {"name": "a"}, "i": 1},
        {keys.TASK_ID: {keys.TASKSET: "s1"}, "i": 2},
        {keys.TASK_ID: {keys.TASKSET: "s1"}, "i": 3},
        {keys.TASK_ID: {keys.TASKSET: "s2"}, "i": 4},
        {keys.ENVIRONMENT_SERVER: "e1", "i": 5},
        {keys.ENVIRONMENT_SERVER: "e2", "i": 6},
        {keys.ENVIRONMENT_SERVER: "e2", "i": 7},
        {"agent_ref": "not-a-mapping", keys.ENVIRONMENT_SERVER: "e1", "i": 8},
    ]
    # groups in order of first appearance: a [0, 1], s1 [2, 3], s2 [4], e1 [5, 8], e2 [6, 7]
    assert [r["i"] for r in interleave_by_agent(rows)] == [0, 2, 4, 5, 6, 1, 3, 8, 7]
    assert list(interleave_by_agent(iter([3, 1, 2]))) == [3, 1, 2]  # not rows: one group, order kept
    assert list(interleave_by_agent([])) == []


def test_interleave_works_in_windows_of_4096_rows() -> None:
    assert INTERLEAVE_WINDOW == 4096

    def agents(names: str) -> list[dict[str, Any]]:
        return [{"agent_ref": {"name": a}, "i": i} for i, a in enumerate(names)]

    # the first window is agent a alone; the second round-robins a and b
    rows = agents("a" * 4096 + "bab")
    assert [r["i"] for r in interleave_by_agent(rows)] == [*range(4096), 4096, 4097, 4098]
    # b is the 4096th row: in the first window, right after a's first row; a's row 4096 comes last
    rows = agents("a" * 4095 + "ba")
    assert [r["i"] for r in interleave_by_agent(rows)] == [0, 4095, *range(1, 4095), 4096]


# --- dispatch(): defaults, drained rows, failures, stats --------------------------------------------


async def test_dispatch_defaults_keep_input_order_replay_and_raise_a_failed_run(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    rows = [row(0), task_row(1), row(2), task_row(3)]
    done = await outcomes_of(dispatch(rows, client, topology, max_resident_tasks=1))
    assert all(r is sent and o.row is sent for (r, o), sent in zip(done, rows, strict=True))
    assert list(dep.stats("env").request_counts) == [(0, 0), (1, 0), (2, 0), (3, 0)]  # not interleaved
    # retry_requests defaults to True: a dropped connection is replayed (2 retries of the client)
    dropped = dispatch([row(4, fault="disconnect")], client, topology)
    with pytest.raises(ServerConnectionError):
        await outcomes_of(dropped)
    assert dep.stats("env").request_counts[(4, 0)] == 3
    # routing failures to the sidecar is off by default: a failed /run raises in its consumer
    with pytest.raises(ServerHTTPError):
        await outcomes_of(dispatch([row(5, fault="500")], client, topology))
    assert dep.stats("env").request_counts[(5, 0)] == 1


@pytest.mark.parametrize(
    ("bound", "sem", "expected"),
    [pytest.param(2, None, 2, id="max_resident_tasks"), pytest.param(None, 3, 3, id="semaphore")],
)
async def test_dispatch_keeps_the_server_within_its_bound(
    bound: int | None, sem: int | None, expected: int
) -> None:
    async with serve_config(make_config(30)) as dep:  # 30 ms per /run: unbounded rows would overlap
        topology = Topology.from_config(dep.config)
        semaphore = asyncio.Semaphore(sem) if sem else None
        async with ServerClient(topology) as client:
            it = dispatch(
                [row(i) for i in range(8)], client, topology, max_resident_tasks=bound, semaphore=semaphore
            )
            done = await outcomes_of(it)
        assert len(done) == 8
        assert dep.stats("env").max_in_flight == expected
        assert dep.stats("env").request_counts == {(i, 0): 1 for i in range(8)}


async def test_dispatch_interleaves_agents_and_tasksets_when_asked(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    rows = [row(0), row(1), task_row(2), task_row(3)]
    done = await outcomes_of(dispatch(rows, client, topology, max_resident_tasks=1, interleave=True))
    assert len(done) == 4
    assert list(dep.stats("env").request_counts) == [(0, 0), (2, 0), (1, 0), (3, 0)]


async def test_dispatch_without_replay_sends_a_dropped_run_once(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    it = dispatch(
        [row(0, fault="disconnect")], client, topology, retry_requests=False, route_failures_to_sidecar=True
    )
    [(_, failure)] = await outcomes_of(it)
    assert isinstance(failure, RolloutFailureRecord)
    assert (failure.failure_class, failure.environment_server, failure.task_index) == (
        "agent_request_failed",
        "env",
        0,
    )
    assert dep.stats("env").request_counts == {(0, 0): 1}


async def test_a_row_stamped_with_a_server_that_is_not_an_environment_server_is_not_sent(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    # "agent" is an instance of the config (an agent server), not an environment server
    it = dispatch([row(0, _ng_environment_server="agent")], client, topology, route_failures_to_sidecar=True)
    with pytest.raises(
        RoutingError, match="_ng_environment_server='agent', which is not an environment server"
    ):
        await outcomes_of(it)
    assert dep.stats("env").requests == 0
    assert dep.stats("agent").requests == 0


async def test_a_budget_that_is_exactly_spent_drains_every_row_with_its_server(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    it = dispatch([row(0), task_row(1)], client, topology, dispatch_budget_s=0, clock=lambda: 5.0)
    done = await outcomes_of(it)
    assert [o for _, o in done] == [
        CompletedRollout(row(0), DRAINED_BY_BUDGET, None, "env", "example_env"),
        CompletedRollout(task_row(1), DRAINED_BY_BUDGET, None, "env", "example_env"),
    ]
    assert dep.stats("env").requests == 0
    assert it.stats() == DispatchStats(0, 2, 2, 0, 0, None, None)


@pytest.mark.parametrize(
    ("budget", "margin"),
    [pytest.param(30, 30, id="exactly-the-margin-left"), pytest.param(0.5, None, id="half-a-second-left")],
)
async def test_a_row_with_budget_left_and_not_less_than_the_margin_is_sent(
    wired: tuple[Deployment, Topology, ServerClient], budget: float, margin: float | None
) -> None:
    dep, topology, client = wired
    it = dispatch(
        [row(0)], client, topology, dispatch_budget_s=budget, drain_margin_s=margin, clock=lambda: 5.0
    )
    [(_, done)] = await outcomes_of(it)
    assert done.result["reward"] == 1.0
    assert dep.stats("env").request_counts == {(0, 0): 1}
    assert it.stats().drained == 0


async def test_drained_rows_of_run_outcomes_are_records_with_server_and_type(env: Deployment) -> None:
    helper = RolloutCollectionHelper(env.config, clock=lambda: 5.0)
    try:
        it = helper.run_outcomes([row(0)], run_id="r1", dispatch_budget_s=0)
        [(_, record)] = await outcomes_of(it)
    finally:
        await helper.aclose()
    assert {k: record[k] for k in DRAINED_BY_BUDGET} == DRAINED_BY_BUDGET
    assert (record[keys.ENVIRONMENT_SERVER], record[keys.RESULT_TYPE], record[keys.TASK_INDEX]) == (
        "env",
        "example_env",
        0,
    )
    assert env.stats("env").requests == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("dispatch_budget_s", -1),
        ("dispatch_budget_s", True),
        ("dispatch_budget_s", math.nan),
        ("drain_margin_s", -0.5),
        ("drain_margin_s", False),
    ],
)
async def test_a_budget_or_margin_that_is_not_a_number_of_at_least_0_is_refused(
    wired: tuple[Deployment, Topology, ServerClient], name: str, value: Any
) -> None:
    _, topology, client = wired
    with pytest.raises(InputError) as info:
        dispatch([row(0)], client, topology, **{name: value})
    assert str(info.value) == f"{name}={value!r} must be a number >= 0 seconds, or None for no limit"


async def test_an_unrouted_failure_without_a_recorder_resolves_to_its_record_with_run_error(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    it = dispatch([row(0, fault="500")], client, topology, record_unrouted_failures=True)
    [(_, record)] = await outcomes_of(it)
    assert isinstance(record, RolloutFailureRecord)
    assert (record.failure_class, record.http_status, record.task_index) == ("agent_run_error", 500, 0)
    assert record.to_row()["run_error"] == "ServerHTTPError: " + record.message
    assert it.stats().failed == 1
    assert dep.stats("env").request_counts == {(0, 0): 1}


async def test_a_plain_function_recorder_gets_the_failure_row_before_the_error_is_raised(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    _, topology, client = wired
    recorded: list[tuple[dict[str, Any], dict[str, Any]]] = []
    the_row = row(0, fault="500")
    it = dispatch(
        [the_row],
        client,
        topology,
        record_unrouted_failures=True,
        record_failure=lambda r, failure: recorded.append((r, failure)),  # returns None: nothing to await
    )
    with pytest.raises(ServerHTTPError) as info:
        await outcomes_of(it)
    [(r, failure)] = recorded
    assert r is the_row
    assert failure[keys.FAILURE_CLASS] == "agent_run_error"
    assert failure[keys.FAILURE_HTTP_STATUS] == 500
    assert failure["run_error"] == f"ServerHTTPError: {info.value}"
    assert (failure[keys.TASK_INDEX], failure[keys.ENVIRONMENT_SERVER]) == (0, "env")


async def test_run_examples_hands_a_recorder_only_the_failure_fields_and_run_error(env: Deployment) -> None:
    recorded: list[dict[str, Any]] = []
    helper = RolloutCollectionHelper(env.config)
    try:
        it = helper.run_examples(
            [row(0, fault="500")],
            record_unrouted_failures=True,
            record_failure=lambda r, f: recorded.append(f),
        )
        with pytest.raises(ServerHTTPError) as info:
            await outcomes_of(it)
    finally:
        await helper.aclose()
    assert recorded == [
        {
            keys.FAILURE_CLASS: "agent_run_error",
            keys.FAILURE_TYPE: "ServerHTTPError",
            keys.FAILURE_MESSAGE: str(info.value),
            keys.FAILURE_HTTP_STATUS: 500,
            keys.FAILURE_RESPONSE_BODY: '{"error": "injected fault: HTTP 500"}',
            "run_error": f"ServerHTTPError: {info.value}",
        }
    ]


def two_env_config() -> dict[str, Any]:
    """``env`` fronts the agent ``agent``; ``env2`` serves the taskset ``arith``."""
    config = make_config(0)
    config["env2"] = {"environment_servers": {"example_env": {"host": "127.0.0.1", "port": 0}}}
    config["environment_server_routes"] = {"arith": "env2"}
    return config


async def test_each_row_goes_to_its_stamp_else_its_taskset_else_its_agents_front() -> None:
    async with serve_config(two_env_config()) as dep:
        topology = Topology.from_config(dep.config)
        rows = [
            row(0, _ng_environment_server="env2"),  # the stamp wins over the agent's front (env)
            row(1),  # the agent's front
            task_row(2),  # the taskset's route
            row(3, _ng_environment_server="env"),
            task_row(4, **{keys.ENVIRONMENT_SERVER: "env"}),  # the stamp wins over the taskset's route
            row(5),
        ]
        async with ServerClient(topology) as client:
            done = await outcomes_of(dispatch(rows, client, topology, max_resident_tasks=1))
        assert [(r[keys.TASK_INDEX], o.environment_server) for r, o in done] == [
            (0, "env2"),
            (1, "env"),
            (2, "env2"),
            (3, "env"),
            (4, "env"),
            (5, "env"),
        ]
        assert list(dep.stats("env").request_counts) == [(1, 0), (3, 0), (4, 0), (5, 0)]
        assert list(dep.stats("env2").request_counts) == [(0, 0), (2, 0)]


async def test_stats_count_every_outcome_and_give_latency_percentiles_of_the_successes(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    _, topology, client = wired
    rows = [row(i) for i in range(6)] + [row(6, fault="500"), row(7, fault="truncated")]
    it = dispatch(rows, client, topology, max_resident_tasks=2, route_failures_to_sidecar=True)
    done = await outcomes_of(it)
    latencies = sorted(o.rollout_latency_ms for _, o in done if isinstance(o, CompletedRollout))
    assert len(latencies) == 6
    stats = it.stats()
    assert (stats.in_flight, stats.admitted, stats.drained, stats.failed, stats.completed) == (0, 8, 0, 2, 6)
    # the oracle: linear interpolation at (n-1)*q over the per-row latencies the dispatch reported
    p50, p99 = (statistics.quantiles(latencies, n=100, method="inclusive")[k - 1] for k in (50, 99))
    assert stats.p50_latency_ms == pytest.approx(p50, rel=1e-9)
    assert stats.p99_latency_ms == pytest.approx(p99, rel=1e-9)


async def test_an_episode_failure_is_counted_failed_not_completed(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, client = wired
    episode_failure = task_row(9)
    episode_failure[keys.TASK_INPUT] = {**episode_failure[keys.TASK_INPUT], "force_failure": "nope"}
    second = {**episode_failure, keys.TASK_INDEX: 8}
    it = dispatch([episode_failure, row(1), second], client, topology, max_resident_tasks=1)
    done = dict((r[keys.TASK_INDEX], o) for r, o in await outcomes_of(it))
    assert isinstance(done[1], CompletedRollout)
    for i in (8, 9):
        assert isinstance(done[i], RolloutFailureRecord)
        assert (done[i].task_index, done[i].environment_server) == (i, "env")
    assert (it.stats().failed, it.stats().completed) == (2, 1)
    assert dep.stats("env").request_counts == {(9, 0): 1, (1, 0): 1, (8, 0): 1}
    # the percentiles are of successful rollouts only: the one success's own latency
    success = done[1]
    assert isinstance(success, CompletedRollout)
    assert it.stats().p50_latency_ms == it.stats().p99_latency_ms == success.rollout_latency_ms


async def test_stats_of_a_helper_iterator_are_zero_before_it_is_prepared(env: Deployment) -> None:
    helper = RolloutCollectionHelper(env.config)
    try:
        it = helper.run_examples([row(0)])
        assert it.stats() == DispatchStats(0, 0, 0, 0, 0, None, None)
        await outcomes_of(it)
        assert (it.stats().admitted, it.stats().completed) == (1, 1)
    finally:
        await helper.aclose()


# --- with ServerHealth: the semaphore per attempt, the default resend budget -------------------------


async def test_with_health_a_semaphore_bounds_each_attempt_and_never_deadlocks() -> None:
    time = FakeTime()
    async with (
        serve_config(make_config(30)) as dep,  # 30 ms per /run: unbounded rows would overlap
        ServerClient(topology := Topology.from_config(dep.config), sleep=time.sleep) as client,
        ServerHealth(client, clock=time.clock, sleep=time.sleep) as health,
    ):
        it = dispatch(
            [row(i) for i in range(4)], client, topology, semaphore=asyncio.Semaphore(1), health=health
        )
        async with asyncio.timeout(20):
            done = await outcomes_of(it)
    assert sorted(r[keys.TASK_INDEX] for r, _ in done) == [0, 1, 2, 3]
    assert dep.stats("env").max_in_flight == 1
    assert dep.stats("env").request_counts == {(i, 0): 1 for i in range(4)}


async def test_with_health_an_infrastructure_failure_is_resent_10_times_by_default(
    wired: tuple[Deployment, Topology, ServerClient],
) -> None:
    dep, topology, _ = wired
    time = FakeTime()
    async with (
        ServerClient(topology, max_request_retries=0, sleep=time.sleep) as client,
        ServerHealth(client, clock=time.clock, sleep=time.sleep) as health,
    ):
        it = dispatch([row(0, fault="429")], client, topology, health=health, route_failures_to_sidecar=True)
        async with asyncio.timeout(5):  # 11 sends take milliseconds; a resend loop that never ends fails here
            [(_, failure)] = await outcomes_of(it)
    assert isinstance(failure, RolloutFailureRecord)
    assert failure.http_status == 429
    assert dep.stats("env").request_counts == {(0, 0): 11}  # the first send and 10 resends


@pytest.mark.parametrize(
    "between",
    [
        pytest.param({}, id="a-result"),
        pytest.param({"fault": "500"}, id="an-error-reply"),
    ],
)
async def test_with_health_any_answer_between_dropped_connections_resets_the_failure_streak(
    wired: tuple[Deployment, Topology, ServerClient], between: dict[str, Any]
) -> None:
    # drop, answer, drop, answer, drop: three infrastructure failures, but never 3 in a row (down_after=3),
    # so the server is never judged down (no probe, no outage)
    dep, topology, _ = wired
    time = FakeTime()
    rows = [row(i, **({"fault": "drop"} if i % 2 == 0 else between)) for i in range(5)]
    async with (
        ServerClient(topology, max_request_retries=0, sleep=time.sleep) as client,
        ServerHealth(client, clock=time.clock, sleep=time.sleep) as health,
    ):
        it = dispatch(
            rows,
            client,
            topology,
            max_resident_tasks=1,
            health=health,
            max_infra_retries=0,
            route_failures_to_sidecar=True,
        )
        done = await outcomes_of(it)
        sample = health.snapshot()["env"]
    assert [type(o).__name__ for _, o in done] == [
        "RolloutFailureRecord",
        "RolloutFailureRecord" if between else "CompletedRollout",
    ] * 2 + ["RolloutFailureRecord"]
    assert (sample.infra_failures, sample.outages, sample.state) == (3, 0, "up")
    assert time.sleeps == []
    assert dep.stats("env").request_counts == {(i, 0): 1 for i in range(5)}


async def test_a_long_reply_that_is_not_an_object_is_a_failure_with_a_marked_excerpt() -> None:
    # a server of our own on 127.0.0.1 that answers /run with a JSON list longer than an excerpt
    reply = [{"reward": 1.0, "i": i} for i in range(200)]
    text = json.dumps(reply)
    assert len(text) > 2000

    async def run(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(reply)

    app = web.Application()
    app.router.add_post("/run", run)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        topology = Topology.from_config(make_config(env_port=port))
        async with ServerClient(topology) as client:
            it = dispatch([row(0)], client, topology, route_failures_to_sidecar=True)
            [(_, failure)] = await outcomes_of(it)
            with pytest.raises(ServerResponseError) as info:
                await outcomes_of(dispatch([row(1)], client, topology))
    finally:
        await runner.cleanup()
    error = info.value
    assert (error.url, error.status, error.body_excerpt) == (
        f"http://127.0.0.1:{port}/run",
        200,
        text[:2000] + "…",
    )
    assert isinstance(failure, RolloutFailureRecord)
    assert failure.environment_server == "env"
    assert (failure.failure_class, failure.failure_type, failure.http_status) == (
        "agent_run_error",
        "ServerResponseError",
        200,
    )
    # cut at 2,000 characters and marked as cut, like every other body excerpt
    assert failure.response_body == text[:2000] + "…"
    assert failure.message == (
        f"POST http://127.0.0.1:{port}/run answered a JSON list, not an object; an environment server must "
        "reply with the result object"
    )


@pytest.mark.parametrize(
    ("retry", "sends"), [pytest.param(None, 3, id="default"), pytest.param(False, 1, id="off")]
)
async def test_a_traced_dispatch_replays_a_dropped_run_only_when_allowed(
    wired: tuple[Deployment, Topology, ServerClient], retry: bool | None, sends: int
) -> None:
    dep, topology, client = wired
    settings = TracingSettings(enabled=True, preset="default", exporter="memory")
    tracer = setup_tracing(settings, span_exporter=InMemorySpanExporter())
    assert tracer is not None
    try:
        options: dict[str, Any] = {} if retry is None else {"retry_requests": retry}
        it = dispatch(
            [row(0, fault="disconnect")],
            client,
            topology,
            tracer=tracer,
            route_failures_to_sidecar=True,
            **options,
        )
        [(_, failure)] = await outcomes_of(it)
    finally:
        shutdown_tracing()
    assert isinstance(failure, RolloutFailureRecord)
    assert dep.stats("env").request_counts == {(0, 0): sends}
