"""A run folder's state as a fact on disk (``run_state.json``): running, stopped (how, when) or finished.

The process that holds the folder's run lock (:func:`gym_ray.record.run_lock.holding_run_folder`) writes
this file: ``running`` once it holds the lock and its checks passed, then, as the run leaves the block,
``stopped`` with the cause (``sigterm``, ``ctrl-c``, ``cancelled`` by the calling program,
``server-outage``, ``error``) or ``finished`` (``complete`` true or false, as the run summary says). Each
write replaces the file atomically (temp file, fsync, rename, fsync of the folder).

The file alone cannot tell a live run from a dead one: a run killed by SIGKILL, the out-of-memory killer
or a lost node never writes its end. The lock can: the kernel releases a dead holder's ``flock``.
:func:`observe_state` reads both, without taking the lock for longer than a probe or writing anything:

====================  ==================  =========================================================
the run lock          the file says       state
====================  ==================  =========================================================
held by a run         anything            ``running`` (the holder's pid, host and start)
free                  ``running``         ``stopped`` by ``killed``: the holder died without a word
free                  stopped / finished  as written
free                  nothing             ``unknown`` (an older gym_ray, or a helper's recording)
====================  ==================  =========================================================

A stop by a signal is told apart from a program's cancellation by :func:`note_stop_signal`, which the
blocking entry points' signal handlers call (:func:`gym_ray.run.signals.run_until_signal`).
Accepted trade-off: on a file system whose ``flock`` does not reach other hosts (NFS without lock
support), a run live on another host looks ``killed`` from here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from gym_ray.record.atomic import atomic_write_bytes

__all__ = [
    "RUN_STATE_FILE",
    "ObservedState",
    "RunState",
    "describe_state",
    "note_stop_signal",
    "noted_stop_signal",
    "observe_state",
    "read_state",
    "running_state",
    "write_state",
]

#: The state file's name inside a run folder.
RUN_STATE_FILE = "run_state.json"

StateName = Literal["running", "stopped", "finished"]
#: How a run stopped, as the run itself wrote it (``killed`` is only ever observed, never written).
StopCause = Literal["sigterm", "ctrl-c", "cancelled", "server-outage", "error"]


class RunState(BaseModel):
    """The content of ``run_state.json``.

    ``started_at`` / ``ended_at`` are epoch seconds; ``stopped_by`` is set for ``stopped``, ``complete``
    for ``finished``; ``detail`` is one line (the server of an outage, the error's type and message).
    """

    model_config = ConfigDict(frozen=True)

    format_version: int = 1
    state: StateName
    what: str
    pid: int
    host: str
    started_at: float
    ended_at: float | None = None
    stopped_by: StopCause | None = None
    detail: str | None = None
    complete: bool | None = None


def running_state(what: str, *, clock: Any = time.time) -> RunState:
    """The state a run writes once it holds its folder: ``running``, this process, now."""
    host = socket.gethostname()
    return RunState(state="running", what=what, pid=os.getpid(), host=host, started_at=clock())


def write_state(run_dir: str | os.PathLike[str], state: RunState) -> None:
    """Replace the folder's state file atomically.

    Raises:
        OSError: The file could not be written (the caller decides whether that matters).
    """
    body = state.model_dump_json(indent=2, exclude_none=False) + "\n"
    atomic_write_bytes(Path(run_dir) / RUN_STATE_FILE, body.encode())


def read_state(run_dir: str | os.PathLike[str]) -> RunState | None:
    """The folder's state file, or None when it is missing or unreadable (never raises)."""
    try:
        raw = json.loads((Path(run_dir) / RUN_STATE_FILE).read_text(encoding="utf-8"))
        return RunState.model_validate(raw)
    except (OSError, ValueError, ValidationError):
        return None


# --- the signal that stopped this process's run -----------------------------------------------------

_noted_signal: str | None = None


def note_stop_signal(name: str | None) -> None:
    """Note that ``name`` (``"SIGTERM"`` or ``"SIGINT"``) is stopping this process's run; None forgets it.

    Called by the signal handlers of :func:`gym_ray.run.signals.run_until_signal` (and with None when a
    run takes its folder), so that a run cancelled by a signal records ``sigterm`` / ``ctrl-c`` instead of
    ``cancelled``.
    """
    global _noted_signal
    _noted_signal = name


def noted_stop_signal() -> str | None:
    """The signal :func:`note_stop_signal` noted last, or None."""
    return _noted_signal


# --- observing ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObservedState:
    """A folder's state as :func:`observe_state` sees it from outside the run.

    Attributes:
        state: ``running``, ``stopped``, ``finished`` or ``unknown``.
        stopped_by: For ``stopped``: ``sigterm``, ``ctrl-c``, ``cancelled``, ``server-outage``,
            ``error`` or ``killed`` (the lock is free but the file still says running).
        at: Epoch seconds: the start of a running run, the end of a stopped or finished one; None for a
            killed run (the caller knows its last sign of life: the last progress update).
        holder: ``"collect pid 12 on host h, started ..."`` while a process holds the lock.
        detail: The written detail (outage server, error), or what ``killed`` means.
        complete: For ``finished``: whether the run summary called it complete.
        recorded: The state file's content, when there is one.
    """

    state: Literal["running", "stopped", "finished", "unknown"]
    stopped_by: str | None
    at: float | None
    holder: str | None
    detail: str | None
    complete: bool | None
    recorded: RunState | None


_KILLED = (
    "the run's process ended without recording how (SIGKILL, the out-of-memory killer, or its node lost)"
)
_NO_LOCK = (
    "a folder on an object store has no lock to tell; the records are as of each shard's last publication"
)


def observe_state(
    run_dir: str | os.PathLike[str],
    holder: dict[str, Any] | None,
    *,
    holder_text: str | None = None,
    lock: bool = True,
) -> ObservedState:
    """The state of ``run_dir``: its state file read together with the probe of its run lock.

    Args:
        run_dir: The run folder.
        holder: What :func:`gym_ray.record.run_lock.lock_holder` found: the lock holder's description
            (``what``, ``pid``, ``host``, ``started_at``), or None when nobody holds the lock.
        holder_text: The holder as one phrase (:func:`gym_ray.record.run_lock.describe_holder`).

    A holder whose ``what`` is ``aggregate`` is not a run: the state is then the file's. ``lock=False``: the
    folder has no lock to probe (a copy of a folder on an object store), so a recorded ``running`` is
    ``unknown``: running or killed.
    """
    recorded = read_state(run_dir)
    if holder is not None and holder.get("what") != "aggregate":
        started = recorded.started_at if recorded is not None and recorded.state == "running" else None
        return ObservedState("running", None, started, holder_text, None, None, recorded)
    held = holder_text if holder is not None else None
    if recorded is None:
        return ObservedState("unknown", None, None, held, None, None, None)
    if recorded.state == "running" and not lock:
        return ObservedState("unknown", None, None, None, _NO_LOCK, None, recorded)
    if recorded.state == "running":
        return ObservedState("stopped", "killed", None, held, _KILLED, None, recorded)
    return ObservedState(
        recorded.state,
        recorded.stopped_by,
        recorded.ended_at,
        held,
        recorded.detail,
        recorded.complete,
        recorded,
    )


def _stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + " UTC"


_CAUSES = {
    "sigterm": "stopped by SIGTERM",
    "ctrl-c": "stopped by Ctrl-C",
    "cancelled": "stopped: the calling program cancelled it",
    "server-outage": "stopped by a server outage",
    "error": "stopped by an error",
}


def describe_state(observed: ObservedState, *, last_update: float | None = None) -> str:
    """The one line ``gym-ray status`` prints first: ``state: ...``.

    ``last_update``: the run's last progress update (epoch seconds), shown for a killed run.
    """
    if observed.state == "running":
        return f"state: running ({observed.holder})"
    if observed.state == "unknown" and observed.recorded is None:
        return (
            f"state: unknown (no {RUN_STATE_FILE}: the folder was written by an older gym_ray, a stream's "
            "record_dir or the helper's recording)"
        )
    recorded = observed.recorded
    assert recorded is not None
    who = f"{recorded.what} pid {recorded.pid} on host {recorded.host}, started {_stamp(recorded.started_at)}"
    if observed.state == "unknown":  # recorded as running, with no lock to tell (lock=False)
        return f"state: running or killed ({who}): {observed.detail}"
    if observed.stopped_by == "killed":
        seen = f"; last update {_stamp(last_update)}" if last_update is not None else ""
        return f"state: stopped: killed ({who}): {_KILLED}{seen}"
    when = f" at {_stamp(observed.at)}" if observed.at is not None else ""
    if observed.state == "finished":
        outcome = {True: "complete", False: "incomplete", None: "outcome not recorded"}[observed.complete]
        return f"state: finished{when}, {outcome} ({who})"
    cause = _CAUSES.get(observed.stopped_by or "", "stopped")
    detail = f": {observed.detail}" if observed.detail else ""
    return f"state: {cause}{when} ({who}){detail}"
