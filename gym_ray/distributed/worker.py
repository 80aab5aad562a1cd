"""The worker actor: pulls shards from the driver and runs them through ``run_shards``.

One :class:`RolloutWorker` is one long-lived async Ray actor (one process) with one HTTP client pool. Its
``run()`` is :func:`gym_ray.run.collect.run_shards` with ``shards_in_flight`` lanes (default 2): each lane
asks
the driver for a shard, runs it with :func:`gym_ray.run.collect.run_shard`, reports the
:class:`~gym_ray.run.result.ShardReport` to the coordinator and the completion to the driver, and asks again.
All lanes share one ``asyncio.Semaphore(max_resident_tasks)``, so while one shard drains its tail the next
shard already fills the freed slots: the concurrency window stays full across shard boundaries and never
exceeds ``max_resident_tasks`` rollouts in flight.

Concurrency and failure promises:

- Every outcome is classified inside ``run_shard``; only typed picklable records cross actors
  (:class:`~gym_ray.run.result.ShardReport`, :class:`~gym_ray.distributed.driver.ShardFailure`,
  :class:`WorkerProgress`).
- A shard that raises is reported to the driver as a :class:`ShardFailure` and the lane moves on (the
  ``on_error`` hook of ``run_shards``: the other lanes are not disturbed). A
  :class:`~gym_ray.errors.ShardLockError` means a newer writer took the shard over (this worker was
  declared lost while still alive, e.g. frozen): this worker wrote nothing more to it, and the driver
  ignores the failure of a shard it re-queued. The shard folder stays resumable.
- Lanes are owned by a ``TaskGroup`` inside ``run_shards``; cancelling ``run()`` (``ray.cancel``) cancels
  them, which closes every shard writer and the client pool.

Tracing: ``run()`` sets up this process's tracer from the run config and runs every shard inside
:func:`~gym_ray.observe.tracing.attach_traceparent` of the driver's job span, so each rollout's root span
links to
the job span (no effect when tracing is off or no ``traceparent`` was given). :meth:`RolloutWorker.close`
flushes and shuts the telemetry down; the run calls it before killing the actor, so no span or metric
point held by a batch exporter is lost with the process.

Live progress: :meth:`RolloutWorker.progress` answers the outcomes written so far by the shards this worker
is *running* (counts by environment server with reward sums, failures), counted per outcome by
``run_shard``'s ``on_outcome`` hook (a few integer additions). When a shard finishes its tally moves to the
coordinator with the shard's report, so "coordinator + live workers" counts every outcome of the run once
(see :mod:`gym_ray.distributed.api`). A shard that *failed* is never reported: its tally stays with the
worker (its outcomes are on disk), so the run's last progress line still counts them. It also carries the
worker's server health (one
:class:`~gym_ray.dispatch.health.ServerHealth` shared by its lanes: which server looks down, for how long),
so the driver's progress line names a down server (:mod:`gym_ray.distributed.live`).

Ray resources: start it with ``num_cpus=0`` (it waits on the network; four workers must fit on a 2-CPU
local Ray) and an explicit ``max_concurrency`` (:func:`worker_max_concurrency`), logged at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gym_ray import keys
from gym_ray.distributed.driver import ShardFailure
from gym_ray.errors import GymRayError, InternalError

if TYPE_CHECKING:
    from gym_ray.config.run_config import RunConfig
    from gym_ray.config.settings import RunSettings
    from gym_ray.dispatch.client import ServerClient
    from gym_ray.dispatch.health import ServerHealth, ServerHealthSample
    from gym_ray.run.collect import OutcomeHook, ShardSpec
    from gym_ray.run.result import ShardReport

logger = logging.getLogger(__name__)

#: Shards one worker runs at once (sharing one admission semaphore).
DEFAULT_SHARDS_IN_FLIGHT = 2
#: ``by_server`` key of successes whose record names no environment server.
UNKNOWN_SERVER = "?"


class ShardFn(Protocol):
    """The shape of :func:`gym_ray.run.collect.run_shard` (tests inject other shard functions)."""

    def __call__(
        self,
        spec: ShardSpec,
        *,
        client: ServerClient,
        run: RunConfig,
        semaphore: asyncio.Semaphore | None = None,
        on_outcome: OutcomeHook | None = None,
        worker: str | None = None,
    ) -> Awaitable[ShardReport]: ...


def worker_max_concurrency(settings: RunSettings) -> int:
    """The worker actor's ``max_concurrency``: ``max_resident_tasks + 16`` (room for control calls)."""
    return settings.max_resident_tasks + 16


@dataclass(frozen=True)
class WorkerTotals:
    """What one worker did over its whole ``run()`` (returned by it)."""

    worker: str
    pid: int
    shards: tuple[str, ...]
    dispatched: int
    succeeded: int
    failed: int
    failed_by_class: dict[str, int]
    failures: tuple[ShardFailure, ...]
    wall_s: float


@dataclass
class OutcomeTally:
    """Outcomes on disk, counted one by one: successes ``(count, reward sum)`` by environment server.

    ``failed`` counts failure records (one per attempt, as :class:`~gym_ray.run.result.ShardReport` does);
    records that are not persisted (drained rollouts) are not counted.
    """

    failed: int = 0
    by_server: dict[str, list[float]] = field(default_factory=dict)

    @property
    def succeeded(self) -> int:
        """Successes over every environment server."""
        return sum(int(count) for count, _ in self.by_server.values())

    def add(self, record: Mapping[str, Any]) -> None:
        """Count one record as written by ``run_shard``."""
        if record.get(keys.NO_PERSIST):
            return
        if keys.FAILURE_CLASS in record:
            self.failed += 1
            return
        server = record.get(keys.ENVIRONMENT_SERVER)
        entry = self.by_server.setdefault(server if isinstance(server, str) else UNKNOWN_SERVER, [0, 0.0])
        entry[0] += 1
        reward = record.get(keys.REWARD)
        if isinstance(reward, int | float) and not isinstance(reward, bool):
            entry[1] += float(reward)

    def add_tally(self, other: OutcomeTally) -> None:
        """Add ``other``'s counts to this tally."""
        self.failed += other.failed
        for server, (count, reward) in other.by_server.items():
            entry = self.by_server.setdefault(server, [0, 0.0])
            entry[0] += count
            entry[1] += reward

    def servers(self) -> dict[str, tuple[int, float]]:
        """``{environment server: (successes, reward sum)}`` (a plain, picklable copy)."""
        return {server: (int(count), float(reward)) for server, (count, reward) in self.by_server.items()}


@dataclass(frozen=True)
class WorkerProgress:
    """What a worker's running shards wrote so far (not yet reported to the coordinator), and how the
    servers it sends to look from its process (``health``: one sample per server it has sent to)."""

    worker: str
    running: tuple[str, ...]
    succeeded: int
    failed: int
    by_server: dict[str, tuple[int, float]]
    health: tuple[ServerHealthSample, ...] = ()


def _default_shard_fn() -> ShardFn:
    from gym_ray.run.collect import run_shard

    return run_shard


def _default_client(run: RunConfig) -> ServerClient:
    from gym_ray.dispatch.pool import client_for

    return client_for(run)


class RolloutWorker:
    """Runs the shards it pulls from the driver, ``shards_in_flight`` at a time, in one process.

    Run as a Ray async actor (``ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=...)``).

    Args:
        worker_id: This worker's name (unique in the run; a replacement gets a new name).
        driver: Handle of the run's :class:`~gym_ray.distributed.driver.RunDriver` actor (shards out,
            reports and failures in).
        config: The plain global config (the topology and the tracer are built from it inside the actor).
        settings: The run's settings (``max_resident_tasks``, ``max_connections``, timeouts, ...).
        shard_fn: Runs one shard; :func:`gym_ray.run.collect.run_shard` by default.
        shards_in_flight: Shards run at once, sharing one admission semaphore.
        client_factory: Builds the client pool from (topology, settings); a :class:`ServerClient` by default.
        clock: Monotonic clock, injected for tests.
        traceparent: The W3C ``traceparent`` of the driver's job span; rollout spans link to it.
    """

    def __init__(
        self,
        worker_id: str,
        driver: Any,
        run: RunConfig,
        *,
        shard_fn: ShardFn | None = None,
        shards_in_flight: int = DEFAULT_SHARDS_IN_FLIGHT,
        client_factory: Callable[[RunConfig], ServerClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        traceparent: str | None = None,
    ) -> None:
        if shards_in_flight < 1:
            raise InternalError(f"shards_in_flight must be >= 1, got {shards_in_flight}")
        self._worker_id = worker_id
        self._driver = driver
        self._run = run
        self._settings = run.settings
        self._shard_fn = shard_fn or _default_shard_fn()
        self._lanes = shards_in_flight
        self._client_factory = client_factory or _default_client
        self._clock = clock
        self._traceparent = traceparent
        self._shards: list[str] = []
        self._dispatched = self._succeeded = self._failed = 0
        self._failed_by_class: Counter[str] = Counter()
        self._failures: list[ShardFailure] = []
        self._live: dict[str, OutcomeTally] = {}
        # What the shards that failed here wrote before they failed (never reported to the coordinator).
        self._stopped = OutcomeTally()
        self._health: ServerHealth | None = None
        self._asks = 0

    def node_id(self) -> str:
        """The Ray node (hex id) this actor runs on."""
        from gym_ray.distributed.placement import current_node_id

        return current_node_id()

    def pid(self) -> int:
        """The worker's process id (chaos tests kill it)."""
        return os.getpid()

    def running(self) -> tuple[str, ...]:
        """The shards this worker is running now."""
        return tuple(sorted(self._live))

    def progress(self) -> WorkerProgress:
        """Outcomes written so far by the shards this worker is running, and by those that failed here
        (never reported to the coordinator); cheap, poll it every second."""
        total = OutcomeTally()
        total.add_tally(self._stopped)
        for tally in self._live.values():
            total.add_tally(tally)
        return WorkerProgress(
            worker=self._worker_id,
            running=tuple(sorted(self._live)),
            succeeded=total.succeeded,
            failed=total.failed,
            by_server=total.servers(),
            health=() if self._health is None else tuple(self._health.snapshot().values()),
        )

    async def close(self) -> None:
        """Flush this process's telemetry and shut its providers down: the graceful end of the actor.

        Spans still queued in a batch span processor and the last values of a periodic metric reader
        (``otlp``, ``console`` exporters) are exported before this returns (each provider waits at most
        :data:`~gym_ray.observe.tracing.DEFAULT_FLUSH_TIMEOUT_S`). The run calls it once ``run()`` has
        returned or was cancelled, and kills the actor after a bounded wait. Idempotent; a no-op when
        tracing is off.
        """
        from gym_ray.observe.tracing_gate import shutdown_tracing_if_used
        from gym_ray.store import release_stages

        await asyncio.to_thread(shutdown_tracing_if_used)
        release_stages()  # this process's copy of a store folder, if any

    async def run(self) -> WorkerTotals:
        """Pull and run shards until the driver has none left; return this worker's totals.

        Raises:
            CancelledError: ``ray.cancel`` of this call; every shard writer and the client are closed.
        """
        from gym_ray.observe.tracing_gate import tracer_for
        from gym_ray.run._gc import collecting_rarely

        started = self._clock()
        tracer = tracer_for(self._run.tracing)
        logger.info(
            "worker %s (pid %d): max_resident_tasks=%d shared by %d shard lanes, max_connections=%d, "
            "actor max_concurrency=%d, request_timeout_s=%s, connect_timeout_s=%s, tracing=%s",
            self._worker_id,
            os.getpid(),
            self._settings.max_resident_tasks,
            self._lanes,
            self._settings.max_connections,
            worker_max_concurrency(self._settings),
            self._settings.request_timeout_s,
            self._settings.connect_timeout_s,
            "off" if tracer is None else tracer.settings.exporter,
        )
        traceparent = self._traceparent if tracer is not None else None
        # Fewer garbage collections while the shards run (gym_ray.run._gc).
        with collecting_rarely(freeze=False):
            return await self._run_lanes(tracer, traceparent, started)

    async def _run_lanes(self, tracer: Any, traceparent: str | None, started: float) -> WorkerTotals:
        """:meth:`run`'s body once the tracer is set up: the client, the health, the shard lanes."""
        from gym_ray.dispatch.health import health_scope
        from gym_ray.observe.tracing_gate import under_traceparent
        from gym_ray.run.collect import health_for, run_shards

        async with self._client_factory(self._run) as client, health_for(self._run, client) as health:
            # One health object for every lane, kept here so progress() can show it to the driver.
            self._health = health
            try:
                with health_scope(health), under_traceparent(traceparent):
                    await run_shards(
                        self._next_spec,
                        client=client,
                        run=self._run,
                        parallel_shards=self._lanes,
                        on_report=self._on_report,
                        worker=self._worker_id,
                        shard_fn=self._run_counted,
                        on_error=self._on_error,
                    )
            finally:
                self._health = None
        return WorkerTotals(
            worker=self._worker_id,
            pid=os.getpid(),
            shards=tuple(self._shards),
            dispatched=self._dispatched,
            succeeded=self._succeeded,
            failed=self._failed,
            failed_by_class=dict(self._failed_by_class),
            failures=tuple(self._failures),
            wall_s=self._clock() - started,
        )

    async def _next_spec(self) -> ShardSpec | None:
        # Each request has its own name: if the driver's process dies before it answers, Ray sends the
        # request again to the restarted driver, which answers a request it had answered with the same shard.
        self._asks += 1
        spec: ShardSpec | None = await self._driver.next_shard.remote(
            self._worker_id, f"{self._worker_id}/{self._asks}"
        )
        return spec

    async def _run_counted(
        self,
        spec: ShardSpec,
        *,
        client: ServerClient,
        run: RunConfig,
        semaphore: asyncio.Semaphore | None = None,
        on_outcome: OutcomeHook | None = None,
        worker: str | None = None,
    ) -> ShardReport:
        """The shard function with a per-shard outcome tally (kept until the shard is reported)."""
        tally = self._live[spec.shard] = OutcomeTally()

        def count(row: dict[str, Any], record: dict[str, Any]) -> None:
            tally.add(record)
            if on_outcome is not None:
                on_outcome(row, record)

        return await self._shard_fn(
            spec,
            client=client,
            run=run,
            semaphore=semaphore,
            on_outcome=count,
            worker=worker,
        )

    async def _on_report(self, report: ShardReport) -> None:
        if report.worker != self._worker_id:
            report = report.model_copy(update={"worker": self._worker_id})
        tally = self._live.pop(report.shard, None) or OutcomeTally()
        self._shards.append(report.shard)
        self._dispatched += report.dispatched
        self._succeeded += report.succeeded
        self._failed += report.failed
        self._failed_by_class.update(report.failed_by_class)
        # One call counts the report and completes the shard together: a worker dying in between cannot
        # leave its shard counted and re-queued (counted twice). A re-run counts only what it wrote.
        await self._driver.report_shard.remote(self._worker_id, report, tally.servers())

    async def _on_error(self, spec: ShardSpec, exc: Exception) -> None:
        written = self._live.pop(spec.shard, None)
        if written is not None:
            self._stopped.add_tally(written)
        if isinstance(exc, GymRayError):
            error: GymRayError = exc
        else:
            logger.error(
                "worker %s: shard %s raised an unexpected error",
                self._worker_id,
                spec.shard,
                exc_info=exc,
            )
            error = InternalError(f"shard {spec.shard} raised {type(exc).__name__}: {exc}")
        failure = ShardFailure(
            shard=spec.shard,
            worker=self._worker_id,
            error_type=type(exc).__name__,
            message=str(exc),
            error=error,
        )
        self._failures.append(failure)
        logger.warning(
            "worker %s: shard %s failed: %s: %s", self._worker_id, spec.shard, type(exc).__name__, exc
        )
        await self._driver.shard_failed.remote(failure)
