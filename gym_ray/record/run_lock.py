"""One run per folder: the run-level lock.

A collection (``collect`` / ``acollect`` / ``acollect_local``) and a recording stream take this lock on
their run folder before they plan or send anything, and hold it until they end. A second run on the same
folder is refused at once with :class:`~gym_ray.errors.RunLockError` naming the holder (pid, host, start
time), so no ``/run`` is ever executed by two concurrent runs of one folder.

Durability and liveness promises:

- The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<run folder>/.gym_ray_run.lock``. The kernel releases it
  when the holder's process dies (``kill -9`` included): a crashed run never blocks its resume.
- The file holds the current holder's description (JSON: pid, host, started_at), rewritten by each new
  holder; it is not unlinked (unlinking a lock file lets two processes lock two different inodes), with
  one exception: a run that created the folder and wrote nothing else into it (its input was refused)
  removes the file, the folder and the parent folders it created, still holding the lock, so bad input
  leaves no output behind. A run
  racing to start on that same fresh folder then fails on the missing folder, never writes twice.
- A lock is per open file: a second run in the same process is refused like one in another process.
- :func:`lock_holder` tells whether a process holds the lock without waiting for it (a non-blocking shared
  ``flock`` taken and dropped at once); :meth:`RunLock.acquire` tries a few times over ~50 ms before it
  refuses, so such a probe (``gym-ray status``) never makes a starting run fail.
- :func:`holding_run_folder` also keeps the folder's state file (:mod:`gym_ray.record.run_state`) and
  run record (:mod:`gym_ray.record.run_record`): written once the lock is held, the state finished as
  the run leaves; when the run ends before anything was planned (no ``run_manifest.json``: its input was
  refused, or it was stopped while validating), both files are put back as they were, so a refused run
  leaves the folder as it found it (but the lock file's holder description).

Accepted trade-off: ``flock`` is only as good as the file system's locking; on an NFS mount without lock
support two hosts are not kept apart (local disks, Lustre/GPFS with flock enabled are).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from gym_ray.errors import (
    AggregationError,
    IncompleteRunError,
    RecordError,
    ResumeError,
    RunLockError,
    RunRejectedError,
    RunTerminated,
    ServerOutageError,
)
from gym_ray.record.atomic import atomic_write_bytes
from gym_ray.record.outage_note import clear_outage, write_outage
from gym_ray.record.run_state import (
    RUN_STATE_FILE,
    RunState,
    note_stop_signal,
    noted_stop_signal,
    running_state,
    write_state,
)

__all__ = [
    "RUN_LOCK_FILE",
    "RunFolder",
    "RunLock",
    "describe_holder",
    "holding_run_folder",
    "lock_holder",
    "refuse_if_held",
    "sweep_leftovers",
]

logger = logging.getLogger("gym_ray.record.run_lock")

#: The lock file's name inside a run folder.
RUN_LOCK_FILE = ".gym_ray_run.lock"
#: The run record's name (:mod:`gym_ray.record.run_record` owns its content).
RUN_RECORD_FILE = "gym_ray_run.json"
#: The run manifest's name (:mod:`gym_ray.plan.run_manifest`): its presence means the run planned.
_RUN_MANIFEST = "run_manifest.json"
#: Tries of a refused ``flock`` before a run is refused, and the pause between two (a status probe
#: holds the lock for microseconds).
_LOCK_TRIES = 3
_LOCK_RETRY_S = 0.025


class RunLock:
    """The exclusive lock of one run folder (a context manager; also :meth:`acquire` / :meth:`release`).

    Example:
        >>> with RunLock("runs/r1", what="collect"):
        ...     ...  # plan, dispatch, finalize

    Args:
        run_dir: The run folder (created when missing).
        what: What holds the lock (``"collect"``, ``"stream"``), written for the error of a refused run.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, what: str = "run") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RUN_LOCK_FILE
        self._what = what
        self._fd: int | None = None
        self._created: list[Path] = []  # the folders acquire() made: run_dir first, then its new parents

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock or refuse at once.

        Raises:
            RunLockError: Another run holds the folder (the message names its pid, host and start time).
            RecordError: The folder or lock file cannot be created.
            RuntimeError: This object already holds the lock.
        """
        if self._fd is not None:
            raise RuntimeError(f"this RunLock already holds {self.path}")
        try:
            self._created = _missing_folders(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RecordError(
                f"cannot create the run lock {self.path} ({exc.strerror or exc}); check the output_dir "
                "path and its permissions"
            ) from exc
        try:
            _flock_with_retries(fd)
        except BlockingIOError:
            holder = describe_holder(_holder_info(fd))
            os.close(fd)
            raise _busy(self.run_dir, self.path, holder) from None
        except OSError as exc:
            os.close(fd)
            raise RecordError(f"cannot lock {self.path} ({exc.strerror or exc})") from exc
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": started, "what": self._what}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError:
            pass  # the description is a courtesy; the flock is the lock
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the file stays). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if self._created:
                    self._remove_if_untouched()
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _remove_if_untouched(self) -> None:
        try:
            if os.listdir(self.run_dir) == [RUN_LOCK_FILE]:
                self.path.unlink()
                for folder in self._created:  # the parents this run made too, while they are empty
                    folder.rmdir()
        except OSError:
            pass  # a file appeared meanwhile, or the folder is not ours to remove: keep everything

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _missing_folders(run_dir: Path) -> list[Path]:
    """``run_dir`` and its parents that do not exist yet, innermost first."""
    missing = []
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


# Temp names gym_ray makes in a run folder: planning's staging folders, aggregation spools, merge folders,
# control journals, atomic-write temp files and quarantine rewrites. Only dot-names: nothing a user would
# name a file.
_LEFTOVER = re.compile(r"^\.(staging-|aggregate-|merge-|control$)|^\..+\.(tmp|repair)-[0-9a-f]+$")


def sweep_leftovers(run_dir: str | os.PathLike[str]) -> list[str]:
    """Remove the temp folders and files a killed run left in ``run_dir``; return their names, sorted.

    Call it only while holding the folder's :class:`RunLock` (at the start of a run): the temp files of
    a live run would be removed too. Removes ``.staging-*``, ``.aggregate-*``, ``.merge-*``, ``.control``
    (the control actors' journals of a killed run call, :mod:`gym_ray.distributed.journal`) and the
    ``.<name>.tmp-<hex>`` / ``.<name>.repair-<hex>`` files of interrupted atomic writes; nothing else.
    """
    root = Path(run_dir)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        if not _LEFTOVER.match(name):
            continue
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(name)
    if removed:
        logger.info(
            "removed %d leftover temp entries of an interrupted run in %s: %s",
            len(removed),
            root,
            ", ".join(removed[:10]),
        )
    return removed


def _flock_with_retries(fd: int) -> None:
    for attempt in range(_LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == _LOCK_TRIES - 1:
                raise
            time.sleep(_LOCK_RETRY_S)


def _busy(run_dir: Path, path: Path, holder: str) -> RunLockError:
    return RunLockError(
        f"the run folder {run_dir} is in use by another run ({holder}); wait for it to end or "
        "stop it, or pick another output_dir (the lock is released when its process exits)",
        path=str(path),
        holder=holder,
    )


def _holder_info(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def describe_holder(info: Mapping[str, Any]) -> str:
    """The lock holder as the refusal of a second run names it: ``collect pid 12 on host h, started ...``."""
    if not info:
        return "holder unknown"
    return (
        f"{info.get('what', 'run')} pid {info.get('pid')} on host {info.get('host')}, "
        f"started {info.get('started_at')}"
    )


def lock_holder(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The description the holder of ``run_dir``'s lock wrote (``what``, ``pid``, ``host``,
    ``started_at``; ``{}`` when unreadable), or None when no process holds the lock.

    A probe: a non-blocking shared ``flock``, dropped at once; nothing is created or written.
    """
    try:
        fd = os.open(Path(run_dir) / RUN_LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None  # no lock file: no run ever held the folder
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_info(fd)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def refuse_if_held(run_dir: str | os.PathLike[str]) -> None:
    """Refuse at once when a process holds ``run_dir``'s lock, with the message a second run gets.

    Raises:
        RunLockError: The folder is in use (names the holder's pid, host and start time).
    """
    info = lock_holder(run_dir)
    if info is not None:
        raise _busy(Path(run_dir), Path(run_dir) / RUN_LOCK_FILE, describe_holder(info))


class RunFolder:
    """The state file and run record of a folder, kept by :func:`holding_run_folder` for one run.

    The run calls :meth:`finish` with its outcome once it has one; the rest is the context manager's.
    """

    def __init__(self, run_dir: Path, what: str, record: bytes | None) -> None:
        self.run_dir = run_dir
        self._what = what
        self._record = record
        self._before: dict[str, bytes | None] = {}
        self._state: RunState | None = None
        self._complete: bool | None = None

    def finish(self, complete: bool) -> None:
        """Note the run's outcome (the run summary's ``complete``); written as the block ends."""
        self._complete = complete

    def begin(self) -> None:
        """Write ``running`` and the run record (the files' previous bytes are kept to put back).

        Raises:
            RecordError: A file could not be written (the message names it).
        """
        for name in (RUN_STATE_FILE, RUN_RECORD_FILE):
            self._before[name] = _read_bytes(self.run_dir / name)
        self._state = running_state(self._what)
        try:
            write_state(self.run_dir, self._state)
            if self._record is not None:
                atomic_write_bytes(self.run_dir / RUN_RECORD_FILE, self._record)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._put_back()
            raise RecordError(
                f"cannot write the run folder's state in {self.run_dir} ({exc.strerror or exc}); check the "
                "folder's permissions and free space"
            ) from exc

    def end(self, exc: BaseException | None) -> None:
        """Write how the run ended (or put the files back when it planned nothing). Never raises: a
        failure to write is logged, so the run's own error is the one reported."""
        try:
            if not (self.run_dir / _RUN_MANIFEST).exists():
                self._put_back()  # nothing planned: leave the folder as it was
                return
            assert self._state is not None
            write_state(self.run_dir, _ended(self._state, exc, self._complete, self.run_dir))
        except Exception as error:  # a full disk must not replace the run's own outcome
            logger.warning("could not record how the run in %s ended: %s", self.run_dir, error)

    def _put_back(self) -> None:
        for name, before in self._before.items():
            path = self.run_dir / name
            if before is None:
                path.unlink(missing_ok=True)
            elif _read_bytes(path) != before:
                atomic_write_bytes(path, before)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _summary_complete(run_dir: Path) -> bool | None:
    try:
        value = json.loads((run_dir / "rollouts_summary.json").read_text(encoding="utf-8")).get("complete")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def _ended(state: RunState, exc: BaseException | None, complete: bool | None, run_dir: Path) -> RunState:
    """The state a run leaves: finished (its outcome) or stopped (the cause and a one-line detail)."""
    now = time.time()
    if exc is None or isinstance(exc, AggregationError):
        # finished; an aggregation error is raised after the summary is written
        done = complete if complete is not None else _summary_complete(run_dir)
        return state.model_copy(update={"state": "finished", "ended_at": now, "complete": done})
    if isinstance(exc, IncompleteRunError | RunRejectedError):
        return state.model_copy(update={"state": "finished", "ended_at": now, "complete": False})
    detail: str | None = None
    if isinstance(exc, RunTerminated):
        cause = "sigterm"
    elif isinstance(exc, KeyboardInterrupt):
        cause = "ctrl-c"
    elif isinstance(exc, asyncio.CancelledError):
        cause = {"SIGTERM": "sigterm", "SIGINT": "ctrl-c"}.get(noted_stop_signal() or "", "cancelled")
    elif isinstance(exc, ServerOutageError):
        cause = "server-outage"
        detail = f"environment server {exc.server!r} ({exc.url}) was down for {exc.down_s:.0f} s"
    else:
        cause = "error"
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
    ended = {"state": "stopped", "ended_at": now, "stopped_by": cause, "detail": detail}
    return state.model_copy(update=ended)


@contextlib.contextmanager
def holding_run_folder(
    run_dir: str | os.PathLike[str],
    *,
    what: str,
    record: bytes | None = None,
    expect: Mapping[str, bytes | None] | None = None,
) -> Iterator[RunFolder]:
    """Hold ``run_dir`` for one collection: its run lock, a sweep of a killed run's temp folders, its
    state file and run record, and the outage note (written when a
    :class:`~gym_ray.errors.ServerOutageError` leaves the block, removed when the block completes).

    Args:
        run_dir: The run folder.
        what: What holds it (``"collect"``).
        record: The run record's bytes (:func:`gym_ray.record.run_record.encode_record`), written once the
            lock is held; None writes none.
        expect: File name -> the bytes (None: absent) the caller's checks read before taking the lock;
            a file that differs once the lock is held means another run used the folder meanwhile.

    Yields:
        The :class:`RunFolder`; call its :meth:`~RunFolder.finish` with the run's outcome.

    Raises:
        RunLockError: Another run holds the folder (at entry, before anything is planned or sent).
        ResumeError: A file of ``expect`` changed before the lock was taken (nothing written).
    """
    root = Path(run_dir)
    with RunLock(root, what=what):
        for name, before in (expect or {}).items():
            if _read_bytes(root / name) != before:
                raise ResumeError(
                    f"the run folder {root} changed while this command checked it ({name}: another run used "
                    "the folder meanwhile); run the command again"
                )
        sweep_leftovers(root)  # temp folders of a killed run on this folder
        note_stop_signal(None)
        folder = RunFolder(root, what, record)
        folder.begin()
        try:
            yield folder
        except BaseException as exc:
            folder.end(exc)
            if isinstance(exc, ServerOutageError):
                write_outage(root, exc)  # for `status`: why the run is unfinished
            raise
        folder.end(None)
        clear_outage(root)
