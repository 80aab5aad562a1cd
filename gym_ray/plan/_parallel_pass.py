"""Planning's validation pass over byte ranges of a large input file, in parallel processes.

:func:`gym_ray.plan.first_pass.first_pass` validates a whole input file before anything is written
(:func:`gym_ray.plan._validate_pass.count_valid_rows`). For a large file, :func:`valid_ranges` cuts
the file into byte ranges at newlines; this process validates the first range while a spawned process
validates each other one. Each range's pass counts the rows it plans and records every task-numbering
lookup (a row's 64-bit content digest) with a :class:`~gym_ray.plan._spill_dedupe.RangeRecorder`: sorted
runs and the digests in order, in files under the pass's folder, so the sorting is done in parallel
too. Only when every range is valid are they handed on, to be adopted by the run's
:class:`~gym_ray.plan._spill_dedupe.SpillDedupe` range by range in file order
(:meth:`~gym_ray.plan._spill_dedupe.SpillDedupe.adopt_range`: the ordinals shifted, the digests hashed in
order): the dedupe then holds exactly the lookups the one-process pass makes, in the same order, so the
planning pass numbers tasks and cuts shards byte for byte as it would have.

Contract kept: a range with a problem stops the pass (:class:`~gym_ray.plan._validate_pass.RowsInvalid`),
before anything is written to the run folder or dispatched; the caller then runs the general one-process
pass, which raises the error the user sees (the file's 1-based line, the row and its task). A range child
that dies or fails unexpectedly makes :func:`valid_ranges` return None (its files removed), and the
caller validates in one process.

When: the input is a file, ``limit`` is unset, no knob rewrites rows (the common-row pass applies), the
file has at least :data:`MIN_PARALLEL_BYTES` (a spawned process costs about a second of start-up), this
process may start children (not a daemon) and has >= 2 CPUs. Processes: one per CPU this process may use, at
most :data:`MAX_PROCESSES` and at most one per :data:`MIN_RANGE_BYTES` of the file. :data:`PROCESSES` forces a
number of ranges (tests); it is no config key.

Concurrency: every child is owned by the call: started in it, and terminated (if still running) and
joined before it returns or raises, KeyboardInterrupt included. Children import only the planning modules
they run (:mod:`gym_ray.plan._range_child`: not the settings' model) and get the settings as plain data.
Memory: each process buffers one chunk of records (as the dedupe does); the files (24 bytes per row:
sorted runs and digests) live in the pass's temporary folder, removed with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from gym_ray._spawn import main_script_not_rerun
from gym_ray.config.settings import RunSettings
from gym_ray.config.topology import Topology
from gym_ray.plan._range_child import RangeJob, count_range, range_child
from gym_ray.plan._spill_dedupe import RecordedPart
from gym_ray.plan._validate_pass import RowsInvalid, preprocess_knobs
from gym_ray.plan.preprocess import _Preprocessor

__all__ = [
    "MAX_PROCESSES",
    "MIN_PARALLEL_BYTES",
    "MIN_RANGE_BYTES",
    "PROCESSES",
    "CountedPart",
    "split_ranges",
    "valid_ranges",
]

#: Smallest input file validated in several processes (smaller ones: spawning costs more than it saves).
MIN_PARALLEL_BYTES = 64 * 1024 * 1024
#: Fewest input bytes per process: a file of ``n`` times this is validated in at most ``n`` processes.
MIN_RANGE_BYTES = MIN_PARALLEL_BYTES // 2
#: Most processes (this one included) one validation pass uses.
MAX_PROCESSES = 16
#: When set, the number of ranges whatever the file's size and the CPUs (tests force parallel passes).
PROCESSES: int | None = None

#: One validated part of the input: the rows it plans and its recorded task-numbering lookups.
CountedPart = tuple[int, RecordedPart]

logger = logging.getLogger(__name__)
_SCAN_BYTES = 1 << 16  # bytes read at a time when looking for a range's first newline


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def split_ranges(path: str, parts: int) -> list[tuple[int, int]]:
    """Up to ``parts`` non-empty byte ranges ``[start, end)`` covering the file, each of whole lines.

    Range ``k`` starts just after the first newline at or after byte ``size * k // parts - 1`` (so a cut
    that falls right after a newline stays there); ranges left empty by a long line are dropped.
    """
    size = os.path.getsize(path)
    starts = [0]
    with open(path, "rb") as handle:
        for k in range(1, parts):
            target = max(size * k // parts, starts[-1])
            if target <= 0 or target >= size:
                continue
            handle.seek(target - 1)
            at = target - 1
            while True:
                chunk = handle.read(_SCAN_BYTES)
                if not chunk:
                    at = size
                    break
                found = chunk.find(b"\n")
                if found >= 0:
                    at += found + 1
                    break
                at += len(chunk)
            if starts[-1] < at < size:
                starts.append(at)
    ends = [*starts[1:], size]
    return [(start, end) for start, end in zip(starts, ends, strict=True) if start < end]


def _planned_ranges(settings: RunSettings, topology: Topology) -> list[tuple[int, int]]:
    """The ranges to validate in parallel, or [] to validate in one process."""
    path = settings.input_jsonl_fpath
    if path is None or settings.limit or multiprocessing.current_process().daemon:
        return []
    try:
        size = os.path.getsize(path)
    except OSError:
        return []  # the one-process pass reports the file
    parts = PROCESSES
    if parts is None:
        if size < MIN_PARALLEL_BYTES:
            return []
        parts = min(MAX_PROCESSES, _usable_cpus(), size // MIN_RANGE_BYTES)
    if parts < 2 or not _rows_kept(settings, topology):
        return []
    ranges = split_ranges(str(path), parts)
    return ranges if len(ranges) >= 2 else []


def _rows_kept(settings: RunSettings, topology: Topology) -> bool:
    """True when the common-row pass applies (no knob rewrites rows; else the general pass runs)."""
    state = _Preprocessor(**preprocess_knobs(settings), topology=topology, from_json=True)
    return state.common is not None


def valid_ranges(
    settings: RunSettings, topology: Topology, folder: Path, stop: threading.Event | None = None
) -> list[CountedPart] | None:
    """Validate the input file over byte ranges in parallel processes; each range's count and lookups.

    Args:
        settings: The run's settings (``input_jsonl_fpath`` is the file).
        topology: The running config.
        folder: Where the ranges' files go (a new folder in it, removed again when the pass fails).
        stop: When set, the range read here raises :class:`~gym_ray.plan.load.Stopped` (the range
            processes are then terminated).

    Returns:
        Per range, in file order: the count of preprocessed rows and its recorded lookups (together what
        :func:`~gym_ray.plan._validate_pass.count_valid_rows` gives over the whole file, for
        :meth:`~gym_ray.plan._spill_dedupe.SpillDedupe.adopt_range`). None when the pass does not apply
        (small file, ``limit``, knobs that rewrite rows, a daemon process, one CPU) or a range process
        failed unexpectedly; the caller then validates in one process.

    Raises:
        RowsInvalid: Some range holds a row that does not validate.
        GymRayError: What reading or preprocessing the first range raises (in this process).
    """
    ranges = _planned_ranges(settings, topology)
    if not ranges:
        return None
    ctx = multiprocessing.get_context("spawn")
    children: list[tuple[Any, Connection]] = []
    where = tempfile.mkdtemp(prefix="ranges-", dir=folder)
    first, *rest = ranges
    # plain data for the processes
    job = RangeJob(
        str(settings.input_jsonl_fpath),
        *first,
        preprocess_knobs(settings),
        settings.strict_json,
        topology,
        where,
        "range-0000",
    )
    finished = False
    try:
        for k, (start, end) in enumerate(rest, start=1):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=range_child,  # a module that imports neither pydantic nor the settings
                args=(sender, job._replace(start=start, end=end, name=f"range-{k:04d}")),
                name=f"gym_ray-validate-range-{k}",
                daemon=True,
            )
            children.append((proc, receiver))
            try:
                with main_script_not_rerun():  # in a Ray actor the main script would import Ray again
                    proc.start()
            finally:
                sender.close()
        results = [count_range(job, stop)]
        for child, receiver in children:
            try:
                kind, outcome = receiver.recv()
            except EOFError:
                kind, outcome = "error", f"the process (pid {child.pid}) ended without an answer"
            if kind == "invalid":
                raise RowsInvalid(outcome)
            if kind != "ok":  # the same result comes from one process, later: say why it is later
                detail = str(outcome).strip().splitlines()[-1:] or ["no detail"]
                logger.warning("planning: a range process failed (%s); validating in one process", detail[0])
                return None
            results.append(outcome)
        finished = True
    finally:
        for proc, receiver in children:
            if proc.pid is not None:  # started
                if not finished:
                    proc.terminate()  # its range no longer matters
                proc.join()
            receiver.close()
        if not finished:
            shutil.rmtree(where, ignore_errors=True)
    return [
        (count, RecordedPart([Path(run) for run in runs], Path(digests), lookups))
        for count, runs, digests, lookups in results
    ]
