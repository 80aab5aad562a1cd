"""The ledger check of a run folder: was anything lost, missed, duplicated or corrupted?

Modelled on Jepsen's set checker (RELIABILITY.md). Identities are ``(task index, rollout index)``.

*Source.* When the merged ``rollouts.jsonl`` exists the check reads the merged files (what users consume);
otherwise it reads every shard's successes and failures sidecar. Omitted rows (``_ng_no_persist``) are
never records. Terms, over the source:

- ``S``: the multiset of identities of success lines.
- *recorded*: identities with a success or failure line.
- *settled*: identities with a success, a terminal failure (``_ng_failure_terminal`` true), or at least
  ``max_rollout_attempts`` failure lines: the ones resume never runs again. Drained and killed rows leave
  no line, so they are not settled.
- ``P`` (planned): the ``planned`` argument, else every identity in the shards' materialized inputs; a
  folder whose shards have no materialized inputs (a stream's ``record_dir``) is judged by what it
  recorded: ``P`` = *recorded*.
- ``A`` (acknowledged): the ``acknowledged`` argument (identities the collector reported recorded).

Figures:

=================== ============================================================================
lost                ``|A - recorded|``: acknowledged but no line on disk. Must be 0.
missing             ``|P - settled|``: planned but not settled. Must be 0 once a run reports complete.
duplicates          ``len(S) - len(set(S))``. Must be 0 in merged output.
unexpected          ``|recorded - P|``. Must be 0.
corrupt_lines       unparsable lines in every JSONL file of the folder (shards, inputs, merged).
unidentified_lines  parsable success/failure lines without integer identity keys. Must be 0.
wasted_requests     with ``request_counts`` (identity -> /run requests the server saw): the sum over
                    identities of ``max(0, requests - distinct recorded attempts)``, the distinct
                    attempts being the attempt indices of its success and failure lines in the shard
                    files. It counts requests whose outcome was not kept: re-dispatches of an already
                    recorded attempt, requests cut off by a kill or a drain, replays. Reported, not judged.
unplanned           rows of the run not cut into shards yet (the run manifest's ``run_rows`` minus the
                    identities in the materialized inputs; a run interrupted while planning). Counted in
                    ``planned``; 0 when ``planned`` is passed.
=================== ============================================================================

``ok`` is true when lost, missing, duplicates, unexpected, corrupt_lines, unidentified_lines and unplanned
are 0.
The check only reads; it takes no locks.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gym_ray import keys
from gym_ray.errors import ConfigError, InputError
from gym_ray.plan.run_manifest import RUN_MANIFEST
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.shard_files import Identity, list_shards, record_identity, shard_paths
from gym_ray.store import is_store_url

__all__ = ["LedgerReport", "check_run"]


class LedgerReport(BaseModel):
    """The ledger figures of a run folder (definitions in the module docstring).

    The ``*_ids`` fields list the identities behind a figure, sorted.
    """

    model_config = ConfigDict(frozen=True)

    run_dir: str
    source: Literal["merged", "shards"]
    planned: int
    recorded: int
    settled: int
    lost: int
    missing: int
    duplicates: int
    unexpected: int
    corrupt_lines: int
    unidentified_lines: int
    wasted_requests: int | None
    unplanned: int = 0
    lost_ids: tuple[Identity, ...]
    missing_ids: tuple[Identity, ...]
    duplicate_ids: tuple[Identity, ...]
    unexpected_ids: tuple[Identity, ...]
    corrupt_by_file: dict[str, int]

    @property
    def ok(self) -> bool:
        """True when nothing is lost, missing, duplicated, unexpected, corrupt or unidentified."""
        return not (
            self.lost
            or self.missing
            or self.duplicates
            or self.unexpected
            or self.corrupt_lines
            or self.unidentified_lines
            or self.unplanned
        )

    def __str__(self) -> str:
        """A short summary line (the identities behind each figure are in the ``*_ids`` fields)."""
        return f"ledger of {self.run_dir} ({self.source}): {self.describe()}"

    def describe(self) -> str:
        """The verdict and the figures in one readable line, e.g. ``"ok: lost 0, missing 0, duplicates 0,
        unexpected 0, corrupt lines 0, unidentified lines 0, unplanned 0; planned 8, recorded 8, settled 8"``
        (``wasted requests N`` follows when request counts were given)."""
        checked = ", ".join(
            f"{name} {value}"
            for name, value in (
                ("lost", self.lost),
                ("missing", self.missing),
                ("duplicates", self.duplicates),
                ("unexpected", self.unexpected),
                ("corrupt lines", self.corrupt_lines),
                ("unidentified lines", self.unidentified_lines),
                ("unplanned", self.unplanned),
            )
        )
        counted = f"planned {self.planned}, recorded {self.recorded}, settled {self.settled}"
        if self.wasted_requests is not None:
            counted += f", wasted requests {self.wasted_requests}"
        return f"{'ok' if self.ok else 'NOT ok'}: {checked}; {counted}"

    def as_dict(self) -> dict[str, Any]:
        """The figures as a flat dict (for printing a scenario's result)."""
        return {
            "lost": self.lost,
            "missing": self.missing,
            "duplicates": self.duplicates,
            "unexpected": self.unexpected,
            "corrupt_lines": self.corrupt_lines,
            "unidentified_lines": self.unidentified_lines,
            "wasted_requests": self.wasted_requests,
            "unplanned": self.unplanned,
            "planned": self.planned,
            "recorded": self.recorded,
            "settled": self.settled,
            "source": self.source,
            "ok": self.ok,
        }


class _Scan:
    """Reads JSONL files of the run folder, counting corrupt lines per file."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.corrupt: dict[str, int] = {}
        self.unidentified = 0

    def records(self, path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
        reader = JsonlReader(path)
        yield from reader
        if reader.corrupt_lines:
            self.corrupt[os.path.relpath(path, self.base)] = len(reader.corrupt_lines)

    def identified(self, path: Path, *, skip_omitted: bool) -> Iterable[tuple[Identity, dict[str, Any]]]:
        for _, record in self.records(path):
            if skip_omitted and record.get(keys.NO_PERSIST):
                continue
            identity = record_identity(record)
            if identity is None:
                self.unidentified += 1
                continue
            yield identity, record


def _attempt(record: Mapping[str, Any]) -> int:
    attempt = record.get(keys.ATTEMPT_INDEX)
    return attempt if type(attempt) is int else 0


def check_run(
    run_dir: str | os.PathLike[str],
    *,
    planned: Iterable[Identity] | None = None,
    acknowledged: Iterable[Identity] | None = None,
    request_counts: Mapping[Identity, int] | None = None,
    max_rollout_attempts: int = 3,
    merged_prefix: str = "rollouts",
) -> LedgerReport:
    """Compute the ledger figures of a run folder (definitions in the module docstring).

    Args:
        run_dir: The run folder: a path, or a folder on an object store (``s3://BUCKET/PREFIX``).
        planned: Planned identities; default: every identity in the shards' materialized inputs.
        acknowledged: Identities the collector acknowledged as recorded; default: none.
        request_counts: /run requests per identity as the server counted them; default: not reported.
        max_rollout_attempts: The attempt cap that settles an identity by failures alone.
        merged_prefix: Stem of the merged files to prefer as the source.

    Returns:
        The report; ``report.ok`` is the verdict.

    Raises:
        InputError: ``run_dir`` is not a folder.
        ConfigError: ``max_rollout_attempts`` is not an int >= 1.

    Example:
        >>> report = check_run("runs/2024-06-01")  # doctest: +SKIP
        >>> report.ok, report.as_dict()["missing"]  # doctest: +SKIP
        (True, 0)
    """
    if is_store_url(run_dir):  # a store folder: its committed records, read in a local copy
        from gym_ray.store.mirror import folder_copy

        with folder_copy(run_dir) as (local, mirror):
            assert mirror is not None
            report = check_run(
                local,
                planned=planned,
                acknowledged=acknowledged,
                request_counts=request_counts,
                max_rollout_attempts=max_rollout_attempts,
                merged_prefix=merged_prefix,
            )
            return mirror.published(report)
    base = Path(run_dir)
    if not base.is_dir():
        raise InputError(
            f"run folder {base} does not exist or is not a folder; check the path", path=str(base)
        )
    if type(max_rollout_attempts) is not int or max_rollout_attempts < 1:
        raise ConfigError(
            f"max_rollout_attempts={max_rollout_attempts!r} must be an integer >= 1 (default 3)",
            key="max_rollout_attempts",
        )
    scan = _Scan(base)
    shards = [shard_paths(base, shard) for shard in list_shards(base)]

    default_planned: set[Identity] = set()
    for paths in shards:
        for identity, _ in scan.identified(paths.materialized_inputs, skip_omitted=False):
            default_planned.add(identity)
    planned_set = set(planned) if planned is not None else default_planned
    # A stream's record_dir has shards but no materialized inputs (rows arrive while it runs): judge it by
    # what it recorded, so that only lost, duplicate, corrupt and unsettled records count against it.
    recorded_is_plan = (
        planned is None and bool(shards) and not any(p.materialized_inputs.exists() for p in shards)
    )
    unplanned = 0 if planned is not None else max(0, (_run_rows(base) or 0) - len(default_planned))

    # Shard files are always read: for corrupt lines, and for attempts when request counts are given.
    shard_successes: Counter[Identity] = Counter()
    shard_failures: list[tuple[Identity, dict[str, Any]]] = []
    attempts_seen: defaultdict[Identity, set[int]] = defaultdict(set)
    track_attempts = request_counts is not None
    for paths in shards:
        for identity, record in scan.identified(paths.successes, skip_omitted=False):
            shard_successes[identity] += 1
            if track_attempts:
                attempts_seen[identity].add(_attempt(record))
        for identity, record in scan.identified(paths.failures, skip_omitted=True):
            shard_failures.append((identity, _slim(record)))
            if track_attempts:
                attempts_seen[identity].add(_attempt(record))

    merged = base / f"{merged_prefix}.jsonl"
    source: Literal["merged", "shards"] = "merged" if merged.exists() else "shards"
    if source == "merged":
        successes: Counter[Identity] = Counter(
            identity for identity, _ in scan.identified(merged, skip_omitted=False)
        )
        failures = [
            (identity, _slim(record))
            for identity, record in scan.identified(
                base / f"{merged_prefix}_failures.jsonl", skip_omitted=True
            )
        ]
    else:
        successes, failures = shard_successes, shard_failures

    failure_counts: Counter[Identity] = Counter(identity for identity, _ in failures)
    terminal = {identity for identity, record in failures if record.get(keys.FAILURE_TERMINAL) is True}
    maxed = {identity for identity, count in failure_counts.items() if count >= max_rollout_attempts}
    success_ids = set(successes)
    recorded = success_ids | set(failure_counts)
    if recorded_is_plan:
        planned_set = set(recorded)
    settled = success_ids | terminal | maxed
    acknowledged_set = set(acknowledged) if acknowledged is not None else set()

    lost_ids = sorted(acknowledged_set - recorded)
    missing_ids = sorted(planned_set - settled)
    unexpected_ids = sorted(recorded - planned_set)
    duplicate_ids = sorted(identity for identity, count in successes.items() if count > 1)
    wasted = None
    if request_counts is not None:
        wasted = sum(
            max(0, count - len(attempts_seen.get(identity, ()))) for identity, count in request_counts.items()
        )
    return LedgerReport(
        run_dir=str(base),
        source=source,
        planned=len(planned_set) + unplanned,
        unplanned=unplanned,
        recorded=len(recorded),
        settled=len(settled),
        lost=len(lost_ids),
        missing=len(missing_ids),
        duplicates=sum(successes.values()) - len(success_ids),
        unexpected=len(unexpected_ids),
        corrupt_lines=sum(scan.corrupt.values()),
        unidentified_lines=scan.unidentified,
        wasted_requests=wasted,
        lost_ids=tuple(lost_ids),
        missing_ids=tuple(missing_ids),
        duplicate_ids=tuple(duplicate_ids),
        unexpected_ids=tuple(unexpected_ids),
        corrupt_by_file=dict(sorted(scan.corrupt.items())),
    )


def _run_rows(base: Path) -> int | None:
    """The run's full size from its run manifest (``run_rows``), or None when not recorded."""
    try:
        value = json.loads((base / RUN_MANIFEST).read_text(encoding="utf-8")).get("run_rows")
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int and value >= 0 else None


def _slim(record: Mapping[str, Any]) -> dict[str, Any]:
    # Keep only what the figures need, so memory holds identities rather than whole failure records.
    return {keys.FAILURE_TERMINAL: record.get(keys.FAILURE_TERMINAL) is True}
