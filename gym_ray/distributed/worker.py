"""The worker actor: pulls shards from the driver and runs them through ``run_shard``.

One :class:`RolloutWorker` is one long-lived async Ray actor (one process) with one HTTP client pool. Its
``run()`` keeps ``shards_in_flight`` lanes (default 2); each lane asks the driver for a shard, runs it with
:func:`gym_ray.collect.run_shard`, reports the :class:`~gym_ray.collect.ShardReport` to the coordinator and
the completion to the driver, and asks again. All lanes share one ``asyncio.Semaphore(max_resident_tasks)``,
so while one shard drains its tail the next shard already fills the freed slots: the concurrency window
stays full across shard boundaries and never exceeds ``max_resident_tasks`` rollouts in flight.

Concurrency and failure promises:

- Every outcome is classified inside ``run_shard``; only typed picklable records cross actors
  (:class:`~gym_ray.collect.ShardReport`, :class:`~gym_ray.distributed.driver.ShardFailure`).
- A shard that raises is reported to the driver as a :class:`ShardFailure` and the lane moves on (a
  :class:`~gym_ray.errors.ShardLockError` usually means a newer worker owns the shard: the driver ignores
  it). The shard folder stays resumable.
- Lanes are owned by a ``TaskGroup`` inside ``run()``; cancelling ``run()`` (``ray.cancel``) cancels them,
  which closes every shard writer and the client pool.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gym_ray.distributed.driver import ShardFailure
from gym_ray.errors import GymRayError, InternalError

if TYPE_CHECKING:
    from gym_ray.client import ServerClient
    from gym_ray.collect import OutcomeHook, ShardReport, ShardSpec
    from gym_ray.config import RunSettings
    from gym_ray.topology import Topology

logger = logging.getLogger(__name__)

#: Shards one worker runs at once (sharing one admission semaphore).
DEFAULT_SHARDS_IN_FLIGHT = 2


class ShardFn(Protocol):
    """The shape of :func:`gym_ray.collect.run_shard` (tests inject other shard functions)."""

    def __call__(
        self,
        spec: ShardSpec,
        *,
        client: ServerClient,
        topology: Topology,
        settings: RunSettings,
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


def _default_shard_fn() -> ShardFn:
    from gym_ray.collect import run_shard

    return run_shard


def _default_client(topology: Topology, settings: RunSettings) -> ServerClient:
    from gym_ray.collect import client_for

    return client_for(topology, settings)


class RolloutWorker:
    """Runs the shards it pulls from the driver, ``shards_in_flight`` at a time, in one process.

    Run as a Ray async actor (``ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=...)``).

    Args:
        worker_id: This worker's name (unique in the run; a replacement gets a new name).
        driver: Handle of the :class:`~gym_ray.distributed.driver.ShardDriver` actor.
        coordinator: Handle of the :class:`~gym_ray.distributed.coordinator.RunCoordinator` actor.
        config: The plain global config (the topology is built from it inside the actor).
        settings: The run's settings (``max_resident_tasks``, ``max_connections``, timeouts, ...).
        shard_fn: Runs one shard; :func:`gym_ray.collect.run_shard` by default.
        shards_in_flight: Shards run at once, sharing one admission semaphore.
        client_factory: Builds the client pool from (topology, settings); a :class:`ServerClient` by default.
        clock: Monotonic clock, injected for tests.
    """

    def __init__(
        self,
        worker_id: str,
        driver: Any,
        coordinator: Any,
        config: Mapping[str, Any],
        settings: RunSettings,
        *,
        shard_fn: ShardFn | None = None,
        shards_in_flight: int = DEFAULT_SHARDS_IN_FLIGHT,
        client_factory: Callable[[Topology, RunSettings], ServerClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if shards_in_flight < 1:
            raise InternalError(f"shards_in_flight must be >= 1, got {shards_in_flight}")
        self._worker_id = worker_id
        self._driver = driver
        self._coordinator = coordinator
        self._config = dict(config)
        self._settings = settings
        self._shard_fn = shard_fn or _default_shard_fn()
        self._lanes = shards_in_flight
        self._client_factory = client_factory or _default_client
        self._clock = clock
        self._shards: list[str] = []
        self._dispatched = self._succeeded = self._failed = 0
        self._failed_by_class: Counter[str] = Counter()
        self._failures: list[ShardFailure] = []
        self._running: set[str] = set()

    def pid(self) -> int:
        """The worker's process id (chaos tests kill it)."""
        return os.getpid()

    def running(self) -> tuple[str, ...]:
        """The shards this worker is running now."""
        return tuple(sorted(self._running))

    async def run(self) -> WorkerTotals:
        """Pull and run shards until the driver has none left; return this worker's totals.

        Raises:
            CancelledError: ``ray.cancel`` of this call; every shard writer and the client are closed.
        """
        from gym_ray.topology import Topology

        started = self._clock()
        topology = Topology.from_config(self._config)
        semaphore = asyncio.Semaphore(self._settings.max_resident_tasks)
        logger.info(
            "worker %s (pid %d): max_resident_tasks=%d shared by %d shard lanes, max_connections=%d, "
            "actor max_concurrency=%d, request_timeout_s=%s, connect_timeout_s=%s",
            self._worker_id,
            os.getpid(),
            self._settings.max_resident_tasks,
            self._lanes,
            self._settings.max_connections,
            worker_max_concurrency(self._settings),
            self._settings.request_timeout_s,
            self._settings.connect_timeout_s,
        )
        async with self._client_factory(topology, self._settings) as client:
            async with asyncio.TaskGroup() as lanes:
                for _ in range(self._lanes):
                    lanes.create_task(self._lane(client, topology, semaphore))
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

    async def _lane(self, client: ServerClient, topology: Topology, semaphore: asyncio.Semaphore) -> None:
        while True:
            spec: ShardSpec | None = await self._driver.next_shard.remote(self._worker_id)
            if spec is None:
                return
            self._running.add(spec.shard)
            try:
                report = await self._shard_fn(
                    spec,
                    client=client,
                    topology=topology,
                    settings=self._settings,
                    semaphore=semaphore,
                    worker=self._worker_id,
                )
            except GymRayError as exc:
                await self._report_failure(spec, exc, exc)
                continue
            except Exception as exc:
                logger.exception(
                    "worker %s: shard %s raised an unexpected error", self._worker_id, spec.shard
                )
                wrapped = InternalError(f"shard {spec.shard} raised {type(exc).__name__}: {exc}")
                await self._report_failure(spec, exc, wrapped)
                continue
            finally:
                self._running.discard(spec.shard)
            if report.worker != self._worker_id:
                report = report.model_copy(update={"worker": self._worker_id})
            self._shards.append(spec.shard)
            self._dispatched += report.dispatched
            self._succeeded += report.succeeded
            self._failed += report.failed
            self._failed_by_class.update(report.failed_by_class)
            # Coordinator first: once the driver hears "finished" the run may end, and the report must
            # already be counted. Counts stay exact on a re-run: a report counts only what its call wrote.
            await self._coordinator.record_report.remote(report)
            await self._driver.shard_finished.remote(self._worker_id, spec.shard)

    async def _report_failure(self, spec: ShardSpec, exc: Exception, error: GymRayError) -> None:
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
