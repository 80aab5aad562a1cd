"""The actors of a distributed run, and how they are stopped (every run, finished, failed or cancelled)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_ray.distributed.coordinator import RunCoordinator
from gym_ray.distributed.driver import RunDriver
from gym_ray.distributed.worker import WorkerTotals
from gym_ray.errors import ActorLostError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CLOSE_GRACE_S",
    "RunActors",
    "close_actors",
    "raise_if_control_actor_lost",
    "resume_hint",
    "stop_poller",
    "teardown_actors",
]

#: Seconds every actor gets to flush its telemetry (``close()``) before it is killed.
DEFAULT_CLOSE_GRACE_S = 30.0


@dataclass
class RunActors:
    """The live actors of a distributed run (for status, tests and chaos tools).

    ``driver`` is the :class:`~gym_ray.distributed.driver.RunDriver` actor, ``coordinator`` the
    :class:`~gym_ray.distributed.coordinator.RunCoordinator` actor; ``workers`` maps worker id -> actor
    handle and gains replacements as they start;
    ``nodes`` maps worker id -> the Ray node (hex id) it was placed on; ``lost`` lists the workers that
    died, in order; ``moved`` lists the workers retired from a crowded node (they finished their shards)
    so that a replacement could start on a node that joined the cluster with none of the run's workers.
    """

    driver: Any
    coordinator: Any
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
        actors.driver,
        actors.coordinator,
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
        for handle in [*actors.workers.values(), actors.driver, actors.coordinator]:
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


#: Seconds a liveness probe of a control actor may take before it counts as alive (busy).
_PROBE_S = 30.0


async def raise_if_control_actor_lost(actors: RunActors, run_dir: str, restarts: int = 0) -> None:
    """Raise :class:`ActorLostError` naming the run's driver or coordinator actor when one died for good
    (``restarts``: the restarts Ray had for it, all spent by then)."""
    import ray

    for role, handle, name in (
        ("driver", actors.driver, RunDriver.__name__),
        ("coordinator", actors.coordinator, RunCoordinator.__name__),
    ):
        try:
            await asyncio.wait_for(asyncio.wrap_future(handle.pid.remote().future()), _PROBE_S)
        except ray.exceptions.RayActorError as exc:
            reason = (str(exc).strip().splitlines() or ["no reason given"])[0]
            spent = f" and its {restarts} restart(s) are spent" if restarts else ""
            raise ActorLostError(
                f"the run's {role} actor ({name}) died ({reason[:200]}){spent}; the run cannot go on "
                f"without it; {resume_hint(run_dir)}",
                role=role,
                run_dir=run_dir,
            ) from None
        except TimeoutError:
            continue  # busy, not dead


def resume_hint(run_dir: str) -> str:
    """One sentence on whether a rerun continues ``run_dir`` (true only when the folder holds a plan)."""
    from gym_ray.plan.run_manifest import RUN_MANIFEST
    from gym_ray.store import is_store_url

    if is_store_url(run_dir):  # a folder on an object store: its plan is an object there
        from gym_ray.store.objects import ObjectStore, StoreError

        try:
            planned = ObjectStore(run_dir).get(RUN_MANIFEST) is not None
        except StoreError:
            return f"rerun the same command once {run_dir} can be reached: it runs only what is missing"
    else:
        planned = (Path(run_dir) / RUN_MANIFEST).exists()
    if planned:
        return f"the run folder {run_dir} is resumable: rerun the same command to run only what is missing"
    return f"nothing was recorded in {run_dir}: rerun the same command to start over"
