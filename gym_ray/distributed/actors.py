"""The actors of a distributed run, and how they are stopped (every run, finished, failed or cancelled)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gym_ray.distributed.worker import WorkerTotals

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CLOSE_GRACE_S", "RunActors", "close_actors", "stop_poller", "teardown_actors"]

#: Seconds every actor gets to flush its telemetry (``close()``) before it is killed.
DEFAULT_CLOSE_GRACE_S = 30.0


@dataclass
class RunActors:
    """The live actors of a distributed run (for status, tests and chaos tools).

    ``host`` is the :class:`~gym_ray.distributed.host.RunHost` actor (the shard driver and the coordinator
    in one process); ``workers`` maps worker id -> actor handle and gains replacements as they start;
    ``nodes`` maps worker id -> the Ray node (hex id) it was placed on; ``lost`` lists the workers that
    died, in order; ``moved`` lists the workers retired from a crowded node (they finished their shards)
    so that a replacement could start on a node that joined the cluster with none of the run's workers.
    """

    host: Any
    workers: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    totals: dict[str, WorkerTotals] = field(default_factory=dict)

    def live(self) -> list[str]:
        """Worker ids neither lost nor moved, in start order."""
        return [w for w in self.workers if w not in self.lost and w not in self.moved]


async def stop_poller(poller: asyncio.Future[None] | None) -> None:
    """Cancel and join the progress poller (a cancellation of the caller still propagates)."""
    if poller is None or poller.done():
        return
    poller.cancel()
    (outcome,) = await asyncio.gather(poller, return_exceptions=True)
    if isinstance(outcome, Exception):
        logger.warning("collect: progress poller failed: %s: %s", type(outcome).__name__, outcome)


async def teardown_actors(
    actors: RunActors,
    runs: dict[asyncio.Future[WorkerTotals], str],
    refs: dict[str, Any],
    *,
    graceful: bool,
    grace_s: float,
    close_grace_s: float = DEFAULT_CLOSE_GRACE_S,
) -> None:
    """Stop every actor of the run: cancel live ``run()`` calls (wait ``grace_s``), then ``close()`` every
    live actor so it flushes its telemetry (wait ``close_grace_s``), then kill them all (the backstop)."""
    import ray

    handles = [
        *(handle for worker_id, handle in actors.workers.items() if worker_id not in actors.lost),
        actors.host,
    ]
    try:
        if runs:
            for worker_id in runs.values():
                ray.cancel(refs[worker_id])
            await asyncio.wait(runs, timeout=grace_s)
            for run in runs:
                run.cancel()
            # Retrieve every outcome (cancelled, killed, ...) so that none is reported as never retrieved.
            await asyncio.gather(*runs, return_exceptions=True)
            runs.clear()
        if not graceful:
            logger.info("collect: stopping the run's actors")
        await close_actors(handles, timeout_s=close_grace_s)
    finally:
        for handle in [*actors.workers.values(), actors.host]:
            ray.kill(handle, no_restart=True)


async def close_actors(handles: Sequence[Any], *, timeout_s: float) -> None:
    """Call ``close()`` on every actor at once and wait up to ``timeout_s`` (a dead or slow actor is
    logged and left to the kill that follows)."""
    closing = [asyncio.ensure_future(handle.close.remote()) for handle in handles]
    _, pending = await asyncio.wait(closing, timeout=timeout_s)
    for call in pending:
        call.cancel()
    outcomes = await asyncio.gather(*closing, return_exceptions=True)
    import ray

    # An actor that is already dead (the run's error names it) holds nothing more to flush: not worth a line.
    failed = [
        o
        for o in outcomes
        if isinstance(o, BaseException) and not isinstance(o, ray.exceptions.RayActorError)
    ]
    if failed:
        logger.warning(
            "collect: %d of %d actors did not close within %g s (%s); telemetry they still held may be lost",
            len(failed),
            len(handles),
            timeout_s,
            type(failed[0]).__name__,
        )
