"""A row's retry budgets survive ``pause("abort")``: a stream worker that aborts and re-admits a row keeps
its retry ladder, so the servers see at most ``1 + max_infra_retries`` requests for it however many pauses
come between (the budget used to restart at each abort: up to 140 requests for one rollout in 10 steps).

Real parts: the reference servers on 127.0.0.1 (``fault: 503`` answers every ``/run`` of the row with 503)
and a real ``StreamWorker`` run in this process (the class Ray runs as an actor)."""

from __future__ import annotations

import asyncio
import time

from gym_ray.config.topology import Topology
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.servers import serve_config
from gym_ray.streaming.worker import StreamWorker
from tests.dispatch.test_dispatch import make_config, row

MAX_INFRA_RETRIES = 3


async def _until(check: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _sends(dep: object) -> int:
    return int(dep.stats("env").request_counts.get((0, 0), 0))  # type: ignore[attr-defined]


async def test_an_aborted_row_keeps_its_infrastructure_budget() -> None:
    async with serve_config(make_config()) as dep:
        worker = StreamWorker(
            "w0",
            Topology.from_config(dep.config),
            max_in_flight=2,
            inbox_size=2,
            request_timeout_s=10.0,
            connect_timeout_s=5.0,
            retry_requests=True,
            max_infra_retries=MAX_INFRA_RETRIES,
        )
        running = asyncio.create_task(worker.run())
        try:
            await worker.submit([(0, row(0, fault="503"))])
            for sent in (2, 3):  # abort twice, each time while the row waits out a backoff
                await _until(lambda n=sent: _sends(dep) >= n, f"{sent} sends")
                await _until(lambda: dep.stats("env").in_flight == 0, "no request in flight")
                assert await worker.pause(abort=True) == 1
                worker.resume(0)
            items = []
            while not items:
                items = await worker.pull(1, wait_s=30.0)
        finally:
            await worker.close(drain=False)
            await running
    ((seq, outcome, _),) = items
    assert seq == 0
    assert isinstance(outcome, RolloutFailureRecord)
    assert outcome.http_status == 503
    # every request the server saw is in the record; the budget was spent by failures only: an abort that
    # lands while a reply is on its way leaves that send counted as "cancelled"
    assert outcome.requests == dep.stats("env").request_counts[(0, 0)]
    assert outcome.request_errors is not None
    assert outcome.request_errors.count("http_503") == 1 + MAX_INFRA_RETRIES
    assert set(outcome.request_errors) <= {"http_503", "cancelled"}
