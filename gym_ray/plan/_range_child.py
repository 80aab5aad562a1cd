"""One byte range of planning's parallel validation pass, in a process that imports only what it needs.

:mod:`gym_ray.plan._parallel_pass` validates the first range of a large input file itself and spawns a
process per other range, whose target is :func:`range_child` here. A spawned process imports its target's
module before it runs: this one reads the file and numbers and checks rows
(:func:`gym_ray.plan._valid_lines.count_lines`) and takes the run's settings as plain data (the
preprocessing knobs and ``strict_json``), so it does not import the settings' model (pydantic, omegaconf:
about 0.4 s of CPU per process), only the topology (picklable, rebuilt from its raw config).
"""

from __future__ import annotations

import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from gym_ray.config.topology import Topology
from gym_ray.errors import GymRayError, InternalError
from gym_ray.plan._spill_dedupe import RangeRecorder
from gym_ray.plan._valid_lines import count_lines
from gym_ray.plan._validate_pass import RowsInvalid

__all__ = ["RangeJob", "count_range", "range_child"]


class RangeJob(NamedTuple):
    """One byte range to validate, as plain picklable data: bytes ``[start, end)`` of the input file
    ``path``, with the run's preprocessing ``knobs`` (:func:`~gym_ray.plan._validate_pass.preprocess_knobs`),
    ``strict_json`` and topology; its files go under ``folder``, named from ``name``."""

    path: str
    start: int
    end: int
    knobs: dict[str, Any]
    strict_json: bool
    topology: Topology
    folder: str
    name: str


def count_range(job: RangeJob, stop: threading.Event | None = None) -> tuple[int, list[str], str, int]:
    """``(rows planned, sorted run files, digests file, lookups)`` of ``job``'s range, validated by
    :func:`~gym_ray.plan._valid_lines.count_lines`.

    Raises:
        RowsInvalid: A row of the range does not validate.
        GymRayError: What reading or preprocessing the range raises.
        InternalError: A knob rewrites rows (the caller checked that none does).
    """
    recorder = RangeRecorder(Path(job.folder), job.name)
    try:
        count = count_lines(
            job.path,
            job.knobs,
            job.strict_json,
            job.topology,
            recorder,
            span=(job.start, job.end),
            wrap_read=recorder.chunk_log(job.start, job.end),
            stop=stop,
        )
        runs, digests, lookups = recorder.finish()
    finally:
        recorder.close()
    if count is None:
        raise InternalError("the common-row validation pass does not apply to these settings")
    return count, [str(run) for run in runs], str(digests), lookups


def range_child(conn: Connection, job: RangeJob) -> None:
    """Body of a range process: validate ``job``'s range (:func:`count_range`), send ``(kind, result or
    detail)``: ``("ok", result)``, ``("invalid", where and why)`` or ``("error", traceback)``."""
    try:
        try:
            conn.send(("ok", count_range(job)))
        except (RowsInvalid, GymRayError) as exc:
            conn.send(("invalid", f"bytes {job.start}-{job.end}: {exc}"))
        except Exception:  # anything else: the parent validates in one process
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
