"""Run status (``gym-ray status RUN_DIR``) and the ``gym-ray aggregate RUN_DIR CONFIG...`` command.

``run_status`` reads a run folder without taking any lock or writing anything: each shard's files are
the truth (successes, failure attempts by class, omitted rows), ``plan_resume`` says what a resume would
run, and the ``.manifest.json`` / ``.progress.json`` files give the rate and ETA: each running shard rewrites
its progress file every few seconds (``PROGRESS_FILE_INTERVAL_S`` of :mod:`gym_ray.run.collect`), so the
attempts counted in the progress files and their timestamps describe the same moments, for finished and
running shards alike. A shard being written while it is read is counted as it stands (a torn last line is
skipped, never an error).

Cost: every shard file is read once or twice (the counts and the resume plan), streaming; memory grows
with the identities of one shard, not with the run.
"""

from __future__ import annotations

import argparse
import asyncio
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
from gym_ray.observe.rate import RateMeter
from gym_ray.plan.resume import plan_resume
from gym_ray.record.aggregate import (
    AGGREGATE_FILE_NAME,
    AggregateEntry,
    raise_for_aggregation_errors,
    read_metrics_summary,
)
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.shard_files import list_shards, record_identity, shard_paths

__all__ = ["RunStatus", "ShardStatus", "aggregate_main", "format_status", "run_status", "status_main"]

_DEFAULT_MAX_ATTEMPTS = 3


class ShardStatus(BaseModel):
    """One shard's counts, read from its files.

    ``planned``: rows in the materialized inputs (None when that file is missing). ``succeeded``:
    distinct identities with a success line. ``failed_attempts`` / ``failed_by_class``: failure lines
    (omitted rows excluded). ``terminal`` / ``maxed_out`` / ``pending`` / ``retrying``: from the resume
    plan (None when the shard cannot be planned; ``resume_error`` says why). ``created_at``: the
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


class RunStatus(BaseModel):
    """A run folder's status: per-shard counts, totals, what resume would run, rate and ETA.

    Totals sum the shards (``pending`` and friends over the shards that could be planned).
    ``rate_per_s`` is rollout attempts recorded per second (a :class:`~gym_ray.observe.rate.RateMeter`):
    the attempts the shards' progress files counted, between the earliest manifest and the latest
    progress update (a live run's running shards rewrite theirs every few seconds, so the counts and the
    end time match); ``eta_s`` is ``pending / rate_per_s``. Both are None without timestamps or
    progress; a resumed run includes the pause in its elapsed time.
    ``aggregate_servers`` is None when no metrics file exists; ``aggregate_failed`` names the servers
    whose entry holds an ``aggregation_error``.
    """

    model_config = ConfigDict(frozen=True)

    run_dir: str
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

    @property
    def complete(self) -> bool:
        """True when every shard could be planned and resume would run nothing."""
        return self.pending == 0 and all(s.resume_error is None for s in self.shards)


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
        else:
            by_class[str(record.get(keys.FAILURE_CLASS))] += 1
    updated_at, progress_attempts = _read_progress(paths.progress)
    planned: int | None = None
    if paths.materialized_inputs.exists():
        planned = sum(1 for _ in JsonlReader(paths.materialized_inputs))
    plan_fields: dict[str, int | None] = dict.fromkeys(("terminal", "maxed_out", "pending", "retrying"))
    resume_error = None
    try:
        plan = plan_resume(run_dir, shard, max_rollout_attempts=_read_max_attempts(paths.manifest))
    except (ResumeError, InputError) as exc:
        resume_error = str(exc)
    else:
        plan_fields = {
            "terminal": plan.terminal,
            "maxed_out": plan.maxed_out,
            "pending": plan.pending_count,
            "retrying": plan.retrying,
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


def _aggregate_summary(run_dir: Path) -> tuple[int | None, tuple[str, ...]]:
    path = run_dir / AGGREGATE_FILE_NAME
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


def run_status(run_dir: str | os.PathLike[str]) -> RunStatus:
    """Read a run folder's status (no lock taken, nothing written).

    Args:
        run_dir: the run folder.

    Returns:
        Per-shard and total counts, what resume would run, rate and ETA, merged/aggregate presence.

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
    pending = total("pending")
    rate = eta = None
    attempts = sum(s.progress_attempts or 0 for s in shards)
    if started_at is not None and updated_at is not None and updated_at > started_at and attempts > 0:
        meter = RateMeter(window_s=updated_at - started_at, clock=time.time)
        meter.observe(0, at=started_at)
        meter.observe(attempts, at=updated_at)
        rate = meter.rate_per_s(now=updated_at)
        eta = meter.eta_s(pending, now=updated_at)
    aggregate_servers, aggregate_failed = _aggregate_summary(folder)
    return RunStatus(
        run_dir=str(folder),
        shards=shards,
        planned=total("planned"),
        succeeded=total("succeeded"),
        failed_attempts=total("failed_attempts"),
        failed_by_class=dict(sorted(by_class.items())),
        terminal=total("terminal"),
        maxed_out=total("maxed_out"),
        pending=pending,
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
    )


# --- formatting --------------------------------------------------------------------------------------

_COLUMNS = (
    ("planned", "planned"),
    ("succeeded", "succeeded"),
    ("failed_attempts", "failed"),
    ("terminal", "terminal"),
    ("maxed_out", "maxed"),
    ("pending", "pending"),
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

    One row per shard plus a total row (``-`` where a shard could not be planned), then the failure
    classes, what resume would run, rate/ETA and last update (UTC) when known, shards that cannot be
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

    out = [
        f"run {status.run_dir}: {len(status.shards)} shard(s), "
        + ("complete" if status.complete else f"{status.pending} rollout(s) pending"),
        line("shard", [header for _, header in _COLUMNS]),
        *(line(name, values) for name, values in rows),
    ]
    if status.failed_by_class:
        out.append("failures by class: " + ", ".join(f"{k}={v}" for k, v in status.failed_by_class.items()))
    out.append(
        f"resume would run: {status.pending} rollout(s) ({status.retrying} with earlier failed attempts)"
    )
    if status.rate_per_s is not None:
        eta = f"; ETA {_duration(status.eta_s)}" if status.eta_s else ""
        out.append(f"rate: {status.rate_per_s:.2f} attempts/s{eta}")
    if status.updated_at is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(status.updated_at))
        out.append(f"last update: {stamp} UTC")
    if status.corrupt_lines:
        out.append(f"corrupt lines skipped: {status.corrupt_lines} (repaired when the shard is reopened)")
    out.extend(
        f"shard {s.shard} cannot be resumed: {s.resume_error}" for s in status.shards if s.resume_error
    )
    out.append(f"merged: {'rollouts.jsonl' if status.merged else 'not yet'}")
    if status.aggregate_servers is None:
        out.append("aggregate metrics: not written")
    else:
        failed = f"; failed: {', '.join(status.aggregate_failed)}" if status.aggregate_failed else ""
        out.append(f"aggregate metrics: {status.aggregate_servers} server(s){failed}")
    return "\n".join(out)


# --- CLI -----------------------------------------------------------------------------------------------


def status_main(args: argparse.Namespace) -> int:
    """``gym-ray status RUN_DIR [--json]``: print the run's status. Exit code 0."""
    status = run_status(args.run_dir)
    if getattr(args, "json", False):
        print(status.model_dump_json(indent=2))
    else:
        print(format_status(status))
    return 0


def _split_config_args(items: Sequence[str]) -> tuple[list[str], list[str]]:
    paths: list[str] = []
    overrides: list[str] = []
    for item in items:
        if "=" in item and not Path(item).exists():
            overrides.append(item)
        elif overrides:
            raise UsageError(
                f"config file {item!r} comes after the overrides {overrides}; list the YAML files first, "
                "then the key=value overrides"
            )
        else:
            paths.append(item)
    if not paths:
        raise UsageError("no config file given; pass the YAML config(s) the run used, then any overrides")
    return paths, overrides


async def _aggregate(run_dir: Path, cfg: dict[str, Any]) -> tuple[Path | None, list[AggregateEntry]]:
    from gym_ray.config.topology import Topology
    from gym_ray.dispatch.client import ServerClient
    from gym_ray.record.aggregate import aggregate_run

    topology = Topology.from_config(cfg)
    async with ServerClient(topology) as client:
        path = await aggregate_run(run_dir, topology, client, raise_on_error=False)
    if path is None:
        return None, []
    raw = await asyncio.to_thread(path.read_text, encoding="utf-8")
    return path, [AggregateEntry.model_validate(item) for item in json.loads(raw)]


def aggregate_main(args: argparse.Namespace) -> int:
    """``gym-ray aggregate RUN_DIR CONFIG... [key=value ...]``: merge the shards, compute the metrics.

    Merges the run folder's shards into ``rollouts.jsonl``, calls ``/aggregate_metrics`` on each
    environment server of the config (its servers must be running at the addresses the config names),
    writes ``rollouts_aggregate_metrics.json`` and prints the key metrics per server.

    Returns:
        0 on success.

    Raises:
        AggregationError: one or more servers failed (their entries hold the error; others are saved).
    """
    from gym_ray.config.settings import load_config
    from gym_ray.record.merge import merge_shards

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"run folder {run_dir} does not exist; pass the folder a run wrote")
    paths, overrides = _split_config_args(args.config)
    cfg = load_config(paths, overrides)
    merged = merge_shards(run_dir)
    print(
        f"merged {len(merged.shards)} shard(s): {merged.successes} success(es), {merged.failures} failure "
        f"line(s) -> {merged.successes_path.name}"
    )
    path, entries = asyncio.run(_aggregate(run_dir, cfg))
    if path is None:
        print(f"no successes in {run_dir}: nothing to aggregate, no metrics file written")
        return 0
    for entry in entries:
        print(f"\nKey metrics for {entry.label} ({entry.environment_server}):")
        if entry.aggregation_error is not None:
            print(f"  aggregation failed: {entry.aggregation_error}")
        else:
            print(json.dumps(entry.key_metrics, indent=2))
    print(f"\nwrote {path}")
    raise_for_aggregation_errors(entries)
    return 0
