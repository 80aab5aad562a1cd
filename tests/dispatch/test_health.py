"""ServerHealth with the dispatch engine, against the reference servers on 127.0.0.1 (time is injected:
the health object's clock only moves when it sleeps, so every delay is an exact figure)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import dispatch
from gym_ray.dispatch.health import ServerHealth
from gym_ray.dispatch.outcomes import CompletedRollout, RolloutFailureRecord
from gym_ray.errors import ServerOutageError
from gym_ray.servers import serve_config
from tests.dispatch.test_dispatch import make_config, row


class FakeTime:
    """A clock that advances only by the sleeps awaited through it; ``on_sleep`` runs after each one."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[int], Awaitable[None]] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            await self.on_sleep(len(self.sleeps))
        await asyncio.sleep(0)


async def _outcomes(it: Any) -> list[Any]:
    results: list[Any] = []
    for item in it:
        try:
            results.append(await item)
        except ServerOutageError as exc:
            results.append(exc)
    await it.aclose()
    return results


async def test_retry_after_pauses_admission_and_429s_spend_the_infra_budget_not_attempts() -> None:
    async with serve_config(make_config()) as dep:  # a row with fault "429" gets Retry-After: 1
        topology = Topology.from_config(dep.config)
        time = FakeTime()
        async with (
            ServerClient(topology, max_request_retries=0, sleep=FakeTime().sleep) as client,
            ServerHealth(client, clock=time.clock, sleep=time.sleep) as health,
        ):
            it = dispatch(
                [row(0, fault="429")],
                client,
                topology,
                health=health,
                max_infra_retries=2,
                route_failures_to_sidecar=True,
            )
            ((_, outcome),) = await _outcomes(it)
            sample = health.snapshot()["env"]
        assert isinstance(outcome, RolloutFailureRecord)
        assert outcome.http_status == 429
        assert dep.stats("env").requests == 3  # the first send and max_infra_retries=2 resends
        assert time.sleeps == [1.0, 1.0]  # each resend waited out the Retry-After pause
        assert (sample.infra_failures, sample.outages) == (3, 0)  # a 429 is a live server: never "down"


async def test_a_stopped_server_holds_its_rows_back_until_a_probe_finds_it_back() -> None:
    async with serve_config(make_config()) as dep:
        topology = Topology.from_config(dep.config)
        time = FakeTime()

        async def restart_on_third_probe(count: int) -> None:
            if count == 3:
                await dep.restart_server("env")

        async with (
            ServerClient(topology, connect_retries=0, sleep=FakeTime().sleep) as client,
            ServerHealth(client, clock=time.clock, sleep=time.sleep, outage_timeout_s=60) as health,
        ):
            await dep.stop_server("env")
            time.on_sleep = restart_on_third_probe
            # down_after=3: a row can fail at most 3 times before its server looks down, so a budget of 3
            # resends is never spent by a pure outage
            it = dispatch([row(i) for i in range(6)], client, topology, health=health, max_infra_retries=3)
            outcomes = await _outcomes(it)
            sample = health.snapshot()["env"]
        assert sorted(r["_ng_task_index"] for r, _ in outcomes) == list(range(6))
        assert all(isinstance(o, CompletedRollout) for _, o in outcomes)
        assert dep.stats("env").requests == 6
        # probes after 0.25, 0.5 and 1 s of backoff; the third found the server back
        assert time.sleeps == [0.25, 0.5, 1.0]
        assert (sample.state, sample.outages) == ("up", 1)
        # every row's first send was refused; at most 2 resends happened before the 3rd failure marked it down
        assert 6 <= sample.infra_failures <= 8


async def test_a_server_down_past_the_outage_timeout_fails_its_rows_with_server_outage_error() -> None:
    async with serve_config(make_config()) as dep:
        topology = Topology.from_config(dep.config)
        url = dep.url_of("env")
        time = FakeTime()
        async with (
            ServerClient(topology, connect_retries=0, sleep=FakeTime().sleep) as client,
            ServerHealth(client, clock=time.clock, sleep=time.sleep, outage_timeout_s=30) as health,
        ):
            await dep.stop_server("env")
            it = dispatch(
                [row(i) for i in range(5)],
                client,
                topology,
                health=health,
                route_failures_to_sidecar=True,
            )
            outcomes = await _outcomes(it)
            sample = health.snapshot()["env"]
        assert len(outcomes) == 5
        assert all(isinstance(o, ServerOutageError) for o in outcomes)  # nothing became a failure record
        error = outcomes[0]
        assert (error.server, error.url, error.down_s) == ("env", url, 30.0)
        assert str(error).startswith(
            f"environment server 'env' ({url}) has not answered for 30 s (server_outage_timeout_s=30; last "
            "error: could not connect to "
        )
        assert str(error).endswith("bring the server back, then rerun on the same output_dir to resume")
        # probe backoff doubles from 0.25 s up to 5 s, the last wait cut at the timeout: 30 s in all
        assert time.sleeps == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 2.25]
        assert (sample.state, sample.outages) == ("outage", 1)
        assert dep.stats("env").requests == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"outage_timeout_s": 0}, "outage_timeout_s=0 must be > 0 seconds", id="timeout"),
        pytest.param({"down_after": 0}, "down_after=0 must be >= 1", id="down-after"),
    ],
)
async def test_bad_limits_are_refused(kwargs: dict[str, Any], message: str) -> None:
    async with ServerClient() as client:
        with pytest.raises(ValueError, match=message):
            ServerHealth(client, **kwargs)
