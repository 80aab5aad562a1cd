"""One retry ladder per rollout (the engine's), counted once, for streams and collection alike.

Real parts: the reference servers on 127.0.0.1 (their ``fault`` row field makes a ``/run`` hang or answer
503) and the real HTTP client; the engine runs with a ``ServerHealth`` as collection and streams run it.
The server's own request counts are what the failure records must state.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import dispatch
from gym_ray.dispatch.health import ServerHealth
from gym_ray.dispatch.ladder import RESEND_BACKOFF_CAP_S
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord
from gym_ray.servers import serve_config
from tests.dispatch.test_dispatch import make_config, row

TIMEOUT_S = 1.0


async def _collect(rows: list[dict[str, Any]], client: ServerClient, topology: Topology, **kw: Any) -> dict:
    out: dict[int, tuple[Any, float]] = {}
    started = time.monotonic()
    async with ServerHealth(client) as health:
        it = dispatch(rows, client, topology, health=health, route_failures_to_sidecar=True, **kw)
        try:
            async for item in it:
                r, outcome = item
                out[r[keys.TASK_INDEX]] = (outcome, time.monotonic() - started)
        finally:
            await it.aclose()
    return out


async def test_a_hung_run_is_sent_three_times_and_its_record_says_so_within_the_bound() -> None:
    rows = [row(0), row(1, fault="hang"), row(2)]
    async with serve_config(make_config()) as dep:
        topology = Topology.from_config(dep.config)
        async with ServerClient(topology, request_timeout_s=TIMEOUT_S) as client:
            out = await _collect(rows, client, topology)
        counts = dep.stats("env").request_counts
    assert isinstance(out[0][0], CompletedRollout)
    assert isinstance(out[2][0], CompletedRollout)
    record, elapsed = out[1]
    assert isinstance(record, RolloutFailureRecord)
    # the client's max_request_retries=2: the first send and two replays, nothing multiplied
    assert counts == {(0, 0): 1, (1, 0): 3, (2, 0): 1}
    assert record.requests == 3
    assert record.request_errors == ("timeout", "timeout", "timeout")
    assert record.failure_class == keys.FailureClass.AGENT_REQUEST_FAILED
    assert record.message.startswith(
        f"no reply from {dep.url_of('env')}/run within the request timeout ({TIMEOUT_S} s) after 3 attempt(s)"
    )
    sidecar = record.to_row()
    assert (sidecar[keys.FAILURE_REQUESTS], sidecar[keys.FAILURE_REQUEST_ERRORS]) == (3, ["timeout"] * 3)
    # the documented worst case: timeout x 3 + two backoffs (each at most 1 s with the defaults) + probes
    assert 3 * TIMEOUT_S <= elapsed < 3 * TIMEOUT_S + 2 * 1.0 + 2.0


async def test_with_retry_requests_false_a_hung_run_is_sent_once() -> None:
    async with serve_config(make_config()) as dep:
        topology = Topology.from_config(dep.config)
        async with ServerClient(topology, request_timeout_s=TIMEOUT_S) as client:
            out = await _collect([row(0, fault="hang")], client, topology, retry_requests=False)
        counts = dep.stats("env").request_counts
    record, _ = out[0]
    assert isinstance(record, RolloutFailureRecord)
    assert counts == {(0, 0): 1}
    assert (record.requests, record.request_errors) == (1, ("timeout",))
    assert "after 1 attempt(s)" in record.message


async def test_a_gateway_error_is_resent_by_the_engine_alone() -> None:
    # 503 is an infrastructure failure: resent on the engine's budget (max_infra_retries), each resend one
    # request. The client's own replays (max_request_retries=2) used to multiply it: 3 x 3 = 9 requests.
    async with serve_config(make_config()) as dep:
        topology = Topology.from_config(dep.config)
        async with ServerClient(topology, backoff_base_s=0.01) as client:
            out = await _collect([row(0, fault="503")], client, topology, max_infra_retries=2)
        counts = dep.stats("env").request_counts
    record, _ = out[0]
    assert isinstance(record, RolloutFailureRecord)
    assert record.http_status == 503
    assert counts == {(0, 0): 3}
    assert (record.requests, record.request_errors) == (3, ("http_503",) * 3)
    assert "after 3 attempt(s)" in record.message


async def test_an_answered_error_is_not_resent_and_counts_one_request() -> None:
    async with serve_config(make_config()) as dep:
        topology = Topology.from_config(dep.config)
        async with ServerClient(topology) as client:
            out = await _collect([row(0, fault="500")], client, topology)
        counts = dep.stats("env").request_counts
    record, _ = out[0]
    assert isinstance(record, RolloutFailureRecord)
    assert counts == {(0, 0): 1}
    assert (record.requests, record.request_errors) == (1, ("http_500",))


@pytest.mark.parametrize("index", [0, 1, 5, 50])
def test_resend_backoff_doubles_and_stays_under_its_cap(index: int) -> None:
    client = ServerClient(backoff_base_s=0.5)
    expected_top = min(RESEND_BACKOFF_CAP_S, 0.5 * 2**index)
    delays = [client.backoff.delay(index, cap_s=RESEND_BACKOFF_CAP_S) for _ in range(200)]
    assert all(expected_top / 2 <= d <= expected_top for d in delays)
