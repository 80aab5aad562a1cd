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
  removes the file and the folder, still holding the lock, so bad input leaves no output behind. A run
  racing to start on that same fresh folder then fails on the missing folder, never writes twice.
- A lock is per open file: a second run in the same process is refused like one in another process.

Accepted trade-off: ``flock`` is only as good as the file system's locking; on an NFS mount without lock
support two hosts are not kept apart (local disks, Lustre/GPFS with flock enabled are).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from gym_ray.errors import RecordError, RunLockError, ServerOutageError
from gym_ray.record.outage_note import clear_outage, write_outage

__all__ = ["RUN_LOCK_FILE", "RunLock", "holding_run_folder", "sweep_leftovers"]

logger = logging.getLogger("gym_ray.record.run_lock")

#: The lock file's name inside a run folder.
RUN_LOCK_FILE = ".gym_ray_run.lock"


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
        self._created_dir = False

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
            self._created_dir = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RecordError(
                f"cannot create the run lock {self.path} ({exc.strerror or exc}); check the output_dir "
                "path and its permissions"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockError(
                f"the run folder {self.run_dir} is in use by another run ({holder}); wait for it to end or "
                "stop it, or pick another output_dir (the lock is released when its process exits)",
                path=str(self.path),
                holder=holder,
            ) from None
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
                if self._created_dir:
                    self._remove_if_untouched()
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _remove_if_untouched(self) -> None:
        try:
            if os.listdir(self.run_dir) == [RUN_LOCK_FILE]:
                self.path.unlink()
                self.run_dir.rmdir()
        except OSError:
            pass  # a file appeared meanwhile, or the folder is not ours to remove: keep everything

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


# Temp names gym_ray makes in a run folder: planning's staging folders, aggregation spools, merge folders,
# atomic-write temp files and quarantine rewrites. Only dot-names: nothing a user would name a file.
_LEFTOVER = re.compile(r"^\.(staging-|aggregate-|merge-)|^\..+\.(tmp|repair)-[0-9a-f]+$")


def sweep_leftovers(run_dir: str | os.PathLike[str]) -> list[str]:
    """Remove the temp folders and files a killed run left in ``run_dir``; return their names, sorted.

    Call it only while holding the folder's :class:`RunLock` (at the start of a run): the temp files of
    a live run would be removed too. Removes ``.staging-*``, ``.aggregate-*``, ``.merge-*`` and the
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


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8"))
        return (
            f"{info.get('what', 'run')} pid {info.get('pid')} on host {info.get('host')}, "
            f"started {info.get('started_at')}"
        )
    except (OSError, ValueError, AttributeError):
        return "holder unknown"


@contextlib.contextmanager
def holding_run_folder(run_dir: str | os.PathLike[str], *, what: str) -> Iterator[None]:
    """Hold ``run_dir`` for one collection: its run lock, a sweep of a killed run's temp folders, and the
    outage note (written when a :class:`~gym_ray.errors.ServerOutageError` leaves the block, removed when
    the block completes).

    Raises:
        RunLockError: Another run holds the folder (at entry, before anything is planned or sent).
    """
    with RunLock(run_dir, what=what):
        sweep_leftovers(run_dir)  # temp folders of a killed run on this folder
        try:
            yield
        except ServerOutageError as exc:
            write_outage(run_dir, exc)  # for `status`: why the run is unfinished
            raise
        clear_outage(run_dir)
