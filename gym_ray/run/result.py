"""What a run reports: one :class:`ShardReport` per shard call, one :class:`RunResult` per run.

Both are pydantic models that cross Ray actor boundaries and are written to the run summary
(``rollouts_summary.json``). Rows and attempts are counted apart (see :class:`RunResult`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SUMMARY_FILE", "RunResult", "ShardReport", "ShardRows"]


SUMMARY_FILE = "rollouts_summary.json"


class ShardRows(BaseModel):
    """A shard's rows by state when a shard call ended, as :func:`~gym_ray.plan.resume.plan_resume` counts.

    ``failed``: rows with no success and at least one failure attempt; ``pending``: rows with no outcome;
    ``resumable``: rows a rerun would dispatch (pending rows plus failed rows with attempts left).
    """

    model_config = ConfigDict(frozen=True)

    failed: int
    pending: int
    resumable: int


class ShardReport(BaseModel):
    """What running one shard did. Crosses Ray actor boundaries (plain, picklable data).

    ``rows`` is the shard's row counts when the call ended, from the resume plan the call made and the
    records it appended (None when the call could not vouch for them, e.g. a record whose identity is not
    one of the rows it dispatched; see :mod:`gym_ray.run.row_counts`).
    """

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
    rows: ShardRows | None = None


class RunResult(BaseModel):
    """The outcome of a whole collection: where things are, what happened, the headline metrics.

    Rows and attempts are counted apart. Every planned rollout (row) is in exactly one of
    ``succeeded`` (it has a success), ``failed`` (no success, at least one failure attempt) and
    ``pending`` (no outcome recorded: never dispatched, or drained), so the three add up to ``planned``.
    ``failure_attempts`` counts the failure lines of the failed rows (a row tried three times counts three);
    ``resumable`` is the rows a rerun on the same folder would dispatch (pending rows plus failed rows with
    attempts left). ``complete`` is the exit status contract: no pending row, and failed rows at most
    ``max_failed_fraction`` of the planned rows (0 by default).
    """

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
    pending: int
    failure_attempts: int
    resumable: int
    complete: bool
    latency_ms: dict[str, float | None] = Field(default_factory=dict)
