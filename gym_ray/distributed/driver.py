"""The driver: owns a run's plan and hands shards to workers on request (served by the run's driver actor,
:class:`RunDriver`, which tells the coordinator actor of each planned shard and each accepted report).

Workers pull (``next_shard``); nothing is split statically, so a fast worker takes more shards and a
straggler holds only the shards it is running. The driver tracks which worker holds which shard; when a
worker dies (:meth:`ShardDriver.worker_lost`) its unfinished shards go back to the *front* of the queue
and the next worker to ask takes them over and resumes them. Takeover does not wait for the old worker:
a worker declared lost may still be alive (frozen, preempted, partitioned) and the new one opens the
shard's writer with a new token all the same, so the zombie's next write fails with
:class:`~gym_ray.errors.ShardLockError` and adds nothing. Completions and failures a worker reports for
a shard it no longer holds are ignored.

Concurrency promises:

- Planning runs in a background task owned by the actor (each step in a thread, since it writes files) and
  stays at most ``lookahead`` shards ahead of the hand-out: memory holds a bounded queue of small
  :class:`~gym_ray.run.collect.ShardSpec`, never rows. A planner that streams (cuts and writes one shard at a
  time, like :func:`gym_ray.plan.shards.iter_prepare_run`) is consumed lazily, so the first shard is handed
  out
  once the input is validated and that shard is cut; a planner that plans everything first only delays
  the first hand-out. A planner generator left unfinished (close, error) is closed by the planner task.
- ``next_shard`` waits while shards are in flight elsewhere and nothing is queued: it answers ``None``
  only when every shard is complete (or the run is aborted), so a worker that is idle near the end is still
  there to take over a dead worker's shards.
- A worker declared lost gets ``None`` from then on, and its late completions are ignored; an assignment
  made to it while it was dying goes back to the queue.

It is IO bound: its actor needs ``num_cpus=0`` and ``max_concurrency`` at least the number of concurrent
``next_shard`` callers (workers x lanes) plus a margin (see :func:`driver_max_concurrency`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gym_ray.distributed.journal import ControlJournal
from gym_ray.errors import GymRayError, InternalError, ShardLockError

if TYPE_CHECKING:
    from gym_ray.config.run_config import RunConfig
    from gym_ray.plan.first_pass import CheckedInput
    from gym_ray.run.collect import ShardSpec
    from gym_ray.run.result import ShardReport

logger = logging.getLogger(__name__)

#: A zero-argument callable that yields the run's shards in order (planned on disk as they are yielded).
Planner = Callable[[], Iterable["ShardSpec"]]


def driver_max_concurrency(num_workers: int, shards_per_worker: int) -> int:
    """The driver actor's ``max_concurrency``: every worker lane may wait in ``next_shard`` at once."""
    return num_workers * shards_per_worker * 2 + 16


@dataclass(frozen=True)
class ShardFailure:
    """A shard that failed in a worker (typed error kept when it pickles, text always)."""

    shard: str
    worker: str
    error_type: str
    message: str
    error: GymRayError | None = None


@dataclass(frozen=True)
class DriverStatus:
    """A snapshot of the plan and the hand-out."""

    planned_shards: int
    planned_rows: int
    plan_done: bool
    queued: int
    in_flight: dict[str, tuple[str, ...]]
    completed: int
    requeued_total: int
    lost_workers: tuple[str, ...]
    failures: tuple[ShardFailure, ...]
    plan_error: GymRayError | None
    finished: bool
    assignments: dict[str, tuple[str, ...]] = field(default_factory=dict)


class ShardDriver:
    """Owns the plan; hands out shards pull-based; re-queues a dead worker's shards.

    Served by the run's :class:`RunDriver` actor; the class is plain Python so it also works, and is
    tested, in one event loop.

    Args:
        planner: Yields the run's shards in order, each already written to the run folder. Called once,
            in a thread of the actor. Errors it raises (bad input, resume conflict) abort the run and
            are reported by :meth:`status` as ``plan_error``.
        lookahead: How many planned shards may wait in the queue (e.g. ``2 x num_workers``).
        on_planned: Awaited with each planned shard, then with ``None`` when planning ended (the
            coordinator's :meth:`~gym_ray.distributed.coordinator.RunCoordinator.plan_progress`; optional).
        journal: Where each hand-out decision is written before it is answered; a driver built on a
            journal that holds lines (its process was restarted) takes up the dead process's state from
            it: who holds which shard, what is complete, failed, lost or retired (see
            :mod:`gym_ray.distributed.journal`).
        clock: Monotonic clock, injected for tests.
    """

    def __init__(
        self,
        planner: Planner,
        *,
        lookahead: int,
        on_planned: Callable[[ShardSpec | None], Awaitable[None]] | None = None,
        journal: ControlJournal | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lookahead < 1:
            raise InternalError(f"driver lookahead must be >= 1, got {lookahead}")
        self._planner = planner
        self._lookahead = lookahead
        self._on_planned = on_planned
        self._clock = clock
        self._changed: asyncio.Condition | None = None
        self._planner_task: asyncio.Task[None] | None = None
        self._requeued: deque[ShardSpec] = deque()
        self._planned: deque[ShardSpec] = deque()
        self._plan_done = False
        self._plan_error: GymRayError | None = None
        self._closing = False
        self._planned_shards = 0
        self._planned_rows = 0
        self._owner: dict[str, str] = {}
        self._spec: dict[str, ShardSpec] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._history: dict[str, list[str]] = {}
        self._completed: set[str] = set()
        self._lost: set[str] = set()
        self._retired: set[str] = set()
        self._failures: list[ShardFailure] = []
        self._requeued_total = 0
        # hand-outs by the worker's ask id: a call Ray sends again after a restart gets the same shard
        self._asks: dict[str, str] = {}
        self._journal = journal
        if journal is not None:
            self._replay(journal.entries())

    # -- journal ---------------------------------------------------------------------------------

    def _note(self, **entry: Any) -> None:
        if self._journal is not None:
            self._journal.append(entry)

    def _replay(self, entries: list[dict[str, Any]]) -> None:
        """Take up a dead process's decisions (the constructor of a restarted driver actor).

        Planning starts over (it finds the folder planned and verifies it); the plan loop then queues only
        the shards nobody holds and that are neither complete nor failed.
        """
        for entry in entries:
            if "give" in entry:
                shard, worker = entry["give"], entry["worker"]
                self._owner[shard] = worker
                self._by_worker.setdefault(worker, set()).add(shard)
                self._history.setdefault(worker, []).append(shard)
                if entry.get("ask") is not None:
                    self._asks[entry["ask"]] = shard
            elif "done" in entry:
                self._release(entry["done"])
                self._completed.add(entry["done"])
            elif "failed" in entry:
                self._release(entry["failed"])
                self._failures.append(
                    ShardFailure(entry["failed"], entry["worker"], entry["type"], entry["message"])
                )
            elif "lost" in entry:
                self._lost.add(entry["lost"])
                held = self._by_worker.pop(entry["lost"], set())
                self._requeued_total += len(held)
                for shard in held:
                    del self._owner[shard]
            elif "retired" in entry:
                self._retired.add(entry["retired"])
        if entries:
            logger.warning(
                "driver: restarted; took up %d hand-outs in flight and %d complete shards from %s",
                len(self._owner),
                len(self._completed),
                self._journal.path if self._journal is not None else "?",
            )

    def _release(self, shard: str) -> None:
        worker = self._owner.pop(shard, None)
        if worker is not None:
            self._by_worker[worker].discard(shard)

    # -- lifecycle -------------------------------------------------------------------------------

    def _cond(self) -> asyncio.Condition:
        # Created lazily: the actor's event loop exists only once a method runs.
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._planner_task = asyncio.get_running_loop().create_task(self._plan_loop())
        return self._changed

    def node_id(self) -> str:
        """The Ray node (hex id) this actor runs on."""
        from gym_ray.distributed.placement import current_node_id

        return current_node_id()

    def pid(self) -> int:
        """This actor's process id (benchmarks sample its memory)."""
        return os.getpid()

    async def start(self) -> None:
        """Start planning now (otherwise the first ``next_shard`` starts it)."""
        self._cond()

    async def stop_planning(self) -> None:
        """Stop planning after the shard being cut (if any) and join the planner task. Idempotent."""
        cond = self._cond()
        async with cond:
            self._closing = True
            cond.notify_all()
        if self._planner_task is not None:
            await self._planner_task

    async def close(self) -> None:
        """:meth:`stop_planning`, then flush and shut down this process's telemetry (see
        :func:`gym_ray.observe.tracing.shutdown_tracing`). Idempotent."""
        from gym_ray.observe.tracing_gate import shutdown_tracing_if_used
        from gym_ray.store import release_stages

        await self.stop_planning()
        await asyncio.to_thread(shutdown_tracing_if_used)
        release_stages()  # this process's copy of a store folder, if any

    async def _plan_loop(self) -> None:
        cond = self._cond()
        specs: Iterator[ShardSpec] | None = None
        try:
            specs = await asyncio.to_thread(lambda: iter(self._planner()))
            while True:
                async with cond:
                    await cond.wait_for(lambda: self._closing or len(self._planned) < self._lookahead)
                    if self._closing:
                        return
                spec = await asyncio.to_thread(next, specs, None)
                async with cond:
                    if spec is None:
                        self._plan_done = True
                    else:
                        self._planned_shards += 1
                        self._planned_rows += spec.num_rows
                        self._spec[spec.shard] = spec
                        if not self._decided(spec.shard):
                            self._planned.append(spec)
                    cond.notify_all()
                if self._on_planned is not None:
                    await self._on_planned(spec)
                if spec is None:
                    logger.info(
                        "driver: plan complete, %d shards, %d rows", self._planned_shards, self._planned_rows
                    )
                    return
        except GymRayError as exc:
            # Typed errors (bad input, resume conflicts) are the caller's to see: keep and report them.
            logger.error("driver: planning failed: %s", exc)
            async with cond:
                self._plan_error = exc
                cond.notify_all()
        except Exception as exc:
            async with cond:
                self._plan_error = InternalError(f"planning failed: {type(exc).__name__}: {exc}")
                cond.notify_all()
            raise
        finally:
            # A lazy planner stopped early (close) releases its staging folder now, not at GC. Not when
            # cancelled: a planning step may still run in its thread (the generator is executing).
            close = getattr(specs, "close", None)
            task = asyncio.current_task()
            if callable(close) and (task is None or not task.cancelling()):
                await asyncio.to_thread(close)

    # -- hand-out --------------------------------------------------------------------------------

    def _decided(self, shard: str) -> bool:
        """True when a restarted driver's journal says ``shard`` is held or complete (after a failure
        nothing is handed out at all)."""
        return shard in self._owner or shard in self._completed

    def _finished(self) -> bool:
        """True when no more shards will be handed out."""
        if self._plan_error is not None or self._failures or self._closing:
            return True
        return self._plan_done and not self._planned and not self._requeued and not self._owner

    async def next_shard(self, worker_id: str, ask: str | None = None) -> ShardSpec | None:
        """The next shard for ``worker_id`` to run, or ``None`` when it should stop.

        Waits while nothing is queued but shards are still planned or in flight elsewhere (their worker
        might die). Returns ``None`` when every shard is complete, when the run is aborted (a shard or
        the plan failed), or when ``worker_id`` was declared lost or retired.

        ``ask`` names this request (unique per worker and request): the same ``ask`` again (Ray sends a
        call again when the driver's process died before answering it) gets the shard it was given, as
        long as ``worker_id`` still holds it.
        """
        cond = self._cond()
        async with cond:
            if ask is not None and ask in self._asks:
                shard = self._asks[ask]
                # a restarted driver learns the spec when its plan loop reaches the shard again
                await cond.wait_for(lambda: shard in self._spec or self._owner.get(shard) != worker_id)
                if self._owner.get(shard) == worker_id:
                    return self._spec[shard]
            while True:
                if worker_id in self._lost or worker_id in self._retired or self._finished():
                    return None
                if self._requeued:
                    spec = self._requeued.popleft()
                    break
                if self._planned:
                    spec = self._planned.popleft()
                    break
                await cond.wait()
            self._note(give=spec.shard, worker=worker_id, ask=ask)
            if ask is not None:
                self._asks[ask] = spec.shard
            self._owner[spec.shard] = worker_id
            self._spec[spec.shard] = spec
            self._by_worker.setdefault(worker_id, set()).add(spec.shard)
            self._history.setdefault(worker_id, []).append(spec.shard)
            cond.notify_all()  # the planner may cut ahead again
            return spec

    async def shard_finished(
        self, worker_id: str, shard: str, *, accepted: Callable[[], Awaitable[Any] | None] | None = None
    ) -> bool:
        """Record that ``worker_id`` completed ``shard``. False (ignored) if it no longer owns it.

        Args:
            worker_id: The worker reporting.
            shard: The shard it completed.
            accepted: Called under the hand-out lock when the completion is accepted, before the shard
                counts as complete: counting the shard's report here counts it exactly once, even if
                the worker dies right after (its shard is then not re-queued) or was declared lost
                before (the report is not counted; the re-run's is).
        """
        cond = self._cond()
        async with cond:
            if self._owner.get(shard) != worker_id:
                logger.warning(
                    "driver: ignoring completion of shard %s by %s (not its owner)", shard, worker_id
                )
                return False
            if accepted is not None:
                counted = accepted()
                if inspect.isawaitable(counted):
                    await counted
            self._note(done=shard)
            del self._owner[shard]
            self._by_worker[worker_id].discard(shard)
            self._completed.add(shard)
            cond.notify_all()
            return True

    async def shard_failed(self, failure: ShardFailure) -> bool:
        """Record a shard that raised in its worker. Returns True when this aborts the run.

        A failure from a worker that no longer owns the shard (it was declared lost and the shard
        re-queued) is ignored, whatever its type: the shard is someone else's now, and that zombie's next
        write failed with :class:`~gym_ray.errors.ShardLockError`, or it stalled past the no-progress
        timeout while frozen. A failure of the shard's owner aborts the hand-out (workers finish what they
        hold), a ``ShardLockError`` included (something outside this run opened the shard); the run folder
        stays resumable.
        """
        cond = self._cond()
        async with cond:
            owner = self._owner.get(failure.shard)
            if owner != failure.worker:
                level = logging.INFO if failure.error_type == ShardLockError.__name__ else logging.WARNING
                logger.log(
                    level,
                    "driver: ignoring %s of shard %s from %s, which no longer holds it (holder now: %s): %s",
                    failure.error_type,
                    failure.shard,
                    failure.worker,
                    owner or "none, re-queued or complete",
                    failure.message,
                )
                return False
            self._note(
                failed=failure.shard, worker=failure.worker, type=failure.error_type, message=failure.message
            )
            del self._owner[failure.shard]
            self._by_worker[failure.worker].discard(failure.shard)
            self._failures.append(failure)
            logger.error("driver: shard %s failed in %s: %s", failure.shard, failure.worker, failure.message)
            cond.notify_all()
            return True

    async def retire(self, worker_id: str) -> None:
        """Hand ``worker_id`` no more shards: it finishes the ones it holds, then its ``run()`` returns.

        Used to move a worker off a crowded node onto one that joined the cluster mid-run; nothing is
        re-queued and no rollout runs twice.
        """
        cond = self._cond()
        async with cond:
            self._note(retired=worker_id)
            self._retired.add(worker_id)
            cond.notify_all()

    async def worker_lost(self, worker_id: str) -> list[str]:
        """Declare ``worker_id`` dead: its unfinished shards go back to the front of the queue.

        Returns:
            The re-queued shard names, in plan order.
        """
        cond = self._cond()
        async with cond:
            self._note(lost=worker_id)
            self._lost.add(worker_id)
            held = sorted(self._by_worker.pop(worker_id, set()))
            for shard in reversed(held):
                del self._owner[shard]
                if shard in self._spec:
                    self._requeued.appendleft(self._spec[shard])
                # else: a restarted driver's plan loop has not reached it yet, and now queues it
            self._requeued_total += len(held)
            if held:
                logger.warning("driver: worker %s lost; re-queued shards %s", worker_id, ", ".join(held))
            cond.notify_all()
            return held

    async def status(self) -> DriverStatus:
        """A snapshot of the plan, the queue and who holds what."""
        async with self._cond():
            return DriverStatus(
                planned_shards=self._planned_shards,
                planned_rows=self._planned_rows,
                plan_done=self._plan_done,
                queued=len(self._planned) + len(self._requeued),
                in_flight={w: tuple(sorted(s)) for w, s in self._by_worker.items() if s},
                completed=len(self._completed),
                requeued_total=self._requeued_total,
                lost_workers=tuple(sorted(self._lost)),
                failures=tuple(self._failures),
                plan_error=self._plan_error,
                finished=self._finished(),
                assignments={w: tuple(s) for w, s in self._history.items()},
            )

    async def wait_finished(self) -> DriverStatus:
        """Wait until no more shards will be handed out, then return the status."""
        cond = self._cond()
        async with cond:
            await cond.wait_for(self._finished)
        return await self.status()


def _restarted_actor() -> bool:
    """True in a Ray actor process that replaces a dead one (it may have died before journaling)."""
    import ray

    return ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)


@dataclass(frozen=True)
class ConfigPlanner:
    """The run's planner as the driver actor gets it: :func:`plan_from_config` of these arguments."""

    run: RunConfig
    rows: Any = None
    num_workers: int = 1
    checked: CheckedInput | None = None

    def __call__(self) -> Iterator[ShardSpec]:
        return plan_from_config(self.run, self.rows, self.num_workers, self.checked)

    def for_restart(self) -> ConfigPlanner:
        """The planner of a restarted driver: the folder holds this call's plan, so it resumes it even when
        the run was started with ``resume_from_cache=false`` (which refuses a folder that holds a run)."""
        settings = self.run.settings
        if settings.resume_from_cache is not False:
            return self
        run = replace(self.run, settings=settings.model_copy(update={"resume_from_cache": None}))
        return ConfigPlanner(run, self.rows, self.num_workers, None)


def plan_from_config(
    run: RunConfig, rows: Any = None, num_workers: int = 1, checked: CheckedInput | None = None
) -> Iterator[ShardSpec]:
    """Default planner (runs in the driver actor, which imports only this module and planning's): validate
    the input rows, then plan the run lazily.

    Uses :func:`gym_ray.plan.shards.iter_prepare_run`: a whole validation pass first (bad input raises before
    anything is written), then each shard is cut, committed and yielded as the driver asks for it, so
    shard 0 is handed out while the rest of the input is still being cut. On resume the existing shards
    are verified by digest and reused.

    Args:
        run: The run's config, with the topology already resolved.
        rows: ``None`` to read ``input_jsonl_fpath``, or an ``ObjectRef`` of a list of rows.
        num_workers: Workers of the run (sizes shards automatically when ``shard_size`` is unset).
        checked: The validation pass, run by the caller before Ray started
            (:func:`gym_ray.plan.first_pass.validate_ahead`); the driver takes it over instead of
            validating again when it runs on the same host.

    Returns:
        The planned shards, in input order (a generator: planning happens as it is consumed).
    """
    from gym_ray.plan.shards import iter_prepare_run

    # This runs in a thread of the async driver actor: wait on the ref's future (ray.get would warn).
    source: list[dict[str, Any]] | None = rows.future().result() if rows is not None else None
    if run.store_url is not None:
        return _plan_on_store(run, source, num_workers, checked)
    return iter_prepare_run(run, rows=source, num_workers=num_workers, checked=checked)


def _plan_on_store(
    run: RunConfig, rows: list[dict[str, Any]] | None, num_workers: int, checked: CheckedInput | None
) -> Iterator[ShardSpec]:
    """Plan a run whose folder is on an object store, in this process's copy of it: the folder's files are
    copied here first (a resume verifies the shards planned before), and each shard's inputs and manifest
    (with the run's files) are pushed before the shard is handed out."""
    from gym_ray.plan.shards import iter_prepare_run
    from gym_ray.store.mirror import localize, mirror_of

    assert run.store_url is not None
    mirror = mirror_of(run.store_url)
    mirror.pull_files(outputs=False)
    for spec in iter_prepare_run(localize(run), rows=rows, num_workers=num_workers, checked=checked):
        mirror.push_changed()
        yield spec
    mirror.push_changed()


class RunDriver(ShardDriver):
    """The driver actor: a :class:`ShardDriver` that tells the run's coordinator actor of every planned shard
    (``plan_progress``) and of every finished shard it accepts (``record_report``).

    Run as a Ray async actor (``ray.remote(RunDriver).options(num_cpus=0, max_concurrency=...)``, see
    :func:`driver_max_concurrency`). Workers call :meth:`next_shard`, :meth:`report_shard` and
    :meth:`~ShardDriver.shard_failed`; the caller supervises through the rest.

    Args:
        planner: As :class:`ShardDriver`.
        lookahead: As :class:`ShardDriver`.
        coordinator: The name of the run's :class:`~gym_ray.distributed.coordinator.RunCoordinator` actor
            (looked up on first use), or its handle. A restartable actor takes the name: Ray keeps a
            handle passed to an actor's constructor in its object store, where a restart may not find it
            (ray-project/ray#53727).
        journal: This run call's driver journal (see :mod:`gym_ray.distributed.journal`); the actor is
            created with ``max_restarts``, and a restarted process takes up the dead one's hand-outs from
            it. ``None``: no journal (a restart would start over; used by tests).
    """

    def __init__(
        self, planner: Planner, *, lookahead: int, coordinator: Any, journal: str | None = None
    ) -> None:
        kept = None if journal is None else ControlJournal(journal)
        if kept is not None and (kept.path.exists() or _restarted_actor()):
            # A restart: the folder holds this call's plan already, whatever resume_from_cache said.
            planner = getattr(planner, "for_restart", lambda: planner)()
        super().__init__(planner, lookahead=lookahead, on_planned=self._tell_planned, journal=kept)
        self._coordinator_ref = coordinator

    @property
    def _coordinator(self) -> Any:
        if isinstance(self._coordinator_ref, str):
            import ray

            self._coordinator_ref = ray.get_actor(self._coordinator_ref)
        return self._coordinator_ref

    async def _tell_planned(self, spec: ShardSpec | None) -> None:
        await self._coordinator.plan_progress.remote(spec)

    async def report_shard(
        self, worker_id: str, report: ShardReport, by_server: dict[str, tuple[int, float]] | None = None
    ) -> bool:
        """A worker's finished shard: completed and its report counted by the coordinator as one step.

        The report goes to the coordinator under the hand-out lock, only when the completion is accepted
        (see :meth:`ShardDriver.shard_finished`): a worker that dies right after has its shard counted once
        and not re-queued; one declared lost before has its report ignored (the re-run's counts). Returns
        False (nothing counted) if ``worker_id`` no longer owns the shard.
        """

        async def count() -> None:
            await self._coordinator.record_report.remote(report, by_server)

        return await self.shard_finished(worker_id, report.shard, accepted=count)
