"""Identical-row dedupe over two passes, in memory that does not grow with the input.

Preprocessing gives identical rows one task index (PROTOCOL.md section 4): a row's task index is the
position of its content digest among the distinct digests seen so far. The one-pass form,
:class:`~gym_ray.plan._compact_index.CompactIndex`, keeps every distinct digest in memory (17-25
bytes per task). Planning a run reads the input twice anyway (a validation pass, then the pass that cuts
shards), and this module uses the first pass to find the duplicates on disk:

1. Pass 1 (:meth:`SpillDedupe.add` through :attr:`SpillDedupe.recorder`): each digest lookup gets an
   *ordinal* (0, 1, 2, ... in call order). ``(digest, ordinal)`` goes into sorted runs spilled to files of
   ``chunk`` records. The value handed back is the ordinal, a stand-in: pass 1 only validates.
2. Between passes (:meth:`SpillDedupe.replay`): a merge of the runs groups equal digests. For each digest
   seen more than once it emits events keyed by ordinal: the first ordinal is a *source*, later ones are
   *duplicates* of it (the last one flagged, so its source can be forgotten). The events are sorted by
   ordinal (spilling again when there are many).
3. Pass 2 (:class:`DedupeReplay`): lookups arrive in the same order. An ordinal without an event is a new
   task (the next index); a source is a new task whose index is kept until its last duplicate; a duplicate
   takes its source's index. This is exactly what the one-pass table computes.

Memory: ``chunk`` buffered records (~50 bytes each) in pass 1; in pass 2, one read buffer per run file
plus the indices of sources whose duplicates are still ahead, so it grows only with duplicated rows, never
with distinct ones. Disk: 16 bytes per lookup in a private temporary folder, removed on :meth:`close`; a
folder left by a planner that was killed (SIGKILL, out of memory, a lost node's preemption) is removed by
the next dedupe started on the same host (:func:`reclaim_stale_folders`).

Safety: pass 2 must see the lookups pass 1 saw. A running BLAKE2b over the digest sequence is compared at
:meth:`DedupeReplay.finish`; a longer or different second pass raises :class:`InputError` (the input
changed between the passes). When pass 1 read an input file and logged a hash of every chunk it read
(:meth:`RangeRecorder.chunk_log`, :mod:`gym_ray.plan._input_chunks`), pass 2 proves it reads the same
bytes instead (:meth:`SpillDedupe.chunk_check`) and numbers by order alone
(:meth:`DedupeReplay.trust_bytes`): no digest is taken again. Nothing here is thread-safe.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import operator
import os
import shutil
import socket
import sys
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from gym_ray.errors import InputError, InternalError
from gym_ray.plan._input_chunks import CHANGED, ChunkCheck, ChunkLog, Read, chunks_path
from gym_ray.plan._line_flags import LineFlags, flags_path

__all__ = [
    "DedupeReplay",
    "RangeRecorder",
    "RecordedPart",
    "SpillDedupe",
    "owned_folder",
    "reclaim_stale_folders",
]

_ORDINAL_BITS = 40  # a trillion lookups per pass
_ORDINAL_MASK = (1 << _ORDINAL_BITS) - 1
_U64_MASK = (1 << 64) - 1
_SOURCE, _DUPLICATE, _LAST_DUPLICATE = 0, 1, 2
_READ_BLOCK = 1024  # records read per run file at a time (16 KiB)
_FAN_IN = 64  # run files merged at once: bounds open files and read buffers (1 MiB)
_CHANGED = CHANGED


def _u64_typecode() -> str:
    return next(code for code in "LQ" if array(code).itemsize == 8)


_U64 = _u64_typecode()


class _Spiller:
    """An external sort of non-negative ints below 2**128: buffer, spill sorted runs, merge on read."""

    def __init__(self, folder: Path, name: str, chunk: int) -> None:
        self._folder, self._name, self._chunk = folder, name, chunk
        self._buffer: list[int] = []
        self._runs: list[tuple[Path, int]] = []  # sorted run files, each with what its values are off by
        self._written = 0

    def add(self, value: int) -> None:
        self._buffer.append(value)
        if len(self._buffer) >= self._chunk:
            self._spill()

    def add_many(self, values: list[int]) -> None:
        """:meth:`add` each of ``values``, in order (a sorted run is written once ``chunk`` are buffered)."""
        self._buffer += values
        if len(self._buffer) >= self._chunk:
            self._spill()

    def _spill(self) -> None:
        self._buffer.sort()
        self._runs.append((self._write_run([self._buffer]), 0))
        self._buffer = []

    def spilled(self) -> list[Path]:
        """Spill what is buffered; every run file written (this spiller is done: adopt them elsewhere)."""
        if self._buffer:
            self._spill()
        return [path for path, _offset in self._runs]

    def adopt(self, path: Path, offset: int) -> None:
        """Take a sorted run file written by another spiller; ``offset`` is added to each of its values."""
        self._runs.append((path, offset))

    def _write_run(self, blocks: Iterable[list[int]]) -> Path:
        """A run file of the ascending values of ``blocks`` (both halves of a block's values at once)."""
        path = self._folder / f"{self._name}-{self._written:06d}.run"
        self._written += 1
        with path.open("wb") as out:
            for values in blocks:
                for at in range(0, len(values), _READ_BLOCK):
                    block = values[at : at + _READ_BLOCK]
                    words = array(_U64, bytes(16 * len(block)))
                    words[0::2] = array(_U64, [value >> 64 for value in block])
                    words[1::2] = array(_U64, [value & _U64_MASK for value in block])
                    words.tofile(out)
        return path

    def sorted(self) -> Iterator[int]:
        """Every value added, ascending (duplicates kept). Call once, after the last :meth:`add`."""
        return itertools.chain.from_iterable(self.sorted_blocks())

    def sorted_blocks(self) -> Iterator[list[int]]:
        """Every value added, ascending, as lists whose concatenation is :meth:`sorted`'s sequence (the
        merge takes a block of each run at a time: a C sort of sorted pieces, not a Python step per value).
        Call once, after the last add.

        More than :data:`_FAN_IN` run files are merged in rounds first, :data:`_FAN_IN` at a time into one
        new run file each, so that at most :data:`_FAN_IN` files are open at once.
        """
        if not self._runs:
            values, self._buffer = self._buffer, []
            values.sort()
            if values:
                yield values
            return
        if self._buffer:
            self._spill()
        while len(self._runs) > _FAN_IN:
            group, self._runs = self._runs[:_FAN_IN], self._runs[_FAN_IN:]
            self._runs.append((self._write_run(_merged_blocks([_run_blocks(*run) for run in group])), 0))
            for path, _offset in group:
                path.unlink()
        yield from _merged_blocks([_run_blocks(path, offset) for path, offset in self._runs])


def _run_blocks(path: Path, offset: int = 0) -> Iterator[list[int]]:
    """The values of a run file (each plus ``offset``), a block of :data:`_READ_BLOCK` at a time (16 KiB)."""
    with path.open("rb") as src:
        while True:
            words = array(_U64)
            try:
                words.fromfile(src, 2 * _READ_BLOCK)
            except EOFError:
                pass  # the last, shorter block: fromfile keeps what it read
            if not words:
                return
            if offset:
                yield [
                    ((high << 64) | low) + offset for high, low in zip(words[0::2], words[1::2], strict=True)
                ]
            else:
                yield [(high << 64) | low for high, low in zip(words[0::2], words[1::2], strict=True)]


def _merged_blocks(runs: list[Iterator[list[int]]]) -> Iterator[list[int]]:
    """The ascending merge of sorted ``runs`` (each given as ascending blocks), as ascending blocks.

    Each step takes, from every run, its values up to the smallest last value of the runs' current
    blocks (so at least one whole block), and sorts them together.
    """
    heads: list[tuple[list[int], int, Iterator[list[int]]]] = []  # (block, first value not taken, rest)
    for run in runs:
        block = next(run, None)
        if block:
            heads.append((block, 0, run))
    while heads:
        bound = min(block[-1] for block, _start, _run in heads)
        merged: list[int] = []
        kept: list[tuple[list[int], int, Iterator[list[int]]]] = []
        for block, start, run in heads:
            end = bisect.bisect_right(block, bound, start)
            merged += block[start:end]
            if end < len(block):
                kept.append((block, end, run))
            else:
                following = next(run, None)
                if following:
                    kept.append((following, 0, run))
        heads = kept
        merged.sort()  # sorted pieces: timsort merges them
        yield merged


_PREFIX = "gym_ray-dedupe-"


def _owner_tag() -> str:
    """``PID@HOST``: who owns a dedupe folder (its name starts with ``_PREFIX`` + this + ``-``)."""
    return f"{os.getpid()}@{socket.gethostname()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: a process of another user has this pid
        return True
    return True


def reclaim_stale_folders(parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the dedupe folders under ``parent`` (default: the system's temporary folder) whose
    planner process is gone; return them.

    A folder is removed only when its name says it belongs to this host and its pid is not running here
    (a folder of another host, e.g. on a shared ``TMPDIR``, or without an owner in its name, is left alone;
    a reused pid keeps a dead planner's folder until that pid ends, never the other way round).
    """
    root = Path(parent if parent is not None else tempfile.gettempdir())
    host = socket.gethostname()
    removed: list[Path] = []
    try:
        names = [name for name in os.listdir(root) if name.startswith(_PREFIX)]
    except OSError:
        return removed
    for name in names:
        owner = name[len(_PREFIX) :].rsplit("-", 1)[0]  # mkdtemp's random suffix holds no "-"
        pid, _, owner_host = owner.partition("@")
        if owner_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(root / name, ignore_errors=True)
        removed.append(root / name)
    return removed


def owned_folder(parent: str | os.PathLike[str] | None = None) -> Path:
    """A new temporary folder named for this process (``PID@HOST``), after :func:`reclaim_stale_folders`.

    The caller removes it; if the process is killed first, the next one created on this host does.
    """
    reclaim_stale_folders(parent)
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{_owner_tag()}-", dir=parent))


class SpillDedupe:
    """Pass 1 of the two-pass dedupe, and the owner of its temporary folder.

    Use as a context manager (or call :meth:`close`); the folder goes away on exit.

    Args:
        chunk: Records buffered before a sorted run is written (memory vs. number of run files).
        folder: Where the temporary folder is created (default: the system's, ``TMPDIR`` honoured).
    """

    def __init__(self, *, chunk: int = 1 << 16, folder: str | None = None) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InternalError(f"SpillDedupe chunk must be an int >= 1, got {chunk!r}")
        self._chunk = chunk
        self._folder = owned_folder(folder)
        self._records = _Spiller(self._folder, "digests", chunk)
        self._sequence = hashlib.blake2b(digest_size=16)
        self._ordinals = 0
        self._replayed = False
        self._chunk_files: list[Path] | None = []  # per adopted part; None once a lookup came without
        self._flag_files: list[Path] | None = []  # the same, for the parts' line flags

    def __enter__(self) -> SpillDedupe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the temporary folder (idempotent)."""
        shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def lookups(self) -> int:
        """Digests looked up in pass 1 so far."""
        return self._ordinals

    @property
    def folder(self) -> Path:
        """The temporary folder (a :class:`RangeRecorder` for this dedupe writes under it)."""
        return self._folder

    def adopt_range(self, runs: list[Path], digests: Path, lookups: int) -> None:
        """Take the pass-1 lookups of the next part of the input, recorded by a :class:`RangeRecorder`.

        The same as one :meth:`add` per lookup the recorder saw, in its order (the recorder's ordinals
        are shifted by the lookups made so far). Parts must be adopted in input order.

        Args:
            runs: The recorder's sorted run files (under :attr:`folder`; this dedupe owns them now).
            digests: The recorder's file of digests in lookup order.
            lookups: The recorder's count of lookups.

        Raises:
            InternalError: :meth:`replay` was already called, or the files disagree with ``lookups``.
        """
        if self._replayed:
            raise InternalError("SpillDedupe.adopt_range after replay(): pass 1 is over")
        if digests.stat().st_size != 8 * lookups:
            raise InternalError(f"{digests} holds {digests.stat().st_size} bytes for {lookups} lookups")
        if self._ordinals + lookups - 1 > _ORDINAL_MASK:
            raise InternalError(f"more than 2**{_ORDINAL_BITS} rows in one run")
        with digests.open("rb") as src:
            for block in iter(lambda: src.read(8 * _READ_BLOCK * 64), b""):
                if sys.byteorder != "little":
                    words = array(_U64, block)
                    words.byteswap()
                    block = words.tobytes()
                self._sequence.update(block)
        for path in runs:
            self._records.adopt(path, self._ordinals)
        self._ordinals += lookups
        chunks = chunks_path(digests)
        if self._chunk_files is not None:
            self._chunk_files = [*self._chunk_files, chunks] if chunks.exists() else None
        flags = flags_path(digests)
        if self._flag_files is not None:
            self._flag_files = [*self._flag_files, flags] if flags.exists() else None

    def chunk_check(self) -> ChunkCheck | None:
        """The check that pass 2 reads the bytes pass 1 validated, or None when pass 1 did not log them.

        Not None only when every lookup came from adopted parts, each with its chunk hashes
        (:meth:`RangeRecorder.chunk_log`), together covering the input file from its first byte.
        """
        if not self._chunk_files:
            return None
        return ChunkCheck(self._chunk_files)

    def line_flags(self) -> LineFlags | None:
        """What pass 1 learnt of each input line (:mod:`gym_ray.plan._line_flags`), for a pass 2 that proves
        it reads pass 1's bytes (:meth:`chunk_check`); None unless every part recorded its lines' flags."""
        if not self._flag_files or not self._chunk_files:
            return None
        return LineFlags(self._flag_files)

    def add(self, key: int) -> int:
        """Record one digest lookup of pass 1; return its ordinal (a stand-in for the task index).

        Raises:
            InternalError: ``key`` is not an int in ``[0, 2**64)``, or :meth:`replay` was already called.
        """
        if type(key) is not int or not 0 <= key <= _U64_MASK:
            raise InternalError(f"dedupe keys are ints in [0, 2**64), got {key!r}")
        if self._replayed:
            raise InternalError("SpillDedupe.add after replay(): pass 1 is over")
        ordinal = self._ordinals
        if ordinal > _ORDINAL_MASK:
            raise InternalError(f"more than 2**{_ORDINAL_BITS} rows in one run")
        self._ordinals = ordinal + 1
        self._sequence.update(key.to_bytes(8, "little"))
        self._records.add((key << _ORDINAL_BITS) | ordinal)
        self._chunk_files = None  # a lookup of no logged part: pass 2 checks the digests
        self._flag_files = None
        return ordinal

    def replay(self) -> DedupeReplay:
        """End pass 1: find the duplicates and return the lookup table for pass 2."""
        if self._replayed:
            raise InternalError("SpillDedupe.replay() called twice")
        self._replayed = True
        events = _Spiller(self._folder, "events", self._chunk)
        for source, duplicates in _block_groups(self._records.sorted_blocks()):
            events.add(_event(source, _SOURCE, 0))
            for ordinal in duplicates[:-1]:
                events.add(_event(ordinal, _DUPLICATE, source))
            events.add(_event(duplicates[-1], _LAST_DUPLICATE, source))
        return DedupeReplay(events.sorted(), lookups=self._ordinals, sequence=self._sequence.copy())


class RecordedPart(NamedTuple):
    """What a :class:`RangeRecorder` wrote, the arguments of :meth:`SpillDedupe.adopt_range`."""

    runs: list[Path]
    digests: Path
    lookups: int


class RangeRecorder:
    """Pass 1 over one part of the input, in any process, for :meth:`SpillDedupe.adopt_range`.

    A task numbering (``add(digest)``): it writes each lookup's record into sorted runs under ``folder``
    (numbered from 0 within the part: the adopting dedupe shifts them) and the digests, in order, to a
    file. The value handed back is the part's ordinal, a stand-in as :meth:`SpillDedupe.add`'s.

    Args:
        folder: Where the files go (under the adopting dedupe's :attr:`SpillDedupe.folder`).
        name: A prefix unique among the recorders writing to ``folder``.
        chunk: Records buffered before a sorted run is written.
    """

    def __init__(self, folder: Path, name: str, *, chunk: int = 1 << 16) -> None:
        self._records = _Spiller(folder, name, chunk)
        self._path = folder / f"{name}.digests"
        self._out = self._path.open("wb")
        self._keys = array(_U64)
        self._chunks: ChunkLog | None = None
        self._flags: BinaryIO | None = None
        self.lookups = 0

    def chunk_log(self, start: int, end: int | None) -> Callable[[Read], Read]:
        """A wrapper of the ``read(size)`` this part reads the input file with (bytes ``start`` to ``end``;
        None: to its end) that logs a hash of each chunk, so pass 2 can prove it reads the same bytes
        (:meth:`SpillDedupe.chunk_check`). The log is created when the wrapper is called (a part that
        never starts reading has none) and closed by :meth:`finish`.
        """

        def wrap(read: Read) -> Read:
            if self._chunks is not None:
                raise InternalError("a RangeRecorder logs the chunks of one read only")
            self._chunks = ChunkLog(chunks_path(self._path), start, end)
            return self._chunks.wrap(read)

        return wrap

    def add(self, key: int, /) -> int:
        """Record one digest lookup; return its ordinal within the part."""
        ordinal = self.lookups
        self.lookups = ordinal + 1
        keys = self._keys
        keys.append(key)
        if len(keys) >= 16 * _READ_BLOCK:
            keys.tofile(self._out)
            self._keys = array(_U64)
        self._records.add((key << _ORDINAL_BITS) | ordinal)
        return ordinal

    def add_many(self, keys: list[int], /) -> None:
        """:meth:`add` each of ``keys``, in order (their ordinals are not needed: a validation pass)."""
        base = self.lookups
        self.lookups = base + len(keys)
        buffered = self._keys
        buffered.extend(keys)
        if len(buffered) >= 16 * _READ_BLOCK:
            buffered.tofile(self._out)
            self._keys = array(_U64)
        self._records.add_many([(key << _ORDINAL_BITS) | ordinal for ordinal, key in enumerate(keys, base)])

    def add_line_flags(self, flags: bytes, /) -> None:
        """Record the flags of the next lines of the part (:mod:`gym_ray.plan._line_flags`; a part that
        records them records one per line it read)."""
        if self._flags is None:
            self._flags = flags_path(self._path).open("wb")
        self._flags.write(flags)

    def finish(self) -> RecordedPart:
        """Write what is buffered; the files and the count for :meth:`SpillDedupe.adopt_range`."""
        try:
            self._keys.tofile(self._out)
        finally:
            self.close()
        return RecordedPart(self._records.spilled(), self._path, self.lookups)

    def close(self) -> None:
        """Close the digests file and the chunk log (idempotent; the files stay for the dedupe's folder to
        remove)."""
        self._out.close()
        if self._chunks is not None:
            self._chunks.close()
        if self._flags is not None:
            self._flags.close()


def _event(ordinal: int, kind: int, source: int) -> int:
    return (ordinal << (_ORDINAL_BITS + 2)) | (kind << _ORDINAL_BITS) | source


def _block_groups(blocks: Iterable[list[int]]) -> Iterator[tuple[int, list[int]]]:
    """``(first ordinal, later ordinals)`` for every digest that occurs more than once in the concatenated
    ``blocks`` of records ``digest << 40 | ordinal``, ascending (so equal digests are adjacent, ordinals
    ascending). Equal digests are found a block at a time by comparing each digest with the next in C;
    only duplicated records take a Python step.

    The records of a block's last digest are held back and put before the next block (a group may go on
    there).
    """
    carry: list[int] = []
    for block in blocks:
        if carry:
            block = carry + block
        digests = [record >> _ORDINAL_BITS for record in block]
        cut = bisect.bisect_left(digests, digests[-1])  # the last digest's records: carried
        carry = block[cut:]
        same = itertools.compress(range(cut - 1), map(operator.eq, digests[: cut - 1], digests[1:cut]))
        first = -2  # the group being gathered starts at index `first`, its last record is at `last`
        last = -2
        for index in same:  # index and index + 1 hold one digest
            if index != last:
                if first >= 0:
                    yield (
                        block[first] & _ORDINAL_MASK,
                        [r & _ORDINAL_MASK for r in block[first + 1 : last + 1]],
                    )
                first = index
            last = index + 1
        if first >= 0:
            yield block[first] & _ORDINAL_MASK, [r & _ORDINAL_MASK for r in block[first + 1 : last + 1]]
    if len(carry) > 1:
        yield carry[0] & _ORDINAL_MASK, [r & _ORDINAL_MASK for r in carry[1:]]


class DedupeReplay:
    """Pass 2: task indices for the lookups pass 1 recorded, in the same order.

    ``add(key)`` returns what :meth:`CompactIndex.add <gym_ray.plan._compact_index.CompactIndex.add>`
    would have returned for the same sequence of keys.
    """

    def __init__(self, events: Iterator[int], *, lookups: int, sequence: hashlib.blake2b) -> None:
        self._events = events
        self._next_event = next(events, None)
        self._lookups = lookups
        self._expected = sequence.digest()
        self._sequence = hashlib.blake2b(digest_size=16)
        self._ordinal = 0
        self._next_task = 0
        self._open: dict[int, int] = {}  # source ordinal -> task index, while duplicates are ahead
        self.ignores_keys = False

    def trust_bytes(self) -> None:
        """Number by order alone: pass 2 proves it reads pass 1's bytes (a :class:`ChunkCheck`), so the
        keys are not compared (``ignores_keys``: preprocessing then takes no digest and passes 0)."""
        self.ignores_keys = True

    def add(self, key: int) -> int:
        """The task index of the next lookup.

        Raises:
            InputError: More lookups than pass 1 made (the input changed between the passes).
        """
        ordinal = self._ordinal
        if ordinal >= self._lookups:
            raise InputError(_CHANGED.format(detail=f"more than {self._lookups} rows to number"), row=None)
        self._ordinal = ordinal + 1
        if not self.ignores_keys:
            self._sequence.update(key.to_bytes(8, "little"))
        event = self._next_event
        if event is None or event >> (_ORDINAL_BITS + 2) != ordinal:
            task = self._next_task
            self._next_task += 1
            return task
        self._next_event = next(self._events, None)
        kind, source = (event >> _ORDINAL_BITS) & 3, event & _ORDINAL_MASK
        if kind == _SOURCE:
            task = self._next_task
            self._next_task += 1
            self._open[ordinal] = task
            return task
        return self._open.pop(source) if kind == _LAST_DUPLICATE else self._open[source]

    @property
    def tasks(self) -> int:
        """Distinct tasks numbered so far."""
        return self._next_task

    def finish(self) -> None:
        """Check that pass 2 made exactly pass 1's lookups, in order.

        Raises:
            InputError: The passes differ (the input changed in between).
        """
        if self._ordinal != self._lookups:
            raise InputError(
                _CHANGED.format(detail=f"{self._ordinal} rows numbered, {self._lookups} validated"), row=None
            )
        if not self.ignores_keys and self._sequence.digest() != self._expected:
            raise InputError(_CHANGED.format(detail="the rows' contents differ"), row=None)
