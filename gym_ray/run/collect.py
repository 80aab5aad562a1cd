"""Collection of a whole config: plan shards, run each shard, finalize the run.

These are the building blocks the Ray actors reuse: a single-process run and a distributed run execute the
same ``plan_run``, ``run_shard`` and ``finalize_run``; Ray only decides which process runs which shard.

Durability promises (see RELIABILITY.md):

- Planning (:mod:`gym_ray.plan.shards`) validates every row before anything is written and is
  deterministic, so a rerun on the same folder resumes it.
- ``run_shard`` opens the shard's writer with a new token (a zombie writer of the same shard fails on its
  next append), runs only what ``plan_resume`` says is missing, and appends each outcome as soon as it
  arrives: a rollout reported as done is on disk.
- Before a row's ``/run`` leaves, its attempt is announced in the shard's attempt log
  (:mod:`gym_ray.record.attempt_log`, in batches), so a later call on the shard (a resume, or a worker
  that took it over while this call's rows were in flight) sends every rollout this call may have sent
  with a new attempt index; a late result of this call after a takeover is refused by the writer.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

from gym_ray import keys
from gym_ray.config.run_config import ConfigSource, RunConfig, resolve_run_config
from gym_ray.config.settings import RunSettings
from gym_ray.dispatch import latency
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import dispatch
from gym_ray.dispatch.health import ServerHealth, current_health, health_scope
from gym_ray.dispatch.outcomes import CompletedRollout, record_of
from gym_ray.dispatch.pool import client_for
from gym_ray.errors import NoProgressError
from gym_ray.observe.health_metrics import health_metrics
from gym_ray.observe.progress import ProgressCounter, ProgressDisplay
from gym_ray.observe.run_context import run_scope
from gym_ray.observe.tracing_gate import job_span_for, tracer_for
from gym_ray.plan.first_pass import input_rows
from gym_ray.plan.resume import plan_resume
from gym_ray.plan.run_manifest import RUN_MANIFEST
from gym_ray.plan.shards import DEFAULT_SHARD_SIZE, RunPlan, ShardSpec, plan_run, prepare_run
from gym_ray.record.attempt_log import AttemptAnnouncer
from gym_ray.record.run_lock import holding_run_folder
from gym_ray.record.writer import ShardWriter
from gym_ray.run._tasks import first_error, in_stoppable_thread
from gym_ray.run.result import RunResult, ShardReport
from gym_ray.run.row_counts import ShardRowTally
from gym_ray.run.stage_cpu import current_stage_cpu, measuring, stage_cpu_scope

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "RUN_MANIFEST",
    "RunPlan",
    "ShardSpec",
    "acollect_local",
    "client_for",
    "input_rows",
    "plan_run",
    "prepare_run",
    "run_shard",
    "run_shards",
]

#: Seconds between two writes of a running shard's progress file (``gym-ray status`` reads its counts
#: and timestamp, so a live run's rate is measured on counts that match their time).
PROGRESS_FILE_INTERVAL_S = 5.0

OutcomeHook = Callable[[dict[str, Any], dict[str, Any]], None]


# --------------------------------------------------------------------------------------------------
# running one shard


async def run_shard(
    spec: ShardSpec,
    *,
    client: ServerClient,
    run: RunConfig,
    semaphore: asyncio.Semaphore | None = None,
    on_outcome: OutcomeHook | None = None,
    worker: str | None = None,
) -> ShardReport:
    """Run what is missing from one shard and record every outcome through the shard's locked writer.

    Args:
        spec: The shard, planned on disk by :func:`plan_run`.
        client: The HTTP client pool of this process.
        run: The run's config (topology; concurrency, budget, attempts cap, retries; tracing).
        semaphore: Shared across the shards one worker runs at once, so the concurrency window stays
            full across shard boundaries.
        on_outcome: Called with ``(row, record)`` after each record is on disk (streams, progress).
        worker: A name for reports.

    Returns:
        What this call did; ``dispatched == 0`` when the shard was already complete.

    Raises:
        ShardLockError: A newer writer opened the shard while this call ran (this call is the zombie).
        ShardIOError: A write or fsync failed; the shard is failed and resumable.
        ServerOutageError: An environment server looked down for ``server_outage_timeout_s``; nothing was
            recorded for the rows it held back (resumable).

    Infrastructure failures are resent on their own budget through the :class:`ServerHealth` made current
    by :func:`run_shards` (or one of this call's own).
    """
    health = current_health()
    if health is not None:
        return await _run_shard(spec, client, run, semaphore, on_outcome, worker, health)
    async with health_for(run, client) as own:
        return await _run_shard(spec, client, run, semaphore, on_outcome, worker, own)


def health_for(run: RunConfig, client: ServerClient) -> ServerHealth:
    """The server health tracker of one process, from the run's settings (probes go through ``client``).

    With metrics enabled it feeds the ``gym_ray.server.*`` instruments
    (:mod:`gym_ray.observe.health_metrics`).
    """
    return ServerHealth(
        client,
        outage_timeout_s=run.settings.server_outage_timeout_s,
        listener=health_metrics(tracer_for(run.tracing)),
    )


async def _run_shard(
    spec: ShardSpec,
    client: ServerClient,
    run: RunConfig,
    semaphore: asyncio.Semaphore | None,
    on_outcome: OutcomeHook | None,
    worker: str | None,
    health: ServerHealth,
) -> ShardReport:
    started = time.monotonic()
    settings = run.settings
    lease = None
    if run.store_url is not None:  # a folder on an object store: take the shard there, copy it here
        from gym_ray.store.publish import take_shard

        spec, lease = await take_shard(run, spec)
    writer = ShardWriter(
        spec.run_dir,
        spec.shard,
        run_id=spec.run_id,
        config_identity=spec.config_identity,
    )
    writer.open()
    failed_by_class: Counter[str] = Counter()
    succeeded = failed = omitted = 0
    latency_sum_ms = 0.0
    histogram = [0] * latency.NUM_BUCKETS
    stage_cpu = current_stage_cpu()  # None unless a benchmark measures the stages
    try:
        plan = plan_resume(
            spec.run_dir,
            spec.shard,
            max_rollout_attempts=settings.max_rollout_attempts,
            config_identity=spec.config_identity,
        )
        pending = plan.pending
        tally = ShardRowTally(plan, pending, writer.paths.successes)
        completions = dispatch(
            pending,
            client,
            run.topology,
            semaphore=semaphore,
            max_resident_tasks=settings.max_resident_tasks,
            dispatch_budget_s=run.dispatch_budget_left_s(),  # the run's deadline, not one per shard
            drain_margin_s=settings.drain_margin_s,
            route_failures_to_sidecar=settings.route_failures_to_sidecar,
            retry_requests=settings.retry_requests,
            tracer=tracer_for(run.tracing),  # None (no overhead) unless tracing.enabled
            health=health,
            max_infra_retries=settings.max_infra_retries,
            # each row's attempt is in the shard's attempt log before its /run leaves
            before_send=AttemptAnnouncer(pending, writer.announce_attempts),
        )
        stall_s = settings.no_progress_timeout_s
        loop = asyncio.get_running_loop()
        unwatch = None
        try:
            async with asyncio.timeout_at(loop.time() + stall_s) as watchdog:
                progress_due = loop.time() + PROGRESS_FILE_INTERVAL_S

                # A down server's rows wait for its probe, bounded by server_outage_timeout_s instead.
                def keep_alive() -> None:
                    if not watchdog.expired():
                        watchdog.reschedule(loop.time() + stall_s)

                unwatch = health.watch(keep_alive)
                async for row, outcome in completions:
                    watchdog.reschedule(loop.time() + stall_s)
                    if stage_cpu is not None:
                        record_started = time.thread_time()
                    record = record_of(row, outcome)
                    if isinstance(outcome, CompletedRollout) and outcome.rollout_latency_ms is not None:
                        latency_sum_ms += outcome.rollout_latency_ms
                        histogram[latency.bucket_of(outcome.rollout_latency_ms)] += 1
                    written = writer.append(record)
                    tally.add(record, written)
                    if stage_cpu is not None:
                        stage_cpu.add("record", time.thread_time() - record_started)
                    if written is None:
                        omitted += 1
                    elif keys.FAILURE_CLASS in record:
                        failed += 1
                        failed_by_class[str(record[keys.FAILURE_CLASS])] += 1
                    else:
                        succeeded += 1
                    if on_outcome is not None:
                        on_outcome(row, record)
                    if lease is not None and lease.due():
                        await lease.publish()
                    if loop.time() >= progress_due:
                        writer.write_progress()
                        progress_due = loop.time() + PROGRESS_FILE_INTERVAL_S
        except TimeoutError as exc:
            stats = completions.stats()
            raise NoProgressError(
                f"shard {spec.shard}: no rollout finished for {stall_s:g} s while {stats.in_flight} were in "
                f"flight ({succeeded + failed} recorded by this call); the environment servers accept "
                "requests but do not answer. Check them, then rerun on the same output_dir to resume "
                "(raise no_progress_timeout_s for rollouts that legitimately take longer)"
            ) from exc
        finally:
            if unwatch is not None:
                unwatch()
            await completions.aclose()
        writer.write_progress()
    except BaseException:  # an error, or a stop (cancelled): what is recorded stays recorded
        if lease is not None:
            await lease.publish(quiet=True)  # then raised again: a resume runs only the rest
        raise
    finally:
        writer.close()
    if lease is not None:
        await lease.publish()
    return ShardReport(
        latency_ms_sum=latency_sum_ms,
        latency_histogram=histogram,
        shard=spec.shard,
        planned=spec.num_rows,
        already_done=spec.num_rows - len(pending),
        dispatched=len(pending),
        succeeded=succeeded,
        failed=failed,
        failed_by_class=dict(failed_by_class),
        omitted=omitted,
        wall_s=time.monotonic() - started,
        worker=worker,
        rows=tally.rows(),
    )


async def run_shards(
    next_spec: Callable[[], Awaitable[ShardSpec | None]],
    *,
    client: ServerClient,
    run: RunConfig,
    parallel_shards: int = 2,
    on_report: Callable[[ShardReport], Awaitable[None]] | None = None,
    on_outcome: OutcomeHook | None = None,
    worker: str | None = None,
    shard_fn: Callable[..., Awaitable[ShardReport]] | None = None,
    on_error: Callable[[ShardSpec, Exception], Awaitable[None]] | None = None,
) -> list[ShardReport]:
    """Run shards as ``next_spec`` hands them out until it returns None; the loop of one worker.

    The lanes share one :class:`ServerHealth` (made current here unless the caller made one current): a
    server that looks down holds back the rows of every lane until it is back.

    ``parallel_shards`` lanes pull shards and share one semaphore of ``max_resident_tasks`` requests, so
    the concurrency window stays full while one shard drains its tail and the next one starts. Live
    rollout tasks stay below ``parallel_shards * max_resident_tasks``.

    Args:
        next_spec: Hands out the next shard, or None when there is none left (each lane then stops).
        client: The HTTP client pool of this process.
        run: The run's config.
        parallel_shards: Lanes (shards run at once).
        on_report: Awaited with each finished shard's report, in the lane that ran it.
        on_outcome: Passed to the shard function (called per record on disk).
        worker: A name for reports.
        shard_fn: Runs one shard, called like :func:`run_shard` (the default).
        on_error: Awaited with ``(spec, exc)`` when a shard raises an ``Exception``; the lane then moves on
            to the next shard and the other lanes are not disturbed. Without it the first error cancels
            every lane and is raised. Cancellation always propagates.

    Returns:
        The reports of the shards that finished, in completion order.
    """
    run_one = shard_fn or run_shard
    semaphore = asyncio.Semaphore(run.settings.max_resident_tasks)
    health = current_health()
    if health is None:
        async with health_for(run, client) as own:
            with health_scope(own):
                return await run_shards(
                    next_spec,
                    client=client,
                    run=run,
                    parallel_shards=parallel_shards,
                    on_report=on_report,
                    on_outcome=on_outcome,
                    worker=worker,
                    shard_fn=shard_fn,
                    on_error=on_error,
                )
    reports: list[ShardReport] = []

    async def lane() -> None:
        while (spec := await next_spec()) is not None:
            try:
                with run_scope(spec.run_id):  # rollout spans carry the run id
                    report = await run_one(
                        spec,
                        client=client,
                        run=run,
                        semaphore=semaphore,
                        on_outcome=on_outcome,
                        worker=worker,
                    )
            except Exception as exc:
                if on_error is None:
                    raise
                await on_error(spec, exc)
                continue
            reports.append(report)
            if on_report is not None:
                await on_report(report)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(max(1, parallel_shards)):
                group.create_task(lane())
    except BaseExceptionGroup as group_error:
        raise first_error(group_error) from None
    return reports


# --------------------------------------------------------------------------------------------------
# finishing a run


async def acollect_local(
    config: ConfigSource | RunConfig,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    overrides: Iterable[str] = (),
    progress: bool | None = None,
    progress_every_s: float = 1.0,
    require_complete: bool = False,
    **settings: Any,
) -> RunResult:
    """Collect a whole config in this process: plan, run every shard, finalize.

    The single-process form of :func:`gym_ray.acollect`; the same building blocks, no Ray. Running it
    again on the same ``output_dir`` resumes: only what is missing is dispatched.

    Args:
        config: A config dict, YAML path(s), or a :class:`~gym_ray.config.run_config.RunConfig`.
        rows: Input rows (a list); default: the config's ``input_jsonl_fpath``.
        overrides: YAML-path overrides (``+output_dir=runs/r1``).
        progress: Show a :class:`~gym_ray.observe.progress.ProgressDisplay` on stderr (rollouts this call
        runs,
            rate, failures, ETA, mean reward per environment server); None shows it when stderr is a TTY.
        progress_every_s: Seconds between two progress lines at most (a server's outage or return is
            shown at once).
        require_complete: Raise :class:`~gym_ray.errors.IncompleteRunError` when the run ends with failed
            or pending rollouts beyond ``max_failed_fraction`` (the run folder is finalized first).
        **settings: Run settings that win over the config (``output_dir=...``, ``num_repeats=4``).

    Returns:
        The run result (paths, counts, key metrics per environment server).

    Raises:
        UsageError / RecordError / ServerError: :func:`gym_ray.run.preflight.preflight` refused the run
            (nothing planned or sent).
        ResumeError: The folder holds another run (config, input, plan settings; servers at other
            addresses without ``use_new_config``): :func:`gym_ray.run.folder_check.check_run_folder`,
            nothing written.
        RunLockError: Another run holds ``output_dir`` (refused before planning or sending anything).
        ServerOutageError: An environment server stayed down past ``server_outage_timeout_s`` (resumable).
        IncompleteRunError: ``require_complete`` and the run is not complete.
    """
    # Imported here, not at the top: a worker actor imports this module for run_shard alone.
    from gym_ray.run.folder_check import check_run_folder
    from gym_ray.run.preflight import preflight

    started = time.monotonic()
    if require_complete:
        settings = {**settings, "require_complete": True}  # finalize_run raises when the run is incomplete
    with stage_cpu_scope():  # off unless GYM_RAY_STAGE_CPU_FILE is set (gym-ray bench pipeline)
        run = await resolve_run_config(config, overrides=overrides, settings=settings)
        if run.store_to_open:
            from gym_ray.store.mirror import on_store  # a folder on an object store: work on a local copy

            async with on_store(run) as (local, published):
                done = await acollect_local(
                    local, rows=rows, progress=progress, progress_every_s=progress_every_s
                )
                return cast("RunResult", published(done))
        run = run.with_dispatch_deadline()  # dispatch_budget_s counts from here, for every shard
        await preflight(run, rows=rows)
        if run.settings.output_dir is None:
            result = await _collect_locked(run, rows, progress, progress_every_s, started)
        else:
            # The folder against the command (input, config, servers), before it is locked or written.
            check = await asyncio.to_thread(check_run_folder, run, rows)
            with holding_run_folder(
                run.settings.output_dir, what="collect", record=check.record, expect=check.expect
            ) as folder:
                result = await _collect_locked(run, rows, progress, progress_every_s, started)
                folder.finish(result.complete)
    return result


async def _collect_locked(
    run: RunConfig,
    rows: Iterable[Mapping[str, Any]] | None,
    progress: bool | None,
    progress_every_s: float,
    started: float,
) -> RunResult:
    from gym_ray.run.finalize import finalize_run
    from gym_ray.run.preflight import planning_note

    shown = sys.stderr.isatty() if progress is None else progress
    note = planning_note(run.settings, before_ray=False) if shown and rows is None else None
    if note is not None:  # a large input takes seconds to validate and cut: say so
        print(note, file=sys.stderr, flush=True)
    with measuring("plan"):
        plan = await in_stoppable_thread(prepare_run, run, rows=rows)
    specs = iter(plan.shards)

    async def next_spec() -> ShardSpec | None:
        return next(specs, None)

    display = ProgressDisplay(0, stream=sys.stderr, enabled=progress, interval_s=progress_every_s)
    if display.enabled:
        display.total = await asyncio.to_thread(_pending_count, plan, run.settings)
    tracer = tracer_for(run.tracing)
    try:
        with job_span_for(tracer, run_id=plan.run_id, run_dir=plan.run_dir):
            async with client_for(run) as client:
                with display:
                    async with health_for(run, client) as health:
                        unwatch = health.watch(lambda: display.set_note(health.summary()))
                        try:
                            with health_scope(health), measuring("dispatch"):
                                reports = await run_shards(
                                    next_spec,
                                    client=client,
                                    run=run,
                                    on_outcome=ProgressCounter(display) if display.enabled else None,
                                )
                        finally:
                            unwatch()
                return await finalize_run(
                    plan,
                    reports,
                    run=run,
                    client=client,
                    wall_s=time.monotonic() - started,
                    counts_from_reports=True,  # this process ran every shard once, under the run lock
                )
    finally:
        if tracer is not None:  # every span of the run is exported when it returns or raises
            await asyncio.to_thread(tracer.flush)


def _pending_count(plan: RunPlan, settings: RunSettings) -> int:
    """Rollouts a run of ``plan`` still has to dispatch (the progress display's total)."""
    return sum(
        plan_resume(
            plan.run_dir, spec.shard, max_rollout_attempts=settings.max_rollout_attempts
        ).pending_count
        for spec in plan.shards
    )
