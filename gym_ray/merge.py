"""Merge a run's shards into ``rollouts.jsonl`` and ``rollouts_failures.jsonl`` (PROTOCOL.md section 5).

Order and deduplication (the merged files are what users consume, so each identity appears once):

- Both files are ordered by ``(task, rollout, attempt)``; ties keep shard-label order, then file order.
- ``rollouts.jsonl``: exactly one success per ``(task, rollout)``: the first in that order (the lowest
  attempt index). Further successes of the same identity are dropped and counted.
- ``rollouts_failures.jsonl``: for identities *without* a success, every failure attempt, one line per
  ``(task, rollout, attempt)`` (a repeated attempt index is a duplicate and is dropped).
  ``MergeResult.terminal_failures`` counts the identities among them with a terminal failure. Failures of an
  identity that has a success are superseded and dropped; they stay in the shard sidecars.
- Omitted rows (``_ng_no_persist``, present only under ``record_omitted_rollouts``) are not outcomes and
  are left out. Corrupt lines and torn tails are skipped and counted.

Memory is bounded by one shard (a unit of work), not by the run: each shard is sorted in memory into a
temp file under ``<run_dir>/.merge-*``, then the sorted files are heap-merged as streams (in several
passes when there are more than ``fan_in`` shards, to bound open files).

Durability: each output is written to a temp file, fsynced and renamed into place, so a reader sees the
old or the new file, never a partial one. The two files are replaced one after the other (failures first),
not together. Merging reads the shard files without taking their locks: merge a run once its writers are
done.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict

from gym_ray import keys
from gym_ray._internal.atomic import atomic_writer
from gym_ray._internal.jsonl import JsonlReader, encode_line
from gym_ray._internal.shard_files import list_shards, record_identity, shard_paths
from gym_ray.errors import ConfigError, InputError, RecordError

__all__ = ["MergeResult", "merge_shards"]

# (task, rollout, kind, attempt, shard number, line number); kind 0 = success, 1 = failure.
_SortKey = tuple[int, int, int, int, int, int]
_Entry = tuple[_SortKey, bytes]
_SUCCESS, _FAILURE = 0, 1
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+$")


class MergeResult(BaseModel):
    """What :func:`merge_shards` wrote and dropped."""

    model_config = ConfigDict(frozen=True)

    successes_path: Path
    failures_path: Path
    shards: tuple[str, ...]
    successes: int
    failures: int
    terminal_failures: int
    duplicate_successes_dropped: int
    superseded_failures_dropped: int
    duplicate_failures_dropped: int
    omitted_rows_skipped: int
    corrupt_lines: int


class _Tally:
    def __init__(self) -> None:
        self.successes = 0
        self.failures = 0
        self.terminal = 0
        self.duplicate_successes = 0
        self.superseded_failures = 0
        self.duplicate_failures = 0
        self.omitted = 0
        self.corrupt = 0


def merge_shards(
    run_dir: str | os.PathLike[str], *, output_prefix: str = "rollouts", fan_in: int = 64
) -> MergeResult:
    """Merge every shard of ``run_dir`` into ``<prefix>.jsonl`` and ``<prefix>_failures.jsonl``.

    See the module docstring for the order, deduplication and durability rules.

    Args:
        run_dir: The run folder.
        output_prefix: Stem of the merged files (``[A-Za-z0-9._-]``).
        fan_in: Most sorted shard files merged at once (>= 2).

    Returns:
        Paths and counts.

    Raises:
        InputError: The folder has no shards, or a record has no integer ``_ng_task_index`` /
            ``_ng_rollout_index`` (names file and line).
        ConfigError: ``output_prefix`` or ``fan_in`` is invalid.
        RecordError: Reading or writing failed (the merged files are left as they were).

    Example:
        >>> result = merge_shards("runs/2024-06-01")  # doctest: +SKIP
        >>> result.successes, result.duplicate_successes_dropped  # doctest: +SKIP
        (2000, 0)
    """
    if (
        not isinstance(output_prefix, str)
        or not _PREFIX_RE.match(output_prefix)
        or ".." in output_prefix
        or output_prefix.startswith("rollouts-")
    ):
        raise ConfigError(
            f"output_prefix={output_prefix!r} must be a file stem of letters, digits, '.', '_' and '-' "
            "(no path separators, no '..') that does not start with 'rollouts-' (shard files do); the "
            "default is 'rollouts'",
            key="output_prefix",
        )
    if type(fan_in) is not int or fan_in < 2:
        raise ConfigError(f"fan_in={fan_in!r} must be an integer >= 2", key="fan_in")
    base = Path(run_dir)
    shards = list_shards(base)
    if not shards:
        raise InputError(
            f"run folder {base} has no shard files (rollouts-<shard>.*); nothing to merge. Check the path",
            path=str(base),
        )
    successes_path = base / f"{output_prefix}.jsonl"
    failures_path = base / f"{output_prefix}_failures.jsonl"
    tally = _Tally()
    try:
        with tempfile.TemporaryDirectory(dir=base, prefix=".merge-") as tmp:
            runs = [
                run
                for number, shard in enumerate(shards)
                if (run := _sort_shard(base, shard, number, Path(tmp), tally)) is not None
            ]
            runs = _reduce_runs(runs, Path(tmp), fan_in)
            with atomic_writer(successes_path) as out_ok, atomic_writer(failures_path) as out_failed:
                _write_merged(runs, out_ok, out_failed, tally)
    except OSError as exc:
        raise RecordError(
            f"merging the shards of {base} failed ({exc}); the merged files are unchanged"
        ) from exc
    return MergeResult(
        successes_path=successes_path,
        failures_path=failures_path,
        shards=tuple(shards),
        successes=tally.successes,
        failures=tally.failures,
        terminal_failures=tally.terminal,
        duplicate_successes_dropped=tally.duplicate_successes,
        superseded_failures_dropped=tally.superseded_failures,
        duplicate_failures_dropped=tally.duplicate_failures,
        omitted_rows_skipped=tally.omitted,
        corrupt_lines=tally.corrupt,
    )


def _sort_shard(base: Path, shard: str, number: int, tmp: Path, tally: _Tally) -> Path | None:
    """Sort one shard's successes and failures into a temp file of key-prefixed lines."""
    paths = shard_paths(base, shard)
    entries: list[_Entry] = []
    for kind, path in ((_SUCCESS, paths.successes), (_FAILURE, paths.failures)):
        reader = JsonlReader(path)
        for line_no, record in reader:
            if kind == _FAILURE and record.get(keys.NO_PERSIST):
                tally.omitted += 1
                continue
            identity = record_identity(record)
            if identity is None:
                raise InputError(
                    f"{path}:{line_no}: record has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX} (got "
                    f"{record.get(keys.TASK_INDEX)!r}, {record.get(keys.ROLLOUT_INDEX)!r}), so it cannot be "
                    "ordered or deduplicated; fix or remove that line and merge again",
                    path=str(path),
                    line=line_no,
                )
            attempt = record.get(keys.ATTEMPT_INDEX)
            key = (identity[0], identity[1], kind, attempt if type(attempt) is int else 0, number, line_no)
            entries.append((key, encode_line(record)))
        tally.corrupt += len(reader.corrupt_lines)
    if not entries:
        return None
    entries.sort(key=lambda entry: entry[0])
    out = tmp / f"shard-{number:06d}.sorted"
    with out.open("wb") as handle:
        _write_entries(handle, entries)
    return out


def _write_entries(handle: BinaryIO, entries: Iterable[_Entry]) -> None:
    for key, line in entries:
        handle.write(b"%d\t%d\t%d\t%d\t%d\t%d\t" % key + line)


def _read_entries(path: Path) -> Iterator[_Entry]:
    with path.open("rb") as handle:
        for line in handle:
            parts = line.split(b"\t", 6)
            key = (int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]), int(parts[5]))
            yield key, parts[6]


def _merged(runs: list[Path]) -> Iterator[_Entry]:
    return heapq.merge(*(_read_entries(run) for run in runs), key=lambda entry: entry[0])


def _reduce_runs(runs: list[Path], tmp: Path, fan_in: int) -> list[Path]:
    """Merge sorted files in groups until at most ``fan_in`` remain (bounds the files open at once)."""
    level = 0
    while len(runs) > fan_in:
        level += 1
        merged: list[Path] = []
        for group_no, start in enumerate(range(0, len(runs), fan_in)):
            out = tmp / f"level-{level}-{group_no:06d}.sorted"
            group = runs[start : start + fan_in]
            with out.open("wb") as handle:
                _write_entries(handle, _merged(group))
            for path in group:
                path.unlink()
            merged.append(out)
        runs = merged
    return runs


def _write_merged(runs: list[Path], out_ok: BinaryIO, out_failed: BinaryIO, tally: _Tally) -> None:
    for _, group in itertools.groupby(_merged(runs), key=lambda entry: entry[0][:2]):
        entries = list(group)
        successes = [line for key, line in entries if key[2] == _SUCCESS]
        failures = [(key[3], line) for key, line in entries if key[2] == _FAILURE]
        if successes:
            out_ok.write(successes[0])
            tally.successes += 1
            tally.duplicate_successes += len(successes) - 1
            tally.superseded_failures += len(failures)
            continue
        last_attempt: int | None = None
        terminal = False
        for attempt, line in failures:
            if attempt == last_attempt:
                tally.duplicate_failures += 1
                continue
            out_failed.write(line)
            tally.failures += 1
            last_attempt = attempt
            terminal = terminal or json.loads(line).get(keys.FAILURE_TERMINAL) is True
        tally.terminal += terminal
