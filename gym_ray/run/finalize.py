"""Finishing a run: merge the shards, check completion, aggregate once per environment server, summarize.

:func:`finalize_run` is what a single-process run and the coordinator actor both call once every shard
has run; :func:`incomplete_error` is the one-line error of a run that ended with failed or pending rows.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from gym_ray.config.run_config import RunConfig
from gym_ray.config.settings import RunSettings
from gym_ray.dispatch import latency
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import IncompleteRunError
from gym_ray.finalize.aggregate import (
    AGGREGATE_ERRORS_FILE,
    AGGREGATE_FILE_NAME,
    aggregate_run,
    raise_for_aggregation_errors,
    raise_for_completion_rejection,
    read_metrics_summary,
)
from gym_ray.finalize.merge import merge_shards
from gym_ray.finalize.nemo_layout import publish_nemo_gym_layout
from gym_ray.finalize.quality import QUALITY_SUMMARY_FILE, ROLLOUT_VERDICTS_FILE, write_quality_reports
from gym_ray.plan.resume import plan_resume
from gym_ray.plan.shards import RunPlan
from gym_ray.record.atomic import atomic_write_bytes
from gym_ray.run.result import SUMMARY_FILE, RunResult, ShardReport, ShardRows
from gym_ray.run.row_counts import rows_of_plan
from gym_ray.run.stage_cpu import measuring

__all__ = ["finalize_run", "incomplete_error"]

logger = logging.getLogger(__name__)


async def finalize_run(
    plan: RunPlan,
    reports: Iterable[ShardReport],
    *,
    run: RunConfig,
    client: ServerClient,
    wall_s: float,
    num_workers: int = 1,
    counts_from_reports: bool = False,
) -> RunResult:
    """Merge the shards, check completion, aggregate once per environment server, write the summary.

    With ``disable_aggregation`` no ``/aggregate_metrics`` call is made and no metrics file is written.
    With ``output_jsonl_fpath`` the merged files are published under NeMo Gym's names
    (:mod:`gym_ray.finalize.nemo_layout`) and the result's paths point there. With ``require_complete`` a
    run that is not complete (:attr:`RunResult.complete`) raises :class:`~gym_ray.errors.IncompleteRunError`
    after every file is written (NeMo Gym's ``EVAL FAILED``).

    A strict run with unfinished work is rejected before aggregation (no score is published). When an
    ``/aggregate_metrics`` call fails, the metrics file keeps an entry with ``aggregation_error``, the
    summary is written, and then one :class:`~gym_ray.errors.AggregationError` names every failed server.

    The failed, pending and resumable rows are each shard's as :func:`~gym_ray.plan.resume.plan_resume`
    counts them from its files. With ``counts_from_reports`` a shard with exactly one report that carries
    its rows (:attr:`ShardReport.rows`) is counted from that report instead of being read again; pass it
    only when each shard had one writer, under its lock, from the resume plan its call made to its report,
    so no other writer can have appended since: a single-process run (one call per shard, under the run
    folder's lock), or a Ray run whose driver handed every shard out once and lost no worker
    (:func:`~gym_ray.distributed.api.run_actors`). Every other shard (none or several reports, no
    rows in its report) is read again.
    """
    reports = list(reports)
    settings = run.settings
    root = Path(plan.run_dir)
    with measuring("merge"):
        merged = await asyncio.to_thread(merge_shards, root)
    settled = merged.successes + merged.terminal_failures
    known = _rows_from_reports(reports) if counts_from_reports else {}
    rows = await asyncio.to_thread(_row_counts, plan, settings, known)
    if settings.strict:
        raise_for_completion_rejection(
            expected=plan.planned,
            completed=settled,
            can_retry=rows.resumable > 0,
            made_progress=any(r.succeeded or r.failed for r in reports),
            strict=True,
        )
    with measuring("aggregate"):
        metrics_path = (
            None
            if settings.disable_aggregation
            else await aggregate_run(root, run.topology, client, raise_on_error=False)
        )
    if metrics_path is not None:  # its outcome is in the metrics file: an older failure's entries are stale
        (root / AGGREGATE_ERRORS_FILE).unlink(missing_ok=True)
    else:  # no metrics for this run (disable_aggregation, or no success): an earlier run's would mislead
        for stale in (AGGREGATE_FILE_NAME, AGGREGATE_ERRORS_FILE):
            (root / stale).unlink(missing_ok=True)
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
    if settings.runs_quality_pass:
        await asyncio.to_thread(_quality_pass, rollouts_path, settings)
    elif settings.output_jsonl_fpath is not None:  # reports beside P describe an earlier state of it
        for stale in (QUALITY_SUMMARY_FILE, ROLLOUT_VERDICTS_FILE):
            (rollouts_path.parent / stale).unlink(missing_ok=True)
    result = RunResult(
        run_dir=str(root),
        run_id=plan.run_id,
        rollouts_path=str(rollouts_path),
        failures_path=str(failures_path),
        metrics_path=str(metrics_path) if metrics_path else None,
        summary_path=str(root / SUMMARY_FILE),
        planned=plan.planned,
        succeeded=merged.successes,
        failed=rows.failed,
        pending=rows.pending,
        failure_attempts=merged.failures,
        resumable=rows.resumable,
        complete=rows.pending == 0 and rows.failed <= settings.max_failed_fraction * plan.planned,
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
        raise_for_aggregation_errors(entries)  # the summary read above: the file is not read twice
    if settings.require_complete and not result.complete:
        # NeMo Gym 0.7's check_completion, after every file is written (the Python `require_complete=True`
        # of collect / acollect / acollect_local sets the same setting).
        raise incomplete_error(result)
    return result


def _quality_pass(rollouts_path: Path, settings: RunSettings) -> None:
    """NeMo Gym 0.7's rollout-quality reports beside the rollouts; as in 0.7, a failure of the pass is
    logged and the run goes on (its rollouts are written)."""
    try:
        reports = write_quality_reports(rollouts_path, ignored_checks=settings.health_check_ignored_checks)
    except OSError as exc:
        logger.warning("rollout quality reports not written beside %s: %s", rollouts_path, exc)
        return
    if reports.skipped_because is not None:
        logger.warning("rollout quality reports not written: %s", reports.skipped_because)


def incomplete_error(result: RunResult, *, resume_command: str | None = None) -> IncompleteRunError:
    """The one-line error of a run that ended with failed or pending rollouts.

    Args:
        result: The finalized run.
        resume_command: The exact command that resumes it (the CLI passes its own command line);
            default: "rerun on the same output_dir".
    """
    counts = (
        f"{result.failed} failed and {result.pending} pending of {result.planned} planned rollouts "
        f"({result.succeeded} succeeded, {result.failure_attempts} failed attempts)"
    )
    if result.resumable:
        how = f"run `{resume_command}`" if resume_command else "run again on the same output_dir"
        todo = f"{result.resumable} would run again: {how} to resume"
    else:
        todo = (
            "none has attempts left (max_rollout_attempts); raise max_rollout_attempts and rerun to retry "
            "them, or accept them with max_failed_fraction"
        )
    return IncompleteRunError(
        f"run folder {result.run_dir} is incomplete: {counts}; {todo}",
        run_dir=result.run_dir,
        failed=result.failed,
        pending=result.pending,
        resumable=result.resumable,
    )


class _RowCounts(NamedTuple):
    failed: int
    pending: int
    resumable: int


def _rows_from_reports(reports: list[ShardReport]) -> dict[str, ShardRows]:
    """The rows of each shard that exactly one report names and that report counted."""
    by_shard: dict[str, list[ShardReport]] = {}
    for report in reports:
        by_shard.setdefault(report.shard, []).append(report)
    return {
        shard: only[0].rows for shard, only in by_shard.items() if len(only) == 1 and only[0].rows is not None
    }


def _row_counts(plan: RunPlan, settings: RunSettings, known: Mapping[str, ShardRows]) -> _RowCounts:
    """Rows failed (no success, some failure attempt), pending (no outcome) and resumable, per shard from
    ``known`` or else from the shard's files."""
    failed = pending = resumable = 0
    for spec in plan.shards:
        shard = known.get(spec.shard)
        if shard is None:
            shard = rows_of_plan(
                plan_resume(plan.run_dir, spec.shard, max_rollout_attempts=settings.max_rollout_attempts)
            )
        failed += shard.failed
        pending += shard.pending
        resumable += shard.resumable
    return _RowCounts(failed, pending, resumable)
