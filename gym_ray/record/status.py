"""Run status (``gym-ray status RUN_DIR``); ``gym-ray aggregate`` is
:mod:`gym_ray.finalize.aggregate_command`.

``run_status`` reads a run folder without taking any lock (beyond a non-blocking probe of the run lock)
or writing anything. First the run's state (:mod:`gym_ray.record.run_state`): running (a process holds
the run lock), stopped (how and when; ``killed`` when the lock is free but the state file still says
running), finished (complete or incomplete), or unknown (no state file). Then the counts: each shard's
files are the truth (successes, failure attempts by class, omitted rows) and ``plan_resume`` says which
rows failed, which are pending and what a resume would run, counted as the run summary counts them
(:class:`~gym_ray.run.result.RunResult`: every planned row is succeeded, failed or pending). The rate and
ETA are given only while the run is running, from the ``.manifest.json`` / ``.progress.json`` files: each
running shard rewrites its progress file every few seconds (``PROGRESS_FILE_INTERVAL_S`` of
:mod:`gym_ray.run.collect`), so the attempts counted in the progress files and their timestamps describe
the same moments. A shard being written while it is read is counted as it stands (a torn last line is
skipped, never an error). Last, the merged file and the last aggregate's outcome (its metrics file, or
the errors file a failed ``gym-ray aggregate`` left).

Cost: every shard file is read once or twice (the counts and the resume plan), streaming; memory grows
with the identities of one shard, not with the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from gym_ray import keys
from gym_ray.errors import InputError, ResumeError, UsageError
from gym_ray.finalize.aggregate import (
    AGGREGATE_ERRORS_FILE,
    AGGREGATE_FILE_NAME,
    AggregateEntry,
    read_metrics_summary,
)
from gym_ray.finalize.aggregate_command import aggregate_main
from gym_ray.observe.rate import RateMeter
from gym_ray.plan.resume import plan_resume
from gym_ray.plan.run_manifest import RUN_MANIFEST
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.outage_note import read_outage
from gym_ray.record.run_lock import describe_holder, lock_holder
from gym_ray.record.run_record import RUN_RECORD_FILE
from gym_ray.record.run_state import describe_state, observe_state
from gym_ray.record.shard_files import list_shards, record_identity, shard_paths
from gym_ray.store import is_store_url

__all__ = [
    "AGGREGATE_ERRORS_FILE",
    "RUN_COMMAND_FILE",
    "RunStatus",
    "ShardStatus",
    "aggregate_main",
    "format_status",
    "run_status",
    "status_main",
]

#: The run record's name (kept under its former name: :mod:`gym_ray.record.run_record` owns it).
RUN_COMMAND_FILE = RUN_RECORD_FILE

_DEFAULT_MAX_ATTEMPTS = 3


class ShardStatus(BaseModel):
    """One shard's counts, read from its files.

    ``planned``: rows in the materialized inputs (None when that file is missing). ``succeeded``:
    distinct identities with a success line. ``failed_attempts`` / ``failed_by_class``: failure lines of
    rows without a success (omitted rows excluded): the lines the merge keeps in ``rollouts_failures.jsonl``,
    which the run summary's ``failure_attempts`` counts. From the resume plan (None when the shard cannot
    be planned; ``resume_error`` says why): ``failed`` rows (no success, some failure attempt: ``terminal`` +
    ``maxed_out`` + ``retrying``), ``pending`` rows (no outcome yet), ``resumable`` (what a resume runs:
    pending and retrying rows). ``created_at``: the
    manifest's; ``updated_at``: the progress file's (epoch seconds); ``progress_attempts``: the success and
    failure lines the progress file counted at ``updated_at`` (None without a progress file).
    """

    model_config = ConfigDict(frozen=True)

    shard: str
    planned: int | None
    succeeded: int
    failed_attempts: int
    failed_by_class: dict[str, int]
    terminal: int | None
    maxed_out: int | None
    pending: int | None
    retrying: int | None
    omitted: int
    corrupt_lines: int
    created_at: float | None
    updated_at: float | None
    resume_error: str | None = None
    progress_attempts: int | None = None
    failed: int | None = None
    resumable: int | None = None


class RunStatus(BaseModel):
    """A run folder's status: its state, per-shard counts, totals, what resume would run, rate and ETA.

    ``state``: ``running``, ``stopped``, ``finished`` or ``unknown``; ``stopped_by`` for a stopped run
    (``sigterm``, ``ctrl-c``, ``cancelled``, ``server-outage``, ``error``, ``killed``); ``state_at``:
    when it started (running), ended (stopped, finished) or last updated its progress (killed);
    ``state_detail``: the outage's server, the error, or what killed means; ``holder``: the process that
    holds the folder's lock (a run, or a ``gym-ray aggregate``); ``finished_complete``: the run summary's
    ``complete`` of a finished run. ``state_line`` is the line ``gym-ray status`` prints first.

    Totals sum the shards (over the shards that could be planned). Rows are counted as the run summary
    counts them: every planned row is ``succeeded``, ``failed`` (some failure attempt, no success) or
    ``pending`` (no outcome yet). ``resumable`` is what a resume runs (pending rows and failed rows with
    attempts left, ``retrying``); ``terminal`` and ``maxed_out`` are the failed rows a resume leaves.
    ``planned`` is the run's full size when its run manifest records it (a run interrupted while planning
    has cut only part of its shards); ``unplanned`` is the rows not cut into shards yet, counted in
    ``pending`` and ``resumable``. Rows and attempts are apart: ``failed_attempts`` counts failure lines
    (of rows without a success, as the summary's ``failure_attempts``).
    ``rate_per_s`` is rollout attempts recorded per second (a :class:`~gym_ray.observe.rate.RateMeter`):
    the attempts the shards' progress files counted, between the earliest manifest and the latest
    progress update (a live run's running shards rewrite theirs every few seconds, so the counts and the
    end time match); ``eta_s`` is ``pending / rate_per_s``. Both are None unless the run is running (and
    has timestamps and progress); a resumed run includes the pause in its elapsed time.
    ``aggregate_servers`` is None when no metrics file exists; ``aggregate_failed`` names the servers
    whose entry holds an ``aggregation_error``. ``aggregate_errors_path`` is set when the last
    ``gym-ray aggregate`` failed (its errors file, which a successful aggregate removes), with the servers
    that failed in ``aggregate_errors_failed``.
    """

    model_config = ConfigDict(frozen=True)

    run_dir: str
    state: str = "unknown"
    stopped_by: str | None = None
    state_at: float | None = None
    state_detail: str | None = None
    holder: str | None = None
    finished_complete: bool | None = None
    state_line: str = ""
    shards: tuple[ShardStatus, ...]
    planned: int
    succeeded: int
    failed_attempts: int
    failed_by_class: dict[str, int]
    terminal: int
    maxed_out: int
    pending: int
    retrying: int
    omitted: int
    corrupt_lines: int
    started_at: float | None
    updated_at: float | None
    rate_per_s: float | None
    eta_s: float | None
    merged: bool
    aggregate_servers: int | None
    aggregate_failed: tuple[str, ...]
    server_outage: str | None = None
    unplanned: int = 0
    failed: int = 0
    resumable: int = 0
    aggregate_errors_path: str | None = None
    aggregate_errors_failed: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """True when every shard could be planned and resume would run nothing."""
        return self.resumable == 0 and all(s.resume_error is None for s in self.shards)


#: Shard labels a stream's ``record_dir`` gets (``stream-<run id>``).
STREAM_SHARD_PREFIX = "stream-"
#: The state line of a folder that only streams recorded.
STREAM_STATE_LINE = (
    "state: a stream's recording (it holds the rollouts the stream delivered and plans nothing ahead; "
    "gym_ray.stream(rows, record_dir=..., resume=True) continues it)"
)


def is_stream_shard(label: str) -> bool:
    """True for a shard a stream's ``record_dir`` wrote."""
    return label.startswith(STREAM_SHARD_PREFIX)


def _read_number(path: Path, field: str) -> float | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get(field)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _read_progress(path: Path) -> tuple[float | None, int | None]:
    """``(updated_at, attempts)`` of a progress file, read at once (None for what is absent)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    stamp, attempts = data.get("updated_at"), data.get("attempts")
    return (
        float(stamp) if isinstance(stamp, int | float) and not isinstance(stamp, bool) else None,
        attempts if type(attempts) is int and attempts >= 0 else None,
    )


def _read_max_attempts(path: Path) -> int:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("max_rollout_attempts")
    except (OSError, ValueError, AttributeError):
        return _DEFAULT_MAX_ATTEMPTS
    return value if type(value) is int and value >= 1 else _DEFAULT_MAX_ATTEMPTS


def _shard_status(run_dir: Path, shard: str) -> ShardStatus:
    paths = shard_paths(run_dir, shard)
    succeeded: set[tuple[int, int]] = set()
    unkeyed = 0
    successes = JsonlReader(paths.successes)
    for _, record in successes:
        identity = record_identity(record)
        if identity is None:
            unkeyed += 1
        else:
            succeeded.add(identity)
    by_class: Counter[str] = Counter()
    omitted = 0
    failures = JsonlReader(paths.failures)
    for _, record in failures:
        if record.get(keys.NO_PERSIST):
            omitted += 1
        elif record_identity(record) not in succeeded:  # as the merge keeps them (rollouts_failures.jsonl)
            by_class[str(record.get(keys.FAILURE_CLASS))] += 1
    updated_at, progress_attempts = _read_progress(paths.progress)
    planned: int | None = None
    if paths.materialized_inputs.exists():
        planned = sum(1 for _ in JsonlReader(paths.materialized_inputs))
    plan_fields: dict[str, int | None] = dict.fromkeys(
        ("terminal", "maxed_out", "pending", "retrying", "failed", "resumable")
    )
    resume_error = None
    plan = None
    if not is_stream_shard(shard):  # a stream records what it delivers; it plans nothing to resume from
        try:
            plan = plan_resume(run_dir, shard, max_rollout_attempts=_read_max_attempts(paths.manifest))
        except (ResumeError, InputError) as exc:
            resume_error = str(exc)
    if plan is not None:
        plan_fields = {  # rows as the run summary counts them (gym_ray.run.row_counts.rows_of_plan)
            "terminal": plan.terminal,
            "maxed_out": plan.maxed_out,
            "pending": plan.pending_count - plan.retrying,
            "retrying": plan.retrying,
            "failed": plan.terminal + plan.maxed_out + plan.retrying,
            "resumable": plan.pending_count,
        }
    return ShardStatus(
        shard=shard,
        planned=planned,
        succeeded=len(succeeded) + unkeyed,
        failed_attempts=sum(by_class.values()),
        failed_by_class=dict(sorted(by_class.items())),
        omitted=omitted,
        corrupt_lines=len(successes.corrupt_lines) + len(failures.corrupt_lines),
        created_at=_read_number(paths.manifest, "created_at"),
        updated_at=updated_at,
        progress_attempts=progress_attempts,
        resume_error=resume_error,
        **plan_fields,
    )


def _run_rows(run_dir: Path) -> int | None:
    """The run's full size as its run manifest records it (None when unknown)."""
    value = _read_number(run_dir / RUN_MANIFEST, "run_rows")
    return int(value) if value is not None else None


def _aggregate_summary(run_dir: Path, name: str = AGGREGATE_FILE_NAME) -> tuple[int | None, tuple[str, ...]]:
    path = run_dir / name
    try:
        raw: Any = read_metrics_summary(path)
    except InputError:
        return None, ()
    if not isinstance(raw, list):
        return None, ()
    failed = []
    for item in raw:
        try:
            entry = AggregateEntry.model_validate(item)
        except ValueError:
            continue
        if entry.aggregation_error is not None:
            failed.append(entry.environment_server)
    return len(raw), tuple(failed)


def run_status(run_dir: str | os.PathLike[str], *, lock: bool = True) -> RunStatus:
    """Read a run folder's status (no lock taken, nothing written).

    Args:
        run_dir: the run folder.
        lock: whether the folder's run lock can be probed; False for a local copy of a folder on an object
            store, whose state line then says "running or killed" where a lock would tell which.

    Returns:
        The run's state, per-shard and total counts, what resume would run, rate and ETA (while running),
        the merged file and the last aggregate's outcome.

    Raises:
        UsageError: the folder does not exist or holds no shard files.
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        raise UsageError(f"run folder {folder} does not exist; pass the folder a run wrote")
    labels = list_shards(folder)
    if not labels:
        raise UsageError(
            f"run folder {folder} holds no shard files (rollouts-<shard>.*); pass the folder a run wrote"
        )
    holder = lock_holder(folder)  # probed before the shards are read: a run that ends meanwhile is older
    holder_text = None if holder is None else describe_holder(holder)
    observed = observe_state(folder, holder, holder_text=holder_text, lock=lock)
    shards = tuple(_shard_status(folder, label) for label in labels)
    by_class: Counter[str] = Counter()
    for shard in shards:
        by_class.update(shard.failed_by_class)

    def total(field: str) -> int:
        return sum(getattr(s, field) or 0 for s in shards)

    created = [s.created_at for s in shards if s.created_at is not None]
    updated = [s.updated_at for s in shards if s.updated_at is not None]
    started_at = min(created) if created else None
    updated_at = max(updated) if updated else None
    unplanned = max(0, (_run_rows(folder) or 0) - total("planned"))
    pending = total("pending") + unplanned
    rate = eta = None
    attempts = sum(s.progress_attempts or 0 for s in shards)
    running = observed.state == "running"
    if running and started_at is not None and updated_at is not None and updated_at > started_at and attempts:
        meter = RateMeter(window_s=updated_at - started_at, clock=time.time)
        meter.observe(0, at=started_at)
        meter.observe(attempts, at=updated_at)
        rate = meter.rate_per_s(now=updated_at)
        eta = meter.eta_s(pending, now=updated_at)
    aggregate_servers, aggregate_failed = _aggregate_summary(folder)
    errors_path = folder / AGGREGATE_ERRORS_FILE
    errors_failed: tuple[str, ...] = ()
    if errors_path.exists():
        errors_failed = _aggregate_summary(folder, AGGREGATE_ERRORS_FILE)[1]
    killed = observed.stopped_by == "killed"
    return RunStatus(
        run_dir=str(folder),
        state=observed.state,
        stopped_by=observed.stopped_by,
        state_at=updated_at if killed else observed.at,
        state_detail=observed.detail,
        holder=observed.holder,
        finished_complete=observed.complete,
        state_line=(
            STREAM_STATE_LINE
            if observed.state == "unknown" and all(is_stream_shard(s.shard) for s in shards)
            else describe_state(observed, last_update=updated_at)
        ),
        shards=shards,
        planned=total("planned") + unplanned,
        unplanned=unplanned,
        succeeded=total("succeeded"),
        failed_attempts=total("failed_attempts"),
        failed_by_class=dict(sorted(by_class.items())),
        terminal=total("terminal"),
        maxed_out=total("maxed_out"),
        pending=pending,
        failed=total("failed"),
        resumable=total("resumable") + unplanned,
        retrying=total("retrying"),
        omitted=total("omitted"),
        corrupt_lines=total("corrupt_lines"),
        started_at=started_at,
        updated_at=updated_at,
        rate_per_s=rate,
        eta_s=eta,
        merged=(folder / "rollouts.jsonl").exists(),
        aggregate_servers=aggregate_servers,
        aggregate_failed=aggregate_failed,
        aggregate_errors_path=str(errors_path) if errors_path.exists() else None,
        aggregate_errors_failed=errors_failed,
        server_outage=_outage_line(folder),
    )


def _outage_line(folder: Path) -> str | None:
    note = read_outage(folder)
    if note is None:
        return None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(note.get("stopped_at") or 0)))
    return (
        f"stopped at {stamp} UTC: environment server {note.get('server')!r} ({note.get('url')}) was down "
        f"for {note.get('down_s')} s (server_outage_timeout_s); bring it back, then rerun on this folder to "
        "resume"
    )


# --- formatting --------------------------------------------------------------------------------------

_COLUMNS = (
    ("planned", "planned"),
    ("succeeded", "succeeded"),
    ("failed", "failed"),
    ("pending", "pending"),
    ("failed_attempts", "failed_attempts"),
    ("omitted", "omitted"),
)


def _duration(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_status(status: RunStatus) -> str:
    """A compact, deterministic text table of a ``RunStatus`` (what ``gym-ray status`` prints).

    The state line first, then the counts as the run summary words them, one row per shard plus a total
    row (``-`` where a shard could not be planned), the failure classes, the failed rows by kind, what
    resume would run, rate/ETA (running only) and last update (UTC) when known, shards that cannot be
    resumed, and the state of the merged and metrics files. Ends without a newline.
    """
    rows: list[tuple[str, list[str]]] = []
    for shard in status.shards:
        values = [getattr(shard, field) for field, _ in _COLUMNS]
        rows.append((shard.shard, ["-" if v is None else str(v) for v in values]))
    rows.append(("total", [str(getattr(status, field)) for field, _ in _COLUMNS]))
    name_width = max(len("shard"), *(len(name) for name, _ in rows))
    widths = [
        max(len(header), *(len(values[i]) for _, values in rows)) for i, (_, header) in enumerate(_COLUMNS)
    ]

    def line(name: str, cells: Sequence[str]) -> str:
        return "  ".join([name.ljust(name_width), *(c.rjust(w) for c, w in zip(cells, widths, strict=True))])

    streams = all(is_stream_shard(s.shard) for s in status.shards)
    counts = (
        f"{status.succeeded} rollout(s) succeeded and {status.failed_attempts} failure record(s) delivered"
        if streams
        else f"{status.succeeded} succeeded, {status.failed} failed, {status.pending} pending of "
        f"{status.planned} planned rollouts"
    )
    out = [
        status.state_line or f"state: {status.state}",
        f"run {status.run_dir}: {len(status.shards)} shard(s), {counts}",
        line("shard", [header for _, header in _COLUMNS]),
        *(line(name, values) for name, values in rows),
    ]
    if status.state != "running" and status.holder is not None:  # a `gym-ray aggregate` holds it
        out.append(f"in use by: {status.holder}")
    if status.failed_by_class:
        out.append("failures by class: " + ", ".join(f"{k}={v}" for k, v in status.failed_by_class.items()))
    if status.failed:
        out.append(
            f"failed rows: {status.terminal} terminal, {status.maxed_out} at max_rollout_attempts, "
            f"{status.retrying} with attempts left"
        )
    unplanned = f", {status.unplanned} not cut into shards yet" if status.unplanned else ""
    if not streams:
        out.append(
            f"resume would run: {status.resumable} rollout(s) ({status.retrying} with earlier failed "
            f"attempts{unplanned})"
        )
    if status.rate_per_s is not None:
        eta = f"; ETA {_duration(status.eta_s)}" if status.eta_s is not None else ""
        out.append(f"rate: {status.rate_per_s:.2f} attempts/s{eta}")
    if status.updated_at is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(status.updated_at))
        out.append(f"last update: {stamp} UTC")
    if status.corrupt_lines:
        out.append(
            f"corrupt lines: {status.corrupt_lines} (not counted above; a resume moves them to "
            "<shard file>.quarantine and runs again the rollouts they held)"
        )
    out.extend(
        f"shard {s.shard} cannot be resumed: {s.resume_error}" for s in status.shards if s.resume_error
    )
    if status.server_outage is not None:
        out.append(status.server_outage)
    out.append(f"merged: {'rollouts.jsonl' if status.merged else 'not yet'}")
    if status.aggregate_servers is None:
        out.append("aggregate metrics: not written")
    else:
        failed = f"; failed: {', '.join(status.aggregate_failed)}" if status.aggregate_failed else ""
        out.append(f"aggregate metrics: {status.aggregate_servers} server(s){failed}")
    if status.aggregate_errors_path is not None:
        which = ", ".join(status.aggregate_errors_failed) or "some server"
        kept = "the metrics above are older" if status.aggregate_servers is not None else "no metrics written"
        out.append(
            f"last aggregate: failed for {which} ({kept}); its entries are in {status.aggregate_errors_path}"
        )
    return "\n".join(out)


# --- CLI -----------------------------------------------------------------------------------------------


def status_main(args: argparse.Namespace) -> int:
    """``gym-ray status RUN_DIR [--json]``: print the run's status. Exit code 0.

    ``RUN_DIR`` may be a store folder (``s3://...``): its committed records are read (a live run's
    records since each shard's last publication are not there yet)."""
    if is_store_url(args.run_dir):
        from gym_ray.store.mirror import folder_copy

        with folder_copy(args.run_dir) as (local, mirror):
            assert mirror is not None
            status = mirror.published(run_status(local, lock=False))
    else:
        status = run_status(args.run_dir)
    if getattr(args, "json", False):
        print(status.model_dump_json(indent=2))
    else:
        print(format_status(status))
    return 0
