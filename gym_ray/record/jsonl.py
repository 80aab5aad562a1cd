"""JSONL reading that tolerates torn tails, and the repair of a torn tail in place.

Every line gym_ray appends is one compact JSON object followed by ``\\n``. A crash (or a power loss before
an fsync) can leave the end of a file torn: a partial last line, or garbage bytes after the last whole
line. The rules, shared by every reader of a run folder:

- A line is a *record* when it decodes as UTF-8 and parses as a JSON object.
- Blank (whitespace-only) lines are skipped and are not records.
- Any other line is *corrupt*. :class:`JsonlReader` skips and counts it (tolerant mode) or raises
  :class:`~gym_ray.errors.InputError` naming the file and line (strict mode).
- A last line without ``\\n`` that parses is a whole record whose newline was lost: it is read as a record.
- Readers read only the bytes that existed when iteration started (a concurrent append is not half-read).

:func:`repair_torn_tail` makes a file end cleanly: it drops the trailing run of lines that are not records
(a partial line, a block of zero bytes, random garbage) and adds the missing ``\\n`` to a last line that
parses. It never touches a line that is followed by a record, so it can lose no record.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gym_ray._json import NOT_SURE, dumps_compact, orjson_loads
from gym_ray.errors import InputError

__all__ = ["JsonlReader", "TailRepair", "encode_line", "line_batches", "parse_record", "repair_torn_tail"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


def parse_record(raw: bytes) -> dict[str, Any] | None:
    """Parse one line (without its newline) as a record.

    Args:
        raw: The line's bytes.

    Returns:
        The JSON object, or None when the bytes are not UTF-8, not JSON, or not a JSON object.
    """
    value = orjson_loads(raw)
    if value is NOT_SURE:
        try:
            value = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            # ValueError covers JSONDecodeError and UnicodeDecodeError; deep nesting raises RecursionError.
            return None
    return value if isinstance(value, dict) else None


def encode_line(record: dict[str, Any]) -> bytes:
    """Encode a record as one compact UTF-8 JSON line ending in ``\\n``.

    Args:
        record: A JSON-serializable dict.

    Returns:
        The line's bytes.

    Raises:
        TypeError: A value is not JSON-serializable.
        ValueError: A value cannot be encoded (a circular reference, a lone surrogate).
    """
    return dumps_compact(record) + b"\n"


def _is_blank(raw: bytes) -> bool:
    return not raw.strip()


@dataclass
class JsonlReader:
    """Iterate ``(line_number, record)`` over a JSONL file (line numbers start at 1).

    Tolerant by default: corrupt lines are skipped and their numbers collected in ``corrupt_lines``; a
    corrupt last line without ``\\n`` also sets ``torn_tail``. With ``strict=True`` a corrupt line raises
    :class:`~gym_ray.errors.InputError` naming the file and line instead. A missing file reads as empty
    when ``missing_ok`` is true. The counters are complete once iteration has finished.

    Example:
        >>> reader = JsonlReader(path)  # doctest: +SKIP
        >>> records = [record for _, record in reader]  # doctest: +SKIP
        >>> reader.corrupt_lines  # doctest: +SKIP
        []
    """

    path: str | os.PathLike[str]
    strict: bool = False
    missing_ok: bool = True
    corrupt_lines: list[int] = field(default_factory=list)
    torn_tail: bool = False
    records: int = 0

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        self.corrupt_lines = []
        self.torn_tail = False
        self.records = 0
        for line_no, raw, terminated in self._raw_lines():
            if _is_blank(raw):
                continue
            record = parse_record(raw)
            if record is None:
                if self.strict:
                    excerpt = raw[:80].decode("utf-8", errors="replace")
                    raise InputError(
                        f"{os.fspath(self.path)}:{line_no}: not a JSON object ({excerpt!r}); "
                        "fix or remove this line",
                        path=os.fspath(self.path),
                        line=line_no,
                    )
                self.corrupt_lines.append(line_no)
                if not terminated:
                    self.torn_tail = True
                continue
            self.records += 1
            yield line_no, record

    def _raw_lines(self) -> Iterator[tuple[int, bytes, bool]]:
        line_no = 0
        for lines, terminated in line_batches(self.path, missing_ok=self.missing_ok):
            for part in lines:
                line_no += 1
                yield line_no, part, terminated


def line_batches(
    path: str | os.PathLike[str], *, missing_ok: bool, start: int = 0, end: int | None = None
) -> Iterator[tuple[list[bytes], bool]]:
    """The lines (without their newline) of the bytes ``path`` has now, in batches, with whether they ended.

    Yields ``(lines, True)`` per chunk read, then ``([last], False)`` for a last line without ``\\n``. Only
    the bytes that exist when reading starts are read (a concurrent append is not half-read); a device
    (tests use /dev/full) reads as its reported size, 0. Empty lines are kept, so counting the lines gives
    their line numbers. ``start`` / ``end``: read only the bytes from offset ``start`` (a line's start) up
    to ``end`` (default: the size now).

    Raises:
        FileNotFoundError: ``path`` does not exist and ``missing_ok`` is false (else it has no lines).
    """
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        st = os.fstat(fd)
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        remaining = max(0, (size if end is None else min(end, size)) - start)
        if start:
            os.lseek(fd, start, os.SEEK_SET)
        pending = b""
        while remaining > 0:
            chunk = os.read(fd, min(_CHUNK, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            yield lines, True
        if pending:
            yield [pending], False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TailRepair:
    """What :func:`repair_torn_tail` did to one file."""

    dropped_bytes: int = 0
    dropped_lines: int = 0
    added_newline: bool = False

    @property
    def changed(self) -> bool:
        """True when the file was modified."""
        return self.dropped_bytes > 0 or self.added_newline


def _line_start(fd: int, end: int) -> int:
    """Offset just after the last ``\\n`` before ``end`` (0 when there is none), scanning back in chunks."""
    pos = end
    while pos > 0:
        start = max(0, pos - _CHUNK)
        chunk = os.pread(fd, pos - start, start)
        idx = chunk.rfind(b"\n")
        if idx >= 0:
            return start + idx + 1
        pos = start
    return 0


def repair_torn_tail(fd: int, *, label: str = "") -> TailRepair:
    """Make the file open on ``fd`` end with a whole record line (or be empty).

    Drops the trailing run of lines that are not records and appends ``\\n`` to a last line that parses
    but lacks it. Syncs the file when it changed. The caller must hold whatever lock excludes writers.

    Args:
        fd: A file descriptor opened for reading and writing (not ``O_APPEND``-only).
        label: The file's name, for the log message.

    Returns:
        What was done.

    Raises:
        OSError: Reading, truncating, writing or syncing failed.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return TailRepair()
    size = st.st_size
    end = size
    dropped_lines = 0
    added_newline = False
    while end > 0:
        terminated = os.pread(fd, 1, end - 1) == b"\n"
        content_end = end - 1 if terminated else end
        start = _line_start(fd, content_end)
        raw = os.pread(fd, content_end - start, start)
        if not _is_blank(raw) and parse_record(raw) is not None:
            if not terminated:
                os.pwrite(fd, b"\n", end)
                added_newline = True
            break
        end = start
        dropped_lines += 1
    if end < size:
        os.ftruncate(fd, end)
    repair = TailRepair(dropped_bytes=size - end, dropped_lines=dropped_lines, added_newline=added_newline)
    if repair.changed:
        os.fsync(fd)
        if repair.dropped_bytes:
            logger.warning(
                "Dropped a torn tail (%d bytes, %d lines) from %s before appending.",
                repair.dropped_bytes,
                dropped_lines,
                label,
            )
        else:
            logger.warning("Added the missing final newline to %s before appending.", label)
    return repair
