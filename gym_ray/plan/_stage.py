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

__all__ = ["Staged", "shard_label", "stage_shards"]


def shard_label(index: int) -> str:
    """The label of shard ``index`` (``00007``)."""
    return f"{index:05d}"


class Staged(NamedTuple):
    """One shard cut into the staging folder: what its manifest needs, without reading the file back."""

    label: str
    num_rows: int
    digest: str  # sha256 of the bytes written
    attempt_plan: list[AttemptPlanEntry]


def stage_shards(rows: Iterable[dict[str, Any]], staging: Path, size: int) -> Iterator[Staged]:
    """Write each shard's rows to ``staging``; yields each shard once it is closed.

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


def _stage_rows(rows: Iterable[dict[str, Any]], staging: Path, size: int) -> Iterator[Staged]:
    index = 0
    last_task: Any = object()
    digest = hashlib.sha256()
    plan: list[AttemptPlanEntry] = []
    batch: list[dict[str, Any]] = []
    out = None
    task_key, rollout_key, attempt_key = keys.TASK_INDEX, keys.ROLLOUT_INDEX, keys.ATTEMPT_INDEX
    try:
        for position, row in enumerate(rows):
            task = row.get(task_key)
            if out is not None and len(plan) >= size and task != last_task:
                _write_rows(out, digest, batch)
                out.close()
                out = None
                yield Staged(shard_label(index), len(plan), digest.hexdigest(), plan)
                index, plan = index + 1, []
            if out is None:
                out = open(staging / f"{shard_label(index)}.jsonl", "wb")
                digest = hashlib.sha256()
            rollout = row.get(rollout_key)
            if type(task) is not int or type(rollout) is not int:
                raise UsageError(
                    f"row {position} has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX}; "
                    "pass rows through preprocess_examples before planning a run"
                )
            batch.append(row)
            if len(batch) >= _WRITE_BATCH:
                _write_rows(out, digest, batch)
            attempt = row.get(attempt_key)  # as ShardManifest.build reads it back
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


def _write_rows(out: BinaryIO, digest: Any, batch: list[dict[str, Any]]) -> None:
    """Write ``batch`` as JSON lines to ``out`` and into ``digest``; empties ``batch``."""
    if batch:
        block = dumps_compact_lines(batch)
        out.write(block)
        digest.update(block)
        batch.clear()
