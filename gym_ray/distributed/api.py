"""``collect`` / ``acollect``: a whole config collected by Ray actors (driver, workers, coordinator).

Roles (ARCHITECTURE.md, "Ray roles"): one :class:`~gym_ray.distributed.driver.ShardDriver` plans the run and
hands shards out on request; ``num_workers`` :class:`~gym_ray.distributed.worker.RolloutWorker` actors pull
and run them; one :class:`~gym_ray.distributed.coordinator.RunCoordinator` counts shard reports and
finalizes the run (merge, ``/aggregate_metrics`` once per environment server, summary). Each role is its
own kind of actor: one :class:`~gym_ray.distributed.driver.RunDriver`, one ``RunCoordinator`` and the
workers; both control actors sit on the caller's node (or on nodes holding the Ray resource named by
``control_actors_resource``). The same
``plan_run`` / ``run_shard`` / ``finalize_run`` serve a single-process run; Ray only decides which process
runs which shard. All actors use ``num_cpus=0`` (they wait on the network and the disk), so four workers fit
on a 2-CPU local Ray; on a cluster the run folder must be on a file system every node sees.

Ray: with ``address`` (or ``RAY_ADDRESS``) the run joins that cluster; otherwise, when Ray is not running in
this process yet, it starts a local Ray without dashboard and shuts it down afterwards. A Ray already
initialized in this process is used as is and left running.

Failure handling: this module awaits every worker's ``run()``. A worker that dies (``RayActorError``) is
reported to the driver, which puts its unfinished shards back at the front of the queue, and a replacement
worker is started (up to ``max_worker_restarts``). Cancelling ``acollect`` (or Ctrl-C in ``collect``)
cancels the workers' ``run()`` calls, gives them ``cancel_grace_s`` to close their shard writers, then kills
every actor: the run folder stays resumable, and running again on it under any worker count runs only what
is missing. A node that joins mid-run with none of the run's workers gets one moved from the most crowded
node (``rebalance_every_s``): the moved worker finishes its shards first, so nothing runs twice.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gym_ray.config.run_config import ConfigSource, RunConfig, resolve_run_config
from gym_ray.distributed.actors import (
    DEFAULT_CLOSE_GRACE_S,
    RunActors,
    raise_if_control_actor_lost,
    stop_poller,
    teardown_actors,
)
from gym_ray.distributed.coordinator import FinalizeFn, RunCoordinator, coordinator_max_concurrency
from gym_ray.distributed.driver import (
    ConfigPlanner,
    Planner,
    RunDriver,
    driver_max_concurrency,
    plan_from_config,
)
from gym_ray.distributed.journal import call_folder, remove_call_folder
from gym_ray.distributed.live import (
    DEFAULT_PROGRESS_INTERVAL_S,
    ProgressHook,
    ProgressView,
    poll_progress,
    progress_snapshot,
)
from gym_ray.distributed.placement import (
    WorkerPlacement,
    control_actor_options,
    default_num_workers,
    ray_connection,
)
from gym_ray.distributed.worker import (
    DEFAULT_SHARDS_IN_FLIGHT,
    RolloutWorker,
    ShardFn,
    WorkerTotals,
    worker_max_concurrency,
)
from gym_ray.errors import (
    InternalError,
    NoProgressError,
    UsageError,
)
from gym_ray.observe.tracing_gate import job_span_for, tracer_for
from gym_ray.record.run_lock import holding_run_folder
from gym_ray.run._tasks import in_stoppable_thread
from gym_ray.run.folder_check import check_run_folder
from gym_ray.run.preflight import planning_note, preflight
from gym_ray.run.signals import run_until_signal

#: Seconds between two looks for a node that joined the cluster with none of the run's workers.
DEFAULT_REBALANCE_S = 10.0

if TYPE_CHECKING:
    from gym_ray.observe.tracing import Tracer
    from gym_ray.plan.first_pass import CheckedInput
    from gym_ray.run.result import RunResult
    from gym_ray.store.mirror import Mirror

logger = logging.getLogger(__name__)

#: Seconds cancelled workers get to close their shard writers before their actors are killed.
DEFAULT_CANCEL_GRACE_S = 10.0


async def run_actors(
    run: RunConfig,
    planner: Planner,
    *,
    run_dir: str,
    num_workers: int,
    started_at: float | None = None,
    shard_fn: ShardFn | None = None,
    finalize_fn: FinalizeFn | None = None,
    shards_in_flight: int = DEFAULT_SHARDS_IN_FLIGHT,
    max_worker_restarts: int | None = None,
    cancel_grace_s: float = DEFAULT_CANCEL_GRACE_S,
    close_grace_s: float = DEFAULT_CLOSE_GRACE_S,
    on_started: Callable[[RunActors], None] | None = None,
    traceparent: str | None = None,
    on_progress: ProgressHook | None = None,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    rebalance_every_s: float | None = DEFAULT_REBALANCE_S,
) -> RunResult:
    """Run a planned collection on the Ray this process is connected to (Ray must be initialized).

    Starts the run's coordinator actor, its driver actor (with ``planner``) and ``num_workers`` workers,
    supervises the workers (replacing dead ones), then finalizes through the coordinator.

    Args:
        run: The run's config (shipped to every actor as this object).
        planner: Yields the run's shards (see :class:`~gym_ray.distributed.driver.ShardDriver`).
        run_dir: The run folder.
        num_workers: Worker actors to start.
        started_at: ``time.monotonic()`` when the caller's run started (wall time in the summary).
        shard_fn: Runs one shard in a worker (default :func:`gym_ray.run.collect.run_shard`).
        finalize_fn: Finalizes the run in the coordinator (default :func:`gym_ray.run.finalize.finalize_run`).
        shards_in_flight: Shards each worker runs at once (sharing its admission semaphore).
        max_worker_restarts: Replacement workers allowed in total (default ``2 x num_workers``).
        cancel_grace_s: On cancellation, seconds workers get to close their writers before being killed.
        close_grace_s: Seconds the actors get, all at once, to flush their telemetry (their ``close()``)
            before they are killed, at the end of every run (finished, failed or cancelled).
        on_started: Called once the actors exist, with the live :class:`RunActors` (it stays current).
        traceparent: W3C ``traceparent`` of the caller's job span, given to every worker so rollout spans
            link to it (see :func:`gym_ray.observe.tracing.current_traceparent`).
        on_progress: Called every ``progress_interval_s`` with a
            :class:`~gym_ray.distributed.live.ProgressSnapshot` (absolute counts; see that module), and
            once more, exact, after every worker returned (before finalization).
        progress_interval_s: Seconds between two progress polls.
        rebalance_every_s: Seconds between two looks for a node with CPUs that none of the run's workers
            is on (one joined the cluster) while another node has two or more: then one worker of that
            node finishes its shards and a replacement starts on the new node (None: never).

    Returns:
        The run result from ``finalize_run``.

    Raises:
        GymRayError: The plan failed (bad input, resume conflict) or a shard failed in a worker: that
            error, re-raised; the run folder stays resumable.
        NoProgressError: Every worker died and the restart budget is spent.
        CancelledError: Cancelled; the actors are killed, the run folder stays resumable.
    """
    import ray

    run = run.with_dispatch_deadline()  # kept when the caller set it; every actor gets this one
    settings = run.settings
    started = time.monotonic() if started_at is None else started_at
    if num_workers < 1:
        raise UsageError(f"num_workers must be >= 1, got {num_workers}; pass num_workers=1 or more")
    cap = settings.concurrency_cap
    if cap is not None and num_workers > cap:
        logger.warning(
            "collect: %d workers asked, but num_samples_in_parallel=%d allows at most %d rollouts in flight "
            "for the whole run; starting %d workers",
            num_workers,
            cap,
            cap,
            cap,
        )
        num_workers = cap
    shares = worker_shares(cap, num_workers)
    restarts_left = 2 * num_workers if max_worker_restarts is None else max_worker_restarts
    driver_concurrency = driver_max_concurrency(num_workers, shards_in_flight)
    coordinator_concurrency = coordinator_max_concurrency(num_workers, shards_in_flight)
    worker_concurrency = worker_max_concurrency(settings)
    control = control_actor_options(settings.control_actors_resource)
    logger.info(
        "collect: %d workers x %d shard lanes, max_resident_tasks=%d and max_connections=%d per worker; "
        "actor max_concurrency: driver=%d coordinator=%d worker=%d; num_cpus=0 for every actor, "
        "workers spread over the nodes with CPUs, driver and coordinator %s",
        num_workers,
        shards_in_flight,
        settings.max_resident_tasks,
        settings.max_connections,
        driver_concurrency,
        coordinator_concurrency,
        worker_concurrency,
        "on this node"
        if settings.control_actors_resource is None
        else f"on a node with Ray resource {settings.control_actors_resource!r}",
    )
    # Actor handles are typed Any: Ray's stubs do not type ``.remote`` calls of plain classes.
    # A control actor whose process dies is restarted by Ray and takes up its journal; calls it left
    # unanswered are sent again (each is answered the same way twice, see gym_ray.distributed.journal).
    journals = call_folder(run_dir)
    control["max_restarts"] = settings.control_actor_restarts
    control["max_task_retries"] = -1 if settings.control_actor_restarts else 0
    coordinator_name = f"gym_ray_coordinator_{Path(journals).name}"  # see RunDriver's coordinator
    coordinator: Any = (
        ray.remote(RunCoordinator)
        .options(max_concurrency=coordinator_concurrency, name=coordinator_name, **control)
        .remote(run_dir, run, finalize_fn=finalize_fn, journal=f"{journals}/coordinator.jsonl")
    )
    driver: Any = (
        ray.remote(RunDriver)
        .options(max_concurrency=driver_concurrency, **control)
        .remote(
            planner,
            lookahead=2 * num_workers,
            coordinator=coordinator_name,
            journal=f"{journals}/driver.jsonl",
        )
    )
    actors = RunActors(driver=driver, coordinator=coordinator)
    worker_class: Any = ray.remote(RolloutWorker)
    placement = WorkerPlacement()
    runs: dict[asyncio.Future[WorkerTotals], str] = {}
    refs: dict[str, Any] = {}

    share_of: dict[str, int | None] = {}

    def create_worker(worker_id: str, share: int | None) -> Any:
        share_of[worker_id] = share
        # A whole-run cap is split across workers: each admits at most its share, the shares sum to it.
        worker_run = run if share is None else run.with_share(share)
        live = set(actors.live())
        options = placement.options(worker_id, live)
        node = placement.node_of(worker_id)
        if node is not None:
            actors.nodes[worker_id] = node
        handle: Any = worker_class.options(max_concurrency=worker_concurrency, **options).remote(
            worker_id,
            driver,
            worker_run,
            shard_fn=shard_fn,
            shards_in_flight=shards_in_flight,
            traceparent=traceparent,
        )
        actors.workers[worker_id] = handle
        return handle

    def launch(worker_id: str) -> None:
        refs[worker_id] = actors.workers[worker_id].run.remote()
        runs[asyncio.ensure_future(refs[worker_id])] = worker_id

    poller: asyncio.Future[None] | None = None

    def live_workers() -> list[Any]:
        return [handle for worker_id, handle in actors.workers.items() if worker_id not in actors.lost]

    finished = False
    try:
        # The control actors and the workers start at once (their processes start and import in
        # parallel); the driver starts planning as soon as it is up.
        driver_started = driver.start.remote()
        coordinator_up = coordinator.pid.remote()
        initial = [f"w{index}" for index in range(num_workers)]
        workers_up = [create_worker(w, share).pid.remote() for w, share in zip(initial, shares, strict=True)]
        await asyncio.gather(driver_started, coordinator_up)
        # Start line: every worker process is up before any pulls, so early workers cannot take the
        # whole first wave of shards. A worker that failed to start fails its run() and is replaced.
        await asyncio.gather(*workers_up, return_exceptions=True)
        for worker_id in initial:
            launch(worker_id)
        next_index = num_workers
        if on_started is not None:
            on_started(actors)
        if on_progress is not None:
            poller = asyncio.ensure_future(
                poll_progress(coordinator, live_workers, on_progress, interval_s=progress_interval_s)
            )
        moving: str | None = None
        while runs:
            done, _ = await asyncio.wait(runs, timeout=rebalance_every_s, return_when=asyncio.FIRST_COMPLETED)
            if not done and moving is None:
                moving = await _move_a_worker(driver, placement, actors)
            for call in done:
                worker_id = runs.pop(call)
                try:
                    actors.totals[worker_id] = call.result()
                    if worker_id == moving:  # its shards are done: its replacement goes to the new node
                        moving = None
                        replacement = f"w{next_index}"
                        next_index += 1
                        create_worker(replacement, share_of[worker_id])
                        launch(replacement)
                except ray.exceptions.RayActorError as exc:
                    moving = None if worker_id == moving else moving
                    # A worker's run() also fails when a control actor it talks to died: name that
                    # actor instead of blaming (and replacing) the workers.
                    await raise_if_control_actor_lost(actors, run_dir, settings.control_actor_restarts)
                    actors.lost.append(worker_id)
                    requeued = await driver.worker_lost.remote(worker_id)
                    logger.warning(
                        "collect: worker %s died (%s); re-queued %d shards",
                        worker_id,
                        type(exc).__name__,
                        len(requeued),
                    )
                    status = await driver.status.remote()
                    if not status.finished and restarts_left > 0:
                        restarts_left -= 1
                        replacement = f"w{next_index}"
                        next_index += 1
                        logger.warning("collect: starting replacement worker %s", replacement)
                        create_worker(replacement, share_of[worker_id])  # takes over the lost share
                        launch(replacement)
        await stop_poller(poller)
        if on_progress is not None:
            # Every report is in; the workers (still up) add what their failed shards wrote: exact.
            on_progress(await progress_snapshot(coordinator, live_workers()))
        await driver.stop_planning.remote()
        status = await driver.status.remote()
        if status.plan_error is not None:
            raise status.plan_error
        if status.failures:
            first = status.failures[0]
            if first.error is not None:
                raise first.error
            raise InternalError(f"shard {first.shard} failed in worker {first.worker}: {first.message}")
        if not status.finished:
            raise NoProgressError(
                f"every worker died ({', '.join(actors.lost)}) and the restart budget is spent; "
                f"{status.queued} shards are unfinished in {run_dir}. "
                "Run again on the same output_dir to resume"
            )
        # The closing counts come from the workers' shard reports when the run handed every shard out
        # once and lost no worker: each shard then had one writer, under its lock, from its resume plan
        # to its report, as in a single-process run. Otherwise the shards are read again.
        once = status.requeued_total == 0 and not status.lost_workers
        result: RunResult = await coordinator.finalize.remote(
            num_workers=num_workers, wall_s=time.monotonic() - started, counts_from_reports=once
        )
        finished = True
        from gym_ray.finalize.metrics_summary import adopt_written_summary

        # The caller prints the headline from the coordinator's summary, not from a second read of the
        # metrics file; if the coordinator cannot say (it just died), the file is read.
        try:
            adopt_written_summary(await coordinator.written_metrics_summary.remote(), url=result.metrics_path)
        except ray.exceptions.RayError as exc:
            logger.debug("collect: the coordinator's metrics summary is not available: %s", exc)
        return result
    except ray.exceptions.RayActorError:
        await raise_if_control_actor_lost(actors, run_dir, settings.control_actor_restarts)
        raise
    finally:
        await stop_poller(poller)
        try:
            await teardown_actors(
                actors, runs, refs, graceful=finished, grace_s=cancel_grace_s, close_grace_s=close_grace_s
            )
        finally:
            remove_call_folder(journals)


async def _move_a_worker(driver: Any, placement: WorkerPlacement, actors: RunActors) -> str | None:
    """Retire one worker of a crowded node when a node with CPUs has none (see ``rebalance_every_s``)."""
    worker_id = placement.worker_to_move(actors.live())
    if worker_id is None:
        return None
    status = await driver.status.remote()
    if status.finished or (status.plan_done and not status.queued):
        return None  # nothing left to hand out: moving would not add work anywhere
    actors.moved.append(worker_id)
    await driver.retire.remote(worker_id)
    logger.info("collect: a node without workers joined; worker %s finishes its shards and moves", worker_id)
    return worker_id


def worker_shares(cap: int | None, num_workers: int) -> list[int | None]:
    """Each worker's part of a whole-run cap on rollouts in flight: parts differ by at most one and sum to
    ``cap`` (``num_workers`` <= ``cap``); ``[None] * num_workers`` without a cap.

    Example:
        >>> worker_shares(7, 3)
        [3, 2, 2]
    """
    if cap is None:
        return [None] * num_workers
    base, extra = divmod(cap, num_workers)
    return [base + (1 if index < extra else 0) for index in range(num_workers)]


async def acollect(
    config: ConfigSource | RunConfig,
    *,
    address: str | None = None,
    num_workers: int | None = None,
    overrides: Sequence[str] = (),
    rows: Iterable[Mapping[str, Any]] | None = None,
    progress: bool | None = None,
    progress_every_s: float = 1.0,
    require_complete: bool = False,
    **settings: Any,
) -> RunResult:
    """Collect a whole config on Ray; usable from a running event loop (a notebook cell).

    Example::

        result = await gym_ray.acollect("demo.yaml", output_dir="runs/demo", num_workers=4)
        print(result.succeeded, result.key_metrics)

    Args:
        config: A config dict, the path(s) of YAML config file(s), or a built
            :class:`~gym_ray.config.run_config.RunConfig`.
        address: A Ray cluster to join (default: ``RAY_ADDRESS``, else a local Ray started for this run).
        num_workers: Worker actors (default: the ``num_workers`` setting, else the cluster's CPU count,
            at most 16).
        overrides: ``key=value`` overrides applied to a config file.
        rows: Input rows, instead of the config's ``input_jsonl_fpath`` (shipped to the driver via the
            object store).
        progress: Show a live progress line on stderr (done/total, rate, failures, ETA, mean reward by
            environment server), refreshed every second from the workers' counters; default: when
            stderr is a TTY. Off a TTY each update is a plain line (for batch logs).
        progress_every_s: Seconds between two progress lines (``gym-ray run`` uses 30 off a TTY).
        require_complete: Raise :class:`~gym_ray.errors.IncompleteRunError` when the run ends with failed
            or pending rollouts beyond ``max_failed_fraction`` (after the run folder is finalized; the
            result's ``complete`` says the same without raising).
        **settings: Run settings set on top of the config (``output_dir=...``, ``shard_size=...``).

    Returns:
        The run result (paths, counts, metrics, summary).

    Tracing: with ``tracing.enabled`` the run executes inside the ``gym_ray.job`` span (this process)
    and every worker links its rollouts' root spans to it (:mod:`gym_ray.observe.tracing`).

    Raises:
        ConfigError / InputError / RecordError / ServerError: Bad config, input, ``output_dir``, worker count
            or an unreachable environment server (:func:`gym_ray.run.preflight.preflight`, before Ray starts).
        RunLockError: Another run holds ``output_dir`` (before Ray starts).
        ResumeError: The folder holds another run (config, input, plan settings; servers at other
            addresses without ``use_new_config``), before Ray starts and with nothing written.
        GymRayError: Planning or a shard failed; the run folder is resumable.
        ActorLostError: The run's driver or coordinator actor died; the run folder is resumable.
        IncompleteRunError: ``require_complete`` and the run is not complete.
        CancelledError: Cancelled; the actors are stopped, the run folder is resumable.
    """
    started = time.monotonic()
    # Config errors surface here, before Ray starts; a head-only config is completed from the head.
    if require_complete:
        settings = {**settings, "require_complete": True}  # finalize_run raises when the run is incomplete
    run = await resolve_run_config(config, overrides=overrides, settings=settings)
    if run.store_to_open:
        from gym_ray.store.mirror import on_store  # a folder on an object store: work on a local copy

        async with on_store(run) as (local, publish):
            return cast(
                "RunResult",
                publish(
                    await acollect(
                        local,
                        address=address,
                        num_workers=num_workers,
                        rows=rows,
                        progress=progress,
                        progress_every_s=progress_every_s,
                    )
                ),
            )
    # dispatch_budget_s counts from here (Ray's start included) for every shard of every worker.
    run = run.with_dispatch_deadline()
    run_settings = run.settings
    row_list = [dict(row) for row in rows] if rows is not None else None
    # Everything knowable before dispatch (input, output_dir, workers, servers) is refused here.
    await preflight(run, rows=row_list, num_workers=num_workers)
    run_dir = str(Path(str(run_settings.output_dir)))
    tracer = tracer_for(run.tracing)
    show = sys.stderr.isatty() if progress is None else progress
    # The folder against the command (busy, input, config, servers): refused before it is locked or written.
    check = await asyncio.to_thread(check_run_folder, run, row_list)
    # Held before Ray starts: a folder taken meanwhile is refused at once.
    with holding_run_folder(run_dir, what="collect", record=check.record, expect=check.expect) as folder:
        from gym_ray.plan.first_pass import CheckedInput, validate_ahead

        mirror = _mirror_of(run)
        if mirror is not None:  # the run's record and "running" state on the store from the start
            await asyncio.to_thread(mirror.push_changed)

        # Every row is validated before Ray starts; the driver actor takes the pass over.
        note = planning_note(run_settings, before_ray=True) if show and row_list is None else None
        if note is not None:  # a large input takes seconds to validate: say so
            print(note, file=sys.stderr, flush=True)
        checked = await in_stoppable_thread(validate_ahead, run, row_list, discard=CheckedInput.discard)
        view = ProgressView(stream=sys.stderr, enabled=True, interval_s=progress_every_s) if show else None
        try:
            result = await _collect_on_ray(
                run, row_list, checked, address, num_workers, started, tracer, view
            )
        finally:
            checked.discard()
            if mirror is not None:  # the driver planned in its own copy: whether it did is known here
                from gym_ray.plan.run_manifest import RUN_MANIFEST

                await asyncio.to_thread(mirror.pull_files, [RUN_MANIFEST])
        folder.finish(result.complete)
        return result


async def _collect_on_ray(
    run: RunConfig,
    row_list: list[dict[str, Any]] | None,
    checked: CheckedInput,
    address: str | None,
    num_workers: int | None,
    started: float,
    tracer: Tracer | None,
    view: ProgressView | None,
) -> RunResult:
    """The part of :func:`acollect` that runs while it holds the run folder: Ray, the actors, the flush."""
    run_dir = str(Path(str(run.settings.output_dir)))
    try:
        async with ray_connection(address) as ray:
            workers = num_workers or run.settings.num_workers or default_num_workers(ray)
            rows_ref = ray.put(row_list) if row_list is not None else None
            planner = ConfigPlanner(run, rows_ref, workers, checked)
            with job_span_for(tracer, run_dir=run_dir) as span:
                result = await run_actors(
                    run,
                    planner,
                    run_dir=run_dir,
                    num_workers=workers,
                    started_at=started,
                    traceparent=_traceparent_of(span),
                    on_progress=view,
                )
                if span is not None:
                    from gym_ray.observe.tracing import ATTR_RUN_ID

                    span.set_attribute(ATTR_RUN_ID, result.run_id)
    finally:
        try:
            await _flush(tracer)  # the job span is exported when collect returns or raises
        finally:
            if view is not None:
                view.close()
    return result


def _mirror_of(run: RunConfig) -> Mirror | None:
    """This process's copy of the run's object-store folder, or None for a local folder."""
    if run.store_url is None:
        return None
    from gym_ray.store.mirror import mirror_of

    return mirror_of(run.store_url)


def _traceparent_of(span: Any) -> str | None:
    """The W3C ``traceparent`` of the current job span, for the workers to link to; None without one."""
    if span is None:
        return None
    from gym_ray.observe.tracing import current_traceparent

    return current_traceparent()


async def _flush(tracer: Tracer | None) -> None:
    """Export this process's finished spans and metric values now (the tracer stays usable)."""
    if tracer is not None:
        await asyncio.to_thread(tracer.flush)


def collect(
    config: ConfigSource | RunConfig,
    *,
    address: str | None = None,
    num_workers: int | None = None,
    overrides: Sequence[str] = (),
    rows: Iterable[Mapping[str, Any]] | None = None,
    progress: bool | None = None,
    progress_every_s: float = 1.0,
    require_complete: bool = False,
    **settings: Any,
) -> RunResult:
    """Collect a whole config on Ray (blocking). Same arguments as :func:`acollect`.

    Example::

        result = gym_ray.collect("demo.yaml", output_dir="runs/demo", num_workers=4)

    Raises:
        UsageError: Called from a running event loop; use ``await acollect(...)`` there.
        KeyboardInterrupt: Ctrl-C; the actors are stopped first and the run folder is resumable.
        RunTerminated: SIGTERM (in the main thread), handled like Ctrl-C; a ``KeyboardInterrupt``.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise UsageError(
            "collect() was called from a running event loop (a notebook cell?); "
            "use `await acollect(...)` there"
        )
    return run_until_signal(
        acollect(
            config,
            address=address,
            num_workers=num_workers,
            overrides=overrides,
            rows=rows,
            progress=progress,
            progress_every_s=progress_every_s,
            require_complete=require_complete,
            **settings,
        )
    )


__all__ = ["RunActors", "acollect", "collect", "plan_from_config", "run_actors", "worker_shares"]
