"""The run host actor: a run's shard driver and its coordinator in one Ray actor process.

Both roles are small and IO bound and live on the caller's node, and a run cannot go on without either,
so one process holds both: a run starts one actor process fewer (about 150 MB of resident memory and a
Python start-up), and the driver tells the coordinator of each planned shard with a plain call instead of
an actor call. The two objects keep their own state and promises
(:class:`~gym_ray.distributed.driver.ShardDriver`, :class:`~gym_ray.distributed.coordinator.RunCoordinator`);
:class:`RunHost` only forwards to them. Names follow the roles: the driver's methods keep their names
(``next_shard``, ``shard_failed``, ``worker_lost``, ``retire``, ``status``,
``wait_finished``), the coordinator's too (``timings``, ``finalize``) except its status,
which is :meth:`RunHost.run_status` here. Workers report a finished shard with :meth:`RunHost.report_shard`,
which counts the report and completes the shard in one step.

Concurrency: one event loop runs both objects, so nothing is shared across threads; the actor's
``max_concurrency`` (:func:`host_max_concurrency`) is the sum of what each role needed as an actor of its
own, so no call waits for a slot that the separate actors would have had.

Loss: the process dying ends the run (as the loss of either actor did before); the caller names it in one
line (:class:`~gym_ray.errors.ActorLostError`) and the run folder stays resumable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from gym_ray.distributed.coordinator import FinalizeFn, RunCoordinator, RunStatus, ShardTiming
from gym_ray.distributed.driver import (
    DriverStatus,
    Planner,
    ShardDriver,
    ShardFailure,
    driver_max_concurrency,
)

if TYPE_CHECKING:
    from gym_ray.config.run_config import RunConfig
    from gym_ray.dispatch.client import ServerClient
    from gym_ray.record.metrics_summary import WrittenSummary
    from gym_ray.run.collect import ShardSpec
    from gym_ray.run.result import RunResult, ShardReport

__all__ = ["RunHost", "host_max_concurrency"]


def host_max_concurrency(num_workers: int, shards_per_worker: int) -> int:
    """The host actor's ``max_concurrency``: the driver's (every worker lane may wait in ``next_shard``)
    plus the coordinator's (every lane may report at once, plus progress polls and control calls)."""
    return driver_max_concurrency(num_workers, shards_per_worker) + num_workers * shards_per_worker + 16


class RunHost:
    """A run's :class:`ShardDriver` and :class:`RunCoordinator`, served by one async actor.

    Run as a Ray async actor (``ray.remote(RunHost).options(num_cpus=0, max_concurrency=...)``); plain
    Python, so it also works in one event loop.

    Args:
        run_dir: The run folder.
        run: The run's config.
        planner: Yields the run's shards (see :class:`~gym_ray.distributed.driver.ShardDriver`).
        lookahead: Planned shards that may wait in the driver's queue.
        finalize_fn: Finalizes the run (default :func:`gym_ray.run.finalize.finalize_run`).
        client_factory: Builds the coordinator's client pool (for ``/aggregate_metrics``).
    """

    def __init__(
        self,
        run_dir: str,
        run: RunConfig,
        planner: Planner,
        *,
        lookahead: int,
        finalize_fn: FinalizeFn | None = None,
        client_factory: Callable[[RunConfig], ServerClient] | None = None,
    ) -> None:
        self._coordinator = RunCoordinator(
            run_dir, run, finalize_fn=finalize_fn, client_factory=client_factory
        )
        self._driver = ShardDriver(planner, lookahead=lookahead, on_planned=self._coordinator.plan_progress)

    # -- the process -------------------------------------------------------------------------------

    def node_id(self) -> str:
        """The Ray node (hex id) this actor runs on."""
        return self._driver.node_id()

    def pid(self) -> int:
        """This actor's process id (benchmarks sample its memory, chaos tests kill it)."""
        return os.getpid()

    async def close(self) -> None:
        """Stop planning, join the planner task, then flush and shut down this process's telemetry."""
        await self._driver.close()

    # -- driver ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start planning now (see :meth:`ShardDriver.start`)."""
        await self._driver.start()

    async def next_shard(self, worker_id: str) -> ShardSpec | None:
        """See :meth:`ShardDriver.next_shard`."""
        return await self._driver.next_shard(worker_id)

    async def report_shard(
        self, worker_id: str, report: ShardReport, by_server: dict[str, tuple[int, float]] | None = None
    ) -> bool:
        """A worker's finished shard: count its report and mark it complete as one step.

        Two calls (count, then finish) let a worker that dies between them have its shard counted, then
        re-queued and counted again. Here the report is counted only if the driver accepts the
        completion, under the same lock. Returns False (nothing counted) if ``worker_id`` no longer owns
        the shard.
        """
        return await self._driver.shard_finished(
            worker_id,
            report.shard,
            accepted=functools.partial(self._coordinator.record_report, report, by_server),
        )

    async def shard_failed(self, failure: ShardFailure) -> bool:
        """See :meth:`ShardDriver.shard_failed`."""
        return await self._driver.shard_failed(failure)

    async def retire(self, worker_id: str) -> None:
        """See :meth:`ShardDriver.retire`."""
        await self._driver.retire(worker_id)

    async def worker_lost(self, worker_id: str) -> list[str]:
        """See :meth:`ShardDriver.worker_lost`."""
        return await self._driver.worker_lost(worker_id)

    async def status(self) -> DriverStatus:
        """The plan and the hand-out (:meth:`ShardDriver.status`)."""
        return await self._driver.status()

    async def wait_finished(self) -> DriverStatus:
        """See :meth:`ShardDriver.wait_finished`."""
        return await self._driver.wait_finished()

    # -- coordinator -------------------------------------------------------------------------------

    async def run_status(self) -> RunStatus:
        """The counts of the finished shards (:meth:`RunCoordinator.status`)."""
        return await self._coordinator.status()

    async def timings(self) -> list[ShardTiming]:
        """See :meth:`RunCoordinator.timings`."""
        return await self._coordinator.timings()

    async def written_metrics_summary(self) -> WrittenSummary | None:
        """The summary of the metrics file this process wrote last (after :meth:`finalize`: the run's), so
        the caller can print the run's headline without reading the file (see
        :func:`gym_ray.record.aggregate.adopt_written_summary`)."""
        from gym_ray.record.metrics_summary import written_summary

        return written_summary()

    async def finalize(self, *, num_workers: int, wall_s: float | None = None) -> RunResult:
        """Stop planning, then finalize the run (:meth:`RunCoordinator.finalize`); telemetry stays up
        until :meth:`close`.

        The closing counts come from the workers' shard reports when the run handed every shard out once
        and lost no worker: each shard then had one writer, under its lock, from its resume plan to its
        report, as in a single-process run. Otherwise (a lost worker, a re-queued shard) the shards are
        read again.
        """
        await self._driver.stop_planning()
        status = await self._driver.status()
        once = status.requeued_total == 0 and not status.lost_workers
        return await self._coordinator.finalize(
            num_workers=num_workers, wall_s=wall_s, counts_from_reports=once
        )
