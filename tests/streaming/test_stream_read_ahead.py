"""The stream reads its input only as far ahead as its bounded parts hold: a million-row source is never read
into memory, whether it is a sync or an async iterator.

Where every row read and not delivered sits once the consumer stops pulling (``gym_ray.streaming.stream``
and ``gym_ray.streaming.worker``):

- the buffer: ``buffer_size`` outcomes pulled from the workers and not taken;
- each worker (its share ``q`` of ``max_in_flight``): ``q`` outcomes finished and not pulled (no credit
  left, so nothing more is admitted), ``q`` rows in its inbox (``inbox_size`` is its share) and the rest of
  the batch its feeder's ``submit`` is blocked on (at most ``min(SUBMIT_BATCH, q)`` rows);
- the stream's queue: ``max_in_flight + num_workers * SUBMIT_BATCH`` rows;
- the reader: the one row it has read and waits to queue.

With a share of one row per worker the blocked batch is exactly one row, so the number of rows read from the
source is exact once the stream has settled. A source that is read further than that raises at the first
row past the bound (so an unbounded reader stops at once instead of reading a million rows).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from gym_ray.servers import serve_config
from gym_ray.streaming.api import stream
from gym_ray.streaming.stream import SUBMIT_BATCH

pytestmark = pytest.mark.ray

WORKERS = 2
MAX_IN_FLIGHT = 2  # a share of one row per worker
BUFFER = 3
CONSUMED = 5
SOURCE_ROWS = 1_000_000

QUOTA = MAX_IN_FLIGHT // WORKERS
AT_EACH_WORKER = QUOTA + QUOTA + min(SUBMIT_BATCH, QUOTA)  # outbox + inbox + a blocked submit's batch
QUEUE = MAX_IN_FLIGHT + WORKERS * SUBMIT_BATCH
READ_AHEAD = CONSUMED + BUFFER + WORKERS * AT_EACH_WORKER + QUEUE + 1  # + the row the reader holds


class ReadTooFar(Exception):
    """Raised by the source when the stream asks for a row past the bound."""


class CountingSource:
    """``SOURCE_ROWS`` rows, counting how many the stream has taken; refuses to go past ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pulled = 0

    def _next_row(self) -> dict[str, Any]:
        if self.pulled >= self.limit:
            self.pulled += 1
            raise ReadTooFar(f"row {self.pulled} of the source read; the bound is {self.limit}")
        a = self.pulled
        self.pulled += 1
        return {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + 1?"}]},
            "expected_answer": str(a + 1),
            "difficulty": 0.0,
            "agent_ref": {"name": "fast_agent"},
        }

    def rows(self) -> Iterator[dict[str, Any]]:
        for _ in range(SOURCE_ROWS):
            yield self._next_row()

    async def arows(self) -> AsyncIterator[dict[str, Any]]:
        for _ in range(SOURCE_ROWS):
            await asyncio.sleep(0)  # a real async source gives the loop a turn between rows
            yield self._next_row()


def _config() -> dict[str, Any]:
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "fast_agent": {
            "responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0, "skill": 1.0}}
        },
        "fast_env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "skill": 1.0,
                    "agent_server": {"type": "responses_api_agents", "name": "fast_agent"},
                }
            }
        },
    }


@pytest.mark.parametrize(
    "kind", [pytest.param("sync", id="iterator"), pytest.param("async", id="async-iterator")]
)
async def test_a_paused_consumer_stops_reading_of_a_million_row_source_at_the_bound(
    ray_session: Any, kind: str
) -> None:
    assert READ_AHEAD == 145  # 5 + 3 + 2 * 3 + (2 + 2 * 64) + 1
    source = CountingSource(limit=READ_AHEAD)
    rows = source.rows() if kind == "sync" else source.arows()
    async with serve_config(_config()) as servers:
        rollouts = stream(
            rows, config=servers.config, num_workers=WORKERS, max_in_flight=MAX_IN_FLIGHT, buffer_size=BUFFER
        )
        async with rollouts:
            for _ in range(CONSUMED):
                await anext(rollouts)

            async def settled() -> bool:
                if source.pulled > READ_AHEAD:
                    return True  # read too far: the assertion below says by how much
                workers = [(w.outbox, w.in_flight, w.credits, w.inbox) for w in await rollouts.worker_stats()]
                stats = rollouts.stats()
                # Every part full: buffer, each worker's outbox and inbox, a submit blocked on its batch, the
                # queue, and the reader past its last queued row. None of them moves before the consumer
                # pulls again, so nothing more can be read (no sleep needed to see that).
                return (
                    workers == [(QUOTA, 0, 0, QUOTA)] * WORKERS
                    and (stats.delivered, stats.buffered) == (CONSUMED, BUFFER)
                    and (stats.at_workers, stats.queued) == (WORKERS * AT_EACH_WORKER, QUEUE)
                    and source.pulled > stats.read
                )

            deadline = time.monotonic() + 30.0
            while not await settled():
                assert time.monotonic() < deadline, f"not settled: {rollouts.stats()}, pulled {source.pulled}"
                await asyncio.sleep(0.02)  # polls the stream's counters; forces no ordering
            stats = rollouts.stats()
            assert source.pulled == READ_AHEAD
            assert stats.read == READ_AHEAD - 1
            assert servers.stats("fast_env").requests == CONSUMED + BUFFER + MAX_IN_FLIGHT
