"""Aggregation work done while the run goes on: the merged prefix's rows grouped into the per-server spools.

Before ``/aggregate_metrics`` is called, every success of the merged file is read, stripped and spooled to
its environment server's spool (:func:`~gym_ray.finalize._aggregate_read.group_merged`, about 9 us of CPU
per rollout). The merged output grows as a prefix while the run goes on (:mod:`gym_ray.finalize.merge_ahead`),
so the coordinator groups each part of the prefix as soon as it is appended (:meth:`AggregationAhead.feed`,
after each prefix step, in the same thread); at the end, :func:`~gym_ray.finalize.aggregate.aggregate_run`
takes the grouping over (:func:`claim`) and groups only the bytes the final merge appended.

It is used only when the merged file *is* the prefix it read: the final merge renames the prefix file into
place (same device and inode) when the prefix holds, and the bytes it read lie before the size the prefix's
record vouched for (the merge only cuts bytes past that size and appends). Otherwise (a cold merge, a
prefix that stopped, a read error) it is dropped and the aggregate reads the whole merged file, as without
it. The rows are numbered as one read of the merged file numbers them, so errors name the same rows, and
the bodies sent are the same bytes.

The spools are files in a private folder of the run folder (``.aggregate-*``, swept at the next start if
the process dies); the state is this process's (the coordinator actor's): a restarted coordinator starts
over from the prefix's first byte, and ``gym-ray aggregate`` in another process reads the merged file.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from gym_ray.errors import InternalError
from gym_ray.finalize._aggregate_read import ReadSoFar, group_more
from gym_ray.finalize._aggregate_spool import Grouping, ServerSpools
from gym_ray.finalize.merge_ahead import prefix_output

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["AggregationAhead", "claim", "register"]

#: The grouping carried on by this process's coordinator, by run folder (see :func:`claim`).
_BY_RUN: dict[str, AggregationAhead] = {}


def _key(run_dir: str | os.PathLike[str]) -> str:
    return os.path.realpath(run_dir)


def register(run_dir: str | os.PathLike[str], ahead: AggregationAhead) -> None:
    """Offer ``ahead`` to this process's next aggregate of ``run_dir``."""
    _BY_RUN[_key(run_dir)] = ahead


def claim(run_dir: str | os.PathLike[str]) -> AggregationAhead | None:
    """Take the grouping offered for ``run_dir`` (the caller uses or drops it), if any."""
    return _BY_RUN.pop(_key(run_dir), None)


class AggregationAhead:
    """The prefix's rows grouped so far, and where in the prefix file it stopped.

    Args:
        run_dir: The run folder (its prefix output, and where the spools go).
        topology: The run's topology (the aggregate of the run uses the same).
    """

    def __init__(self, run_dir: str | os.PathLike[str], topology: Topology) -> None:
        self._run_dir = Path(run_dir)
        self._topology = topology
        self._spools: ServerSpools | None = None
        self._grouping: Grouping | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the prefix file read
        self._consumed = 0
        self._read = ReadSoFar()
        self._broken = False

    @property
    def rows_grouped(self) -> int:
        """Records of the prefix grouped so far."""
        return 0 if self._grouping is None else self._grouping.positions

    def feed(self) -> None:
        """Group what the prefix gained since the last call (blocking I/O; never raises: a problem drops
        the work done, and the aggregate then reads the merged file)."""
        if self._broken:
            return
        prefix = prefix_output(self._run_dir)
        if prefix is None:
            return
        path, size = prefix
        try:
            st = path.stat()
            if self._file is not None and self._file != (st.st_dev, st.st_ino):
                raise OSError(f"{path} was replaced")
            self._file = (st.st_dev, st.st_ino)
            if size > self._consumed:
                self._group(path, size, threading.Event())
        except Exception as exc:
            logger.info("aggregation ahead of the run's end stopped: %s: %s", type(exc).__name__, exc)
            self.discard()
            self._broken = True

    def _group(self, path: Path, end: int | None, stop: threading.Event) -> None:
        if self._grouping is None:
            self._spools = ServerSpools(self._run_dir)
            self._grouping = Grouping(self._topology, self._spools, stop)
        self._grouping.watch(stop)
        group_more(self._grouping, path, self._consumed, end, self._read)
        if end is not None and not self._read.ended:
            raise OSError(f"{path}: the prefix ends inside a line")
        self._consumed = end if end is not None else path.stat().st_size

    def covers(self, merged: Path) -> bool:
        """Whether ``merged`` is the prefix file this grouping read (renamed into place, grown after it)."""
        if self._broken or self._file is None or self._grouping is None:
            return False
        try:
            st = merged.stat()
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._file and st.st_size >= self._consumed

    def finish(self, merged: Path, stop: threading.Event) -> Grouping:
        """Group the rest of ``merged`` (after what :meth:`feed` read) and finish the spools; only after
        :meth:`covers` said yes.

        Raises:
            As :func:`~gym_ray.finalize._aggregate_read.group_merged`.
        """
        if self._grouping is None or self._spools is None:
            raise InternalError("AggregationAhead.finish() without the grouping covers() vouched for")
        self._group(merged, None, stop)
        self._spools.finish()
        self._grouping.raise_problems()
        return self._grouping

    @property
    def spools(self) -> ServerSpools | None:
        """The spools the grouping wrote."""
        return self._spools

    def discard(self) -> None:
        """Remove the spools (the work is not used)."""
        spools, self._spools, self._grouping = self._spools, None, None
        if spools is not None:
            spools.remove()
