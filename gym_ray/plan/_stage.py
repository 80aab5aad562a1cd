"""Cutting rows into shard files in a staging folder (the write half of :mod:`gym_ray.plan.shards`).

Each shard's rows are encoded as compact JSON lines (``json``'s bytes, through orjson where provably equal:
:func:`gym_ray._json.dumps_compact_lines`), in batches of :data:`_WRITE_BATCH` rows, written and digested
as encoded, so a shard's manifest needs no second read of its file. Memory holds one batch of rows and the
shard's attempt plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from gym_ray import keys
from gym_ray._json import dumps_compact_lines
from gym_ray.errors import UsageError
from gym_ray.record.manifest import AttemptPlanEntry

__all__ = ["Staged", "StampedLine", "shard_label", "stage_shards"]


def shard_label(index: int) -> str:
    """The label of shard ``index`` (``00007``)."""
    return f"{index:05d}"


#: A planned row given as its encoded line (:mod:`gym_ray.plan._proven_pass`): ``(task, rollout, attempt,
#: line)``, the indices the shard's attempt plan records and json's compact text of the row, newline
#: included (a plain tuple: a named one costs a Python call per row).
StampedLine = tuple[int, int, int, bytes]


class Staged(NamedTuple):
    """One shard cut into the staging folder: what its manifest needs, without reading the file back."""

    label: str
    num_rows: int
    digest: str  # sha256 of the bytes written
    attempt_plan: list[AttemptPlanEntry]


def stage_shards(rows: Iterable[dict[str, Any] | StampedLine], staging: Path, size: int) -> Iterator[Staged]:
    """Write each shard's rows to ``staging``; yields each shard once it is closed.

    A :class:`StampedLine` is written as its line (the caller proved it is the row's encoding).

    A shard is cut at the first task boundary after ``size`` rows (a task's contiguous rollouts stay in
    one shard). An ``OSError`` that names no file is given the staging folder's name.

    Raises:
        UsageError: A row has no integer ``_ng_task_index`` / ``_ng_rollout_index``.
    """
    try:
        yield from _stage_rows(rows, staging, size)
    except OSError as exc:
        if exc.filename is None:  # a write or close error names no file: name the staging folder
            exc.filename = str(staging)
        raise


#: Lines of a shard encoded before they are written and digested together.
_WRITE_BATCH = 256


def _stage_rows(rows: Iterable[dict[str, Any] | StampedLine], staging: Path, size: int) -> Iterator[Staged]:
    index = 0
    last_task: Any = object()
    digest = hashlib.sha256()
    plan: list[AttemptPlanEntry] = []
    batch: list[dict[str, Any] | bytes] = []
    out = None
    task_key, rollout_key, attempt_key = keys.TASK_INDEX, keys.ROLLOUT_INDEX, keys.ATTEMPT_INDEX
    try:
        for position, row in enumerate(rows):
            task: Any
            rollout: Any
            attempt: Any
            item: dict[str, Any] | bytes
            if isinstance(row, tuple):
                task, rollout, attempt, item = row
            else:
                task, rollout, item = row.get(task_key), row.get(rollout_key), row
                attempt = row.get(attempt_key)  # as ShardManifest.build reads it back
            if out is not None and len(plan) >= size and task != last_task:
                _write_rows(out, digest, batch)
                out.close()
                out = None
                yield Staged(shard_label(index), len(plan), digest.hexdigest(), plan)
                index, plan = index + 1, []
            if out is None:
                out = open(staging / f"{shard_label(index)}.jsonl", "wb")
                digest = hashlib.sha256()
            if type(task) is not int or type(rollout) is not int:
                raise UsageError(
                    f"row {position} has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX}; "
                    "pass rows through preprocess_examples before planning a run"
                )
            batch.append(item)
            if len(batch) >= _WRITE_BATCH:
                _write_rows(out, digest, batch)
            plan.append((task, rollout, attempt if type(attempt) is int else 0))
            last_task = task
        if out is not None:
            _write_rows(out, digest, batch)
            out.close()
            out = None
            yield Staged(shard_label(index), len(plan), digest.hexdigest(), plan)
    finally:
        if out is not None:
            out.close()


def _write_rows(out: BinaryIO, digest: Any, batch: list[dict[str, Any] | bytes]) -> None:
    """Write ``batch`` as JSON lines to ``out`` and into ``digest`` (a line given as bytes as it is);
    empties ``batch``."""
    if batch:
        block = _encoded(batch)
        out.write(block)
        digest.update(block)
        batch.clear()


def _encoded(batch: list[dict[str, Any] | bytes]) -> bytes:
    """The lines of ``batch``: rows encoded by :func:`dumps_compact_lines`, lines given as bytes as is."""
    first = type(batch[0])
    if all(type(item) is first for item in batch):
        return b"".join(batch) if first is bytes else dumps_compact_lines(batch)  # type: ignore[arg-type]
    parts: list[bytes] = []
    rows: list[Any] = []
    for item in batch:
        if type(item) is bytes:
            if rows:
                parts.append(dumps_compact_lines(rows))
                rows = []
            parts.append(item)
        else:
            rows.append(item)
    if rows:
        parts.append(dumps_compact_lines(rows))
    return b"".join(parts)
