"""Planning's first pass over the input: read, preprocess and validate every row, before anything is written.

:func:`gym_ray.plan.shards.iter_prepare_run` reads its input twice: :func:`first_pass` validates every row,
counts the rows the run plans and records each task-numbering lookup (sorted runs and the digests in
order, :class:`~gym_ray.plan._spill_dedupe.RangeRecorder`); the second pass numbers tasks from those and
cuts shards. A large file is validated over byte ranges in parallel processes
(:mod:`gym_ray.plan._parallel_pass`), a common row without building its copies
(:mod:`gym_ray.plan._validate_pass`). At the first problem the general pass runs again with exact task
numbers and raises the error the user sees.

**Ahead of Ray.** On Ray, planning runs in the driver actor, so a bad row would be reported only after Ray
and the actors started (seconds late, and after "anything that can be checked before Ray starts" was
promised). :func:`validate_ahead` runs the first pass in the calling process before Ray starts, into a
folder of its own, and returns a :class:`CheckedInput`. It travels with the planner to the driver actor,
which runs on the caller's node (:func:`gym_ray.distributed.placement.pinned_to_caller`):
:func:`take_checked` moves the folder into the actor's dedupe (one rename: the handoff happens at most
once) and adopts the recorded parts, so the input is read twice in all, as in one process. When the
handoff cannot happen (another host or file system, the folder already taken by an earlier attempt, the
input file changed since it was checked, or settings that number tasks in memory) the driver runs the
first pass again itself, with the same outcome.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_ray.config.run_config import RunConfig
from gym_ray.config.settings import RunSettings
from gym_ray.config.topology import Topology
from gym_ray.errors import GymRayError, InputError, InternalError, RoutingError, UsageError, ValidationError
from gym_ray.plan._locate import located_error
from gym_ray.plan._parallel_pass import CountedPart, valid_ranges
from gym_ray.plan._spill_dedupe import RangeRecorder, RecordedPart, SpillDedupe, owned_folder
from gym_ray.plan._valid_lines import count_valid_lines
from gym_ray.plan._validate_pass import RowsInvalid, count_valid_rows, preprocess_knobs
from gym_ray.plan.load import ReadWrapper, _load_jsonl_via, non_finite_problem, until_stopped
from gym_ray.plan.preprocess import TaskNumbering, iter_preprocess
from gym_ray.plan.validation import validate_rows

__all__ = [
    "CheckedInput",
    "adopt_parts",
    "count_rows",
    "first_pass",
    "input_rows",
    "numbers_in_memory",
    "take_checked",
    "validate_ahead",
]


def _finite_rows(rows: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """``rows``, refusing the first one that holds ``nan`` / ``inf`` (JSON cannot carry them)."""
    for pos, row in enumerate(rows):
        problem = non_finite_problem(row)
        if problem is not None:
            raise InputError(f"input row {pos}: {problem}", row=pos)
        yield row


def _limited_rows(
    settings: RunSettings,
    rows: Iterable[Mapping[str, Any]] | None,
    stop: threading.Event | None = None,
    wrap_read: ReadWrapper | None = None,
    proven: bool = False,
) -> Callable[[], Iterable[Mapping[str, Any]]]:
    """The input rows (read again on each call), cut to ``limit``: see :func:`input_rows`; the file read
    through ``wrap_read`` when given, without the strict-JSON checks when its bytes are ``proven``."""
    if rows is None:
        if settings.input_jsonl_fpath is None:
            raise UsageError(
                "no input rows: set input_jsonl_fpath in the config (+input_jsonl_fpath=rows.jsonl) "
                "or pass rows"
            )
        path = settings.input_jsonl_fpath

        def source() -> Iterable[Mapping[str, Any]]:
            strict = settings.strict_json and not proven
            return _load_jsonl_via(path, strict_json=strict, wrap_read=wrap_read)
    else:
        if iter(rows) is rows:
            raise UsageError("rows must be a re-iterable collection (a list), not a one-shot iterator")
        fixed = rows

        def source() -> Iterable[Mapping[str, Any]]:
            return _finite_rows(fixed)

    limit = settings.limit or None  # NeMo Gym: 0 or null = every row

    def limited() -> Iterable[Mapping[str, Any]]:
        # The first ``limit`` input rows, before anything else (NeMo Gym 0.7's ``limit``).
        return until_stopped(source() if limit is None else itertools.islice(source(), limit), stop)

    return limited


def input_rows(
    settings: RunSettings,
    topology: Topology,
    rows: Iterable[Mapping[str, Any]] | None = None,
    stop: threading.Event | None = None,
    *,
    proven_by: ReadWrapper | None = None,
) -> Callable[..., Iterator[dict[str, Any]]]:
    """A re-iterable source of the run's preprocessed rows (the input is read once per call).

    Rows come from ``rows`` (a re-iterable collection) or the settings' ``input_jsonl_fpath``, cut to the
    first ``limit`` rows when ``limit`` is set. The returned callable takes an optional
    ``task_numbering`` (see :func:`gym_ray.plan.preprocess.iter_preprocess`). With ``strict_json`` (the
    default) a file's duplicate keys and non-finite numbers, and ``nan`` / ``inf`` in passed rows, raise
    :class:`~gym_ray.errors.InputError` naming the file and line, or the row, while the rows are read.
    Reading raises :class:`~gym_ray.plan.load.Stopped` once ``stop`` is set. ``proven_by``: the file's
    reads go through it (planning's second pass: a :class:`~gym_ray.plan._input_chunks.ChunkCheck` that
    proves each chunk is what the validated pass read), so the strict-JSON checks, passed already, are
    skipped.
    """
    limited = _limited_rows(settings, rows, stop, proven_by, proven=proven_by is not None)

    def preprocessed(task_numbering: TaskNumbering | None = None) -> Iterator[dict[str, Any]]:
        return iter_preprocess(
            limited(),
            **preprocess_knobs(settings),
            interleave_repeats=settings.interleave_repeats,
            topology=topology,
            task_numbering=task_numbering,
            from_json=rows is None,  # rows parsed here from the input file, seen by nobody else
        )

    return preprocessed


def numbers_in_memory(settings: RunSettings) -> bool:
    """True when planning numbers tasks in memory in both passes, so no first pass can be handed over.

    ``task_ids`` selects by task index, which the first pass must then know exactly, and
    ``interleave_repeats`` buffers the whole output anyway.
    """
    return settings.task_ids is not None or settings.interleave_repeats


def count_rows(rows: Iterable[Mapping[str, Any]], topology: Topology) -> int:
    """Validate ``rows`` (:func:`~gym_ray.plan.validation.validate_rows`) and return how many there were."""
    counted = 0

    def counting() -> Iterator[Mapping[str, Any]]:
        nonlocal counted
        for row in rows:
            counted += 1
            yield row

    validate_rows(counting(), topology)
    return counted


def first_pass(
    settings: RunSettings,
    topology: Topology,
    rows: Iterable[Mapping[str, Any]] | None,
    folder: Path,
    stop: threading.Event | None = None,
) -> list[CountedPart]:
    """Validate every input row; per part of the input, in order, the rows it plans and its lookups.

    Args:
        settings: The run's settings (not one that :func:`numbers_in_memory`).
        topology: The running config.
        rows: The input rows, or None to read ``input_jsonl_fpath``.
        folder: Where the recorded lookups go (the files stay there for :func:`adopt_parts`).
        stop: When set (by the cancelled caller of a thread running this), the pass stops within
            about a thousand rows.

    Raises:
        GymRayError: The input is unreadable or a row does not validate: the general pass's error, with
            each row named by its real task index (nothing has been written but files under ``folder``).
        Stopped: ``stop`` was set.
    """
    source = input_rows(settings, topology, rows, stop)
    try:
        # From a file, common rows are validated without building their copies, a large file over byte
        # ranges in parallel processes; None: not applicable
        parts = None if rows is not None else valid_ranges(settings, topology, folder, stop)
        if parts is None:
            recorder = RangeRecorder(folder, "whole")
            try:
                found = None
                if rows is None:  # one process (a small file, limit set, ...)
                    logged = recorder.chunk_log(0, None)
                    found = count_valid_lines(settings, topology, recorder, wrap_read=logged, stop=stop)
                    if found is None:  # limit set, or knobs that rewrite rows: the general chain
                        limited = _limited_rows(settings, None, stop, logged)
                        found = count_valid_rows(limited(), settings, topology, recorder)
                if found is None:
                    found = count_rows(source(recorder), topology)
                parts = [(found, recorder.finish())]
            finally:
                recorder.close()
    except (GymRayError, RowsInvalid) as exc:
        # The pass numbers tasks with stand-ins; redo it with exact numbers so the error names each row
        # by its real task index (failing runs only). A file's first bad row is named by its line, on one
        # line (_locate).
        try:
            count_rows(source(), topology)
        except (ValidationError, RoutingError, InputError) as general:
            located = located_error(settings, topology, stop) if rows is None else None
            if located is None:
                raise
            raise located from general
        if isinstance(exc, GymRayError):
            raise
        raise InternalError(f"the validation pass refused {exc}, which the general pass accepts") from exc
    return parts


def adopt_parts(dedupe: SpillDedupe, parts: Iterable[RecordedPart]) -> None:
    """Hand the recorded parts to ``dedupe`` in input order (each digests file is read, then removed)."""
    for part in parts:
        dedupe.adopt_range(*part)
        part.digests.unlink()


def _file_identity(settings: RunSettings) -> tuple[str, int, int] | None:
    """``(path, size, mtime_ns)`` of the input file (None for passed rows or an unreadable file)."""
    path = settings.input_jsonl_fpath
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return str(path), info.st_size, info.st_mtime_ns


@dataclass(frozen=True)
class CheckedInput:
    """The outcome of :func:`validate_ahead`, handed to the planner (picklable; paths are relative).

    Attributes:
        rows: Rows the run plans (the input's count after preprocessing).
        host: The host whose file system holds ``folder``.
        folder: The recorded lookups (None when the settings number tasks in memory).
        parts: Per part of the input, in order: its run files, digests file (relative to ``folder``) and
            lookups.
        source: The input file's ``(path, size, mtime_ns)`` when it was validated (None for passed rows).
    """

    rows: int
    host: str
    folder: str | None
    parts: tuple[tuple[tuple[str, ...], str, int], ...]
    source: tuple[str, int, int] | None

    def discard(self) -> None:
        """Remove the folder unless a planner took it (idempotent)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def validate_ahead(
    run: RunConfig, rows: Iterable[Mapping[str, Any]] | None = None, *, stop: threading.Event | None = None
) -> CheckedInput:
    """Run planning's first pass here, now (before Ray starts); the caller discards the result when done.

    Raises:
        GymRayError: What the first pass raises (a row that does not validate, an unreadable input).
        Stopped: ``stop`` was set (see :func:`first_pass`; nothing is left behind).
    """
    settings, topology = run.settings, run.topology
    identity = _file_identity(settings) if rows is None else None
    if numbers_in_memory(settings):
        counted = count_rows(input_rows(settings, topology, rows, stop)(), topology)
        return CheckedInput(counted, socket.gethostname(), None, (), identity)
    folder = owned_folder()
    try:
        parts = first_pass(settings, topology, rows, folder, stop)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    relative = tuple(
        (
            tuple(str(run_file.relative_to(folder)) for run_file in part.runs),
            str(part.digests.relative_to(folder)),
            part.lookups,
        )
        for _count, part in parts
    )
    total = sum(count for count, _part in parts)
    return CheckedInput(total, socket.gethostname(), str(folder), relative, identity)


def take_checked(checked: CheckedInput, settings: RunSettings, dedupe: SpillDedupe) -> int | None:
    """Adopt ``checked``'s recorded lookups into ``dedupe``; the rows the run plans, or None when it cannot.

    None (nothing adopted) when the folder is on another host or file system, was taken already, or the
    input file is no longer the one that was validated: the caller then runs :func:`first_pass` itself.
    """
    if checked.folder is None or checked.host != socket.gethostname():
        return None
    if checked.source is not None and checked.source != _file_identity(settings):
        return None
    target = dedupe.folder / "checked"
    try:
        os.rename(checked.folder, target)  # at most one planner takes it
    except OSError:
        return None
    adopt_parts(
        dedupe,
        (
            RecordedPart([target / name for name in runs], target / digests, lookups)
            for runs, digests, lookups in checked.parts
        ),
    )
    return checked.rows
