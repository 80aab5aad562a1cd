"""Per-server request statistics of the reference servers (for tests and benchmarks).

Concurrency: a ``StatsRecorder`` belongs to one server and is mutated only on that server's event loop
(single-threaded, so no locks). Other threads read it through a ``ServerStats`` snapshot taken on that
loop (``start_in_thread`` handles do this for you).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

RequestKey = tuple[int | str, int | str]


@dataclass(frozen=True)
class ServerStats:
    """A snapshot of one server's counters.

    Attributes:
        requests: ``/run`` requests received (every attempt, including faulted ones).
        completed: ``/run`` handlers that returned a reply (including fault replies).
        in_flight: ``/run`` handlers running now.
        max_in_flight: the most ``/run`` handlers ever running at once since the last reset.
        cancelled: handlers cancelled, e.g. because the client disconnected.
        aggregate_calls: ``/aggregate_metrics`` requests received.
        verify_calls: ``/verify`` requests received.
        request_counts: ``(task, rollout) -> /run requests`` (ints for ``"<t>-<r>"`` rollouts).
        faults: ``fault kind -> times injected``.
    """

    requests: int = 0
    completed: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    cancelled: int = 0
    aggregate_calls: int = 0
    verify_calls: int = 0
    request_counts: dict[RequestKey, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON form (``GET /_stats``): request_counts keyed ``"<task>-<rollout>"``."""
        return {
            "requests": self.requests,
            "completed": self.completed,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "cancelled": self.cancelled,
            "aggregate_calls": self.aggregate_calls,
            "verify_calls": self.verify_calls,
            "request_counts": {f"{t}-{r}": n for (t, r), n in self.request_counts.items()},
            "faults": dict(self.faults),
        }


class StatsRecorder:
    """Mutable counters of one server; see ``ServerStats`` for their meaning."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.reset()

    def reset(self) -> None:
        """Zero every counter; ``in_flight`` keeps counting handlers still running."""
        self.requests = 0
        self.completed = 0
        self.max_in_flight = self.in_flight
        self.cancelled = 0
        self.aggregate_calls = 0
        self.verify_calls = 0
        self.request_counts: Counter[RequestKey] = Counter()
        self.faults: Counter[str] = Counter()

    def snapshot(self) -> ServerStats:
        """A frozen copy of the counters."""
        return ServerStats(
            requests=self.requests,
            completed=self.completed,
            in_flight=self.in_flight,
            max_in_flight=self.max_in_flight,
            cancelled=self.cancelled,
            aggregate_calls=self.aggregate_calls,
            verify_calls=self.verify_calls,
            request_counts=dict(self.request_counts),
            faults=dict(self.faults),
        )

    @asynccontextmanager
    async def tracking(self) -> AsyncIterator[None]:
        """Count one running handler: in-flight while inside, ``cancelled`` if cancelled inside."""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        else:
            self.completed += 1
        finally:
            self.in_flight -= 1

    def count_request(self, key: RequestKey) -> None:
        """Count one ``/run`` request for ``key``."""
        self.requests += 1
        self.request_counts[key] += 1

    def count_fault(self, kind: str) -> None:
        """Count one injected fault."""
        self.faults[kind] += 1
