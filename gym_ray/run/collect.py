"""Collection of a whole config: plan shards, run each shard, finalize the run.

These are the building blocks the Ray actors reuse: a single-process run and a distributed run execute the
same ``plan_run``, ``run_shard`` and ``finalize_run``; Ray only decides which process runs which shard.

Durability promises (see RELIABILITY.md):

- Planning (:mod:`gym_ray.plan.shards`) validates every row before anything is written and is
  deterministic, so a rerun on the same folder resumes it.
- ``run_shard`` opens the shard's writer with a new token (a zombie writer of the same shard fails on its
  next append), runs only what ``plan_resume`` says is missing, and appends each outcome as soon as it
  arrives: a rollout reported as done is on disk.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gym_ray import keys
from gym_ray.config.run_config import ConfigSource, RunConfig, resolve_run_config
from gym_ray.config.settings import RunSettings
from gym_ray.dispatch import latency
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import dispatch
from gym_ray.dispatch.outcomes import CompletedRollout, record_of
from gym_ray.errors import NoProgressError, RunRejectedError
from gym_ray.observe.progress import ProgressCounter, ProgressDisplay
from gym_ray.observe.tracing import job_span, run_scope, setup_tracing
from gym_ray.plan.resume import plan_resume
from gym_ray.plan.shards import (
    DEFAULT_SHARD_SIZE,
    RUN_MANIFEST,
    RunPlan,
    ShardSpec,
    input_rows,
    plan_run,
    prepare_run,
)
from gym_ray.record.aggregate import (
    aggregate_run,
    raise_for_aggregation_errors,
    raise_for_completion_rejection,
    read_metrics_summary,
)
from gym_ray.record.atomic import atomic_write_bytes
from gym_ray.record.merge import merge_shards
from gym_ray.record.nemo_layout import publish_nemo_gym_layout
from gym_ray.record.writer import ShardWriter
from gym_ray.run._tasks import first_error

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "RUN_MANIFEST",
    "SUMMARY_FILE",
    "RunPlan",
    "RunResult",
    "ShardReport",
    "ShardSpec",
    "acollect_local",
    "client_for",
    "finalize_run",
    "input_rows",
    "plan_run",
    "prepare_run",
    "run_shard",
    "run_shards",
]

SUMMARY_FILE = "rollouts_summary.json"
#: Seconds between two writes of a running shard's progress file (``gym-ray status`` reads its counts
#: and timestamp, so a live run's rate is measured on counts that match their time).
PROGRESS_FILE_INTERVAL_S = 5.0

OutcomeHook = Callable[[dict[str, Any], dict[str, Any]], None]


class ShardReport(BaseModel):
    """What running one shard did. Crosses Ray actor boundaries (plain, picklable data)."""

    model_config = ConfigDict(frozen=True)

    shard: str
    planned: int
    already_done: int
    dispatched: int
    succeeded: int
    failed: int
    failed_by_class: dict[str, int]
    omitted: int
    wall_s: float
    worker: str | None = None
    latency_ms_sum: float = 0.0
    latency_histogram: list[int] = Field(default_factory=list)


class RunResult(BaseModel):
    """The outcome of a whole collection: where things are, what happened, the headline metrics."""

    model_config = ConfigDict(frozen=True)

    run_dir: str
    run_id: str
    rollouts_path: str
    failures_path: str
    metrics_path: str | None
    summary_path: str
    planned: int
    succeeded: int
    failed: int
    failed_by_class: dict[str, int]
    omitted: int
    dispatched: int
    already_done: int
    wall_s: float
    rollouts_per_s: float
    num_workers: int
    key_metrics: dict[str, dict[str, Any]]
    aggregation_errors: dict[str, str]
    latency_ms: dict[str, float | None] = Field(default_factory=dict)


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
    """
    started = time.monotonic()
    settings = run.settings
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
    try:
        plan = plan_resume(
            spec.run_dir,
            spec.shard,
            max_rollout_attempts=settings.max_rollout_attempts,
            config_identity=spec.config_identity,
        )
        pending = plan.pending
        completions = dispatch(
            pending,
            client,
            run.topology,
            semaphore=semaphore,
            max_resident_tasks=settings.max_resident_tasks,
            dispatch_budget_s=settings.dispatch_budget_s,
            drain_margin_s=settings.drain_margin_s,
            route_failures_to_sidecar=settings.route_failures_to_sidecar,
            retry_requests=settings.retry_requests,
            tracer=setup_tracing(run.tracing),  # None (no overhead) unless tracing.enabled
        )
        stall_s = settings.no_progress_timeout_s
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + stall_s) as watchdog:
                progress_due = loop.time() + PROGRESS_FILE_INTERVAL_S
                async for row, outcome in completions:
                    watchdog.reschedule(loop.time() + stall_s)
                    record = record_of(row, outcome)
                    if isinstance(outcome, CompletedRollout) and outcome.rollout_latency_ms is not None:
                        latency_sum_ms += outcome.rollout_latency_ms
                        histogram[latency.bucket_of(outcome.rollout_latency_ms)] += 1
                    written = writer.append(record)
                    if written is None:
                        omitted += 1
                    elif keys.FAILURE_CLASS in record:
                        failed += 1
                        failed_by_class[str(record[keys.FAILURE_CLASS])] += 1
                    else:
                        succeeded += 1
                    if on_outcome is not None:
                        on_outcome(row, record)
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
            await completions.aclose()
        writer.write_progress()
    finally:
        writer.close()
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
# the HTTP client


def client_for(run: RunConfig) -> ServerClient:
    """The HTTP client pool of one process, sized from the run's settings."""
    settings = run.settings
    return ServerClient(
        run.topology,
        max_connections=settings.max_connections,
        connect_timeout_s=settings.connect_timeout_s,
        request_timeout_s=settings.request_timeout_s,
        retry_requests=settings.retry_requests,
    )


# --------------------------------------------------------------------------------------------------
# finishing a run


async def finalize_run(
    plan: RunPlan,
    reports: Iterable[ShardReport],
    *,
    run: RunConfig,
    client: ServerClient,
    wall_s: float,
    num_workers: int = 1,
) -> RunResult:
    """Merge the shards, check completion, aggregate once per environment server, write the summary.

    With ``disable_aggregation`` no ``/aggregate_metrics`` call is made and no metrics file is written.
    With ``output_jsonl_fpath`` the merged files are published under NeMo Gym's names
    (:mod:`gym_ray.record.nemo_layout`) and the result's paths point there. With ``require_complete`` a
    run that has fewer successes than planned rollouts raises :class:`~gym_ray.errors.RunRejectedError`
    after every file is written (NeMo Gym's ``EVAL FAILED``).

    A strict run with unfinished work is rejected before aggregation (no score is published). When an
    ``/aggregate_metrics`` call fails, the metrics file keeps an entry with ``aggregation_error``, the
    summary is written, and then one :class:`~gym_ray.errors.AggregationError` names every failed server.
    """
    reports = list(reports)
    settings = run.settings
    root = Path(plan.run_dir)
    merged = await asyncio.to_thread(merge_shards, root)
    settled = merged.successes + merged.terminal_failures
    if settings.strict:
        pending = sum(
            plan_resume(root, spec.shard, max_rollout_attempts=settings.max_rollout_attempts).pending_count
            for spec in plan.shards
        )
        raise_for_completion_rejection(
            expected=plan.planned,
            completed=settled,
            can_retry=pending > 0,
            made_progress=any(r.succeeded or r.failed for r in reports),
            strict=True,
        )
    metrics_path = (
        None
        if settings.disable_aggregation
        else await aggregate_run(root, run.topology, client, raise_on_error=False)
    )
    entries = read_metrics_summary(metrics_path) if metrics_path else []
    key_metrics = {e["_ng_environment_server"]: e.get("key_metrics", {}) for e in entries}
    errors = {
        e["_ng_environment_server"]: e["aggregation_error"] for e in entries if "aggregation_error" in e
    }
    failed_by_class: Counter[str] = Counter()
    for report in reports:
        failed_by_class.update(report.failed_by_class)
    dispatched = sum(r.dispatched for r in reports)
    latencies = latency.merge(r.latency_histogram for r in reports)
    timed = sum(latencies)
    rollouts_path, failures_path = Path(merged.successes_path), Path(merged.failures_path)
    if settings.output_jsonl_fpath is not None:
        published = await asyncio.to_thread(
            publish_nemo_gym_layout,
            root,
            settings.output_jsonl_fpath,
            rollouts=rollouts_path,
            failures=failures_path,
            metrics=metrics_path,
        )
        rollouts_path, failures_path = published.rollouts, published.failures
        metrics_path = published.aggregate_metrics if metrics_path is not None else None
    result = RunResult(
        run_dir=str(root),
        run_id=plan.run_id,
        rollouts_path=str(rollouts_path),
        failures_path=str(failures_path),
        metrics_path=str(metrics_path) if metrics_path else None,
        summary_path=str(root / SUMMARY_FILE),
        planned=plan.planned,
        succeeded=merged.successes,
        failed=merged.failures,
        failed_by_class=dict(failed_by_class),
        omitted=sum(r.omitted for r in reports),
        dispatched=dispatched,
        already_done=sum(r.already_done for r in reports),
        wall_s=wall_s,
        rollouts_per_s=dispatched / wall_s if wall_s > 0 else 0.0,
        num_workers=num_workers,
        key_metrics=key_metrics,
        aggregation_errors=errors,
        latency_ms={
            "mean": sum(r.latency_ms_sum for r in reports) / timed if timed else None,
            "p50": latency.quantile_ms(latencies, 0.5),
            "p99": latency.quantile_ms(latencies, 0.99),
        },
    )
    atomic_write_bytes(root / SUMMARY_FILE, (result.model_dump_json(indent=2) + "\n").encode())
    if metrics_path is not None:
        raise_for_aggregation_errors(metrics_path)
    if settings.require_complete and merged.successes < plan.planned:
        # NeMo Gym 0.7's check_completion: after every file is written, successes only count.
        raise RunRejectedError(
            f"EVAL FAILED: {merged.successes}/{plan.planned} samples completed (require_complete=true). "
            f"Partial artifacts retained at {rollouts_path}; rerun on the same output to resume"
        )
    return result


async def acollect_local(
    config: ConfigSource | RunConfig,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    overrides: Iterable[str] = (),
    progress: bool | None = None,
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
        **settings: Run settings that win over the config (``output_dir=...``, ``num_repeats=4``).

    Returns:
        The run result (paths, counts, key metrics per environment server).
    """
    started = time.monotonic()
    run = await resolve_run_config(config, overrides=overrides, settings=settings)
    plan = await asyncio.to_thread(prepare_run, run, rows=rows)
    specs = iter(plan.shards)

    async def next_spec() -> ShardSpec | None:
        return next(specs, None)

    display = ProgressDisplay(0, stream=sys.stderr, enabled=progress)
    if display.enabled:
        display.total = await asyncio.to_thread(_pending_count, plan, run.settings)
    tracer = setup_tracing(run.tracing)
    try:
        with job_span(tracer, run_id=plan.run_id, run_dir=plan.run_dir):
            async with client_for(run) as client:
                with display:
                    reports = await run_shards(
                        next_spec,
                        client=client,
                        run=run,
                        on_outcome=ProgressCounter(display) if display.enabled else None,
                    )
                return await finalize_run(
                    plan,
                    reports,
                    run=run,
                    client=client,
                    wall_s=time.monotonic() - started,
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
