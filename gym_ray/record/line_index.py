"""The line index: a side file the shard writer keeps beside each record file, so the merge can key lines
without parsing them. An accelerator, never a source of truth.

``rollouts-<s>.jsonl.idx`` (and ``rollouts-<s>_failures.jsonl.idx``) is a run of *batches*, written at
the writer's checkpoints. A batch covers a contiguous byte range of its record file, whole lines only:

- a header (:data:`_HEADER`): magic ``GRX1``, the range's offset and length in the record file, its number
  of lines, and a CRC-32 of the header's other fields, the columns and the covered record bytes;
- two columns of one value per line: its *key* (32 bytes, big-endian: ``_ng_task_index``,
  ``_ng_rollout_index`` and ``_ng_attempt_index`` (0 when absent) each plus ``2**63`` in 64 bits, then 64
  zero bits, so that ``int.from_bytes(key)`` orders as the identity and has room for a sequence number),
  then its flags (one byte: :data:`NO_PERSIST` when the record's ``_ng_no_persist`` is truthy,
  :data:`TERMINAL` when its ``_ng_failure_terminal`` is ``true``). These are facts about the line's bytes
  (what parsing them gives), not about which file holds it; the merge applies its own rules to them.
  Columns let the merge take a batch's keys with no per-line Python (``map`` over a column).

A line gets an entry only when those facts are certain from the record the writer encoded: integer indices
within int64 (an ``int``, not a subclass), ``_ng_no_persist`` absent or of a plain JSON type. Any other
line ends the batch and is left to parsing.

Reading (:func:`index_blocks`): a record file is cut into blocks in file order. A batch *verifies* when its
header is whole, its range starts where the previous block ended (or after a gap that ends at a line
boundary) and lies within the file's bytes, its CRC matches, and the range splits at its newlines into
exactly its number of lines (a line the writer encodes holds one newline, its last byte); its lines are
then a covered block. Every other byte range is a block of lines to parse. The first batch that does not
verify ends the use of the index for that file: the rest is parsed. So a missing, short, torn, stale
(after a repair or a rewrite) or lying index costs parsing, never a line: a line is keyed from the index
only when its bytes and its entry are, by CRC, the ones the writer wrote together. (CRC-32 catches damage:
every error burst up to 32 bits, and a random change but for a 2**-32 chance. It is no signature: an
index rewritten on purpose with a recomputed CRC is believed.)

Writing (:class:`IndexBatch`): the writer notes each appended line and writes the pending batch with one
``os.write`` to an ``O_APPEND`` descriptor at checkpoints (see :mod:`gym_ray.record.writer`), under the
shard lock, after the data it covers. When the writer's open repairs a record file (torn tail,
quarantine), :func:`trim_index` drops the batches the repair made stale.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from gym_ray import keys

__all__ = [
    "INDEX_SUFFIX",
    "NO_PERSIST",
    "TERMINAL",
    "Block",
    "IndexBatch",
    "index_blocks",
    "index_path",
    "trim_index",
]

#: Appended to a record file's name to name its index (``rollouts-00001.jsonl.idx``).
INDEX_SUFFIX = ".idx"
#: Entry flags.
NO_PERSIST, TERMINAL = 1, 2

_MAGIC = b"GRX1"
#: magic, record offset, record length, lines, CRC-32.
_HEADER = struct.Struct("<4sQQII")
#: task + 2**63, rollout + 2**63, attempt + 2**63 (then 8 zero bytes make a key).
_IDENTITY = struct.Struct(">QQQ")
_KEY_TAIL = bytes(8)
_KEY_SIZE = 32
#: bytes per line in a batch: its key and its flags.
_PER_LINE = _KEY_SIZE + 1
_HALF = 1 << 63
_CHUNK = 1 << 20
#: ``_ng_no_persist`` values whose truthiness survives a JSON round trip (what the merge reads back).
_PLAIN = frozenset({type(None), bool, int, float, str, list, tuple, dict})


def index_path(path: str | os.PathLike[str]) -> Path:
    """The index file of record file ``path``."""
    p = Path(path)
    return p.with_name(p.name + INDEX_SUFFIX)


class IndexBatch:
    """The pending batch of one record file: lines appended since the last checkpoint (``pending`` counts
    them).

    Args:
        offset: Where the next line appended to the record file starts (its size after the writer's open).
    """

    def __init__(self, offset: int) -> None:
        self._next = offset
        self._start = offset
        self._crc = 0
        self._keys: list[bytes] = []
        self._flags = bytearray()
        self._done: list[bytes] = []  # finished batches not yet written
        self.pending = 0  # lines noted since the last take

    def note(self, line: bytes, record: dict[str, Any]) -> None:
        """Note ``line`` (a whole line with its newline, ``record`` encoded), just appended at the end."""
        self.pending += 1
        facts = _facts(record)
        if facts is None:
            self._finish()
            self._next += len(line)
            self._start = self._next
            return
        self._crc = zlib.crc32(line, self._crc)
        self._next += len(line)
        self._keys.append(facts[0])
        self._flags.append(facts[1])

    def take(self) -> bytes:
        """The batches noted since the last call, as bytes to append to the index (empty: none)."""
        self._finish()
        data = b"".join(self._done)
        self._done.clear()
        self.pending = 0
        return data

    def _finish(self) -> None:
        if self._keys:
            columns = b"".join(self._keys) + self._flags
            fields = _HEADER.pack(_MAGIC, self._start, self._next - self._start, len(self._keys), 0)[:-4]
            crc = zlib.crc32(columns, zlib.crc32(fields, self._crc))
            self._done.append(fields + crc.to_bytes(4, "little") + columns)
        self._keys = []
        self._flags = bytearray()
        self._crc = 0
        self._start = self._next


def _facts(record: dict[str, Any]) -> tuple[bytes, int] | None:
    """The key and flags of a record's line, or None when they are not certain from ``record``."""
    task = record.get(keys.TASK_INDEX)
    rollout = record.get(keys.ROLLOUT_INDEX)
    attempt = record.get(keys.ATTEMPT_INDEX, 0)
    if type(task) is not int or type(rollout) is not int or type(attempt) is not int:
        return None
    no_persist = record.get(keys.NO_PERSIST)
    if type(no_persist) not in _PLAIN:
        return None
    flags = (NO_PERSIST if no_persist else 0) | (TERMINAL if record.get(keys.FAILURE_TERMINAL) is True else 0)
    try:
        return _IDENTITY.pack(task + _HALF, rollout + _HALF, attempt + _HALF) + _KEY_TAIL, flags
    except struct.error:  # an index outside int64
        return None


class Block(NamedTuple):
    """A block of a record file: a verified batch (``lines`` set: its lines without their newlines, ``keys``
    each line's 32-byte key, ``flags`` its flags) or lines to parse (``lines`` None: ``data`` holds whole
    lines, the last maybe without its newline)."""

    data: bytes
    lines: list[bytes] | None
    keys: tuple[bytes, ...]
    flags: bytes


class _Batch(NamedTuple):
    offset: int
    length: int
    lines: int
    crc: int
    fields: bytes
    columns: bytes


def _batches(index: bytes) -> Iterator[_Batch]:
    """The structurally whole batches of an index's bytes, up to the first that is not."""
    pos, end, header = 0, len(index), _HEADER.size
    while pos + header <= end:
        magic, offset, length, lines, crc = _HEADER.unpack_from(index, pos)
        stop = pos + header + lines * _PER_LINE
        if magic != _MAGIC or lines == 0 or stop > end:
            return
        yield _Batch(offset, length, lines, crc, index[pos : pos + header - 4], index[pos + header : stop])
        pos = stop


def index_blocks(path: str | os.PathLike[str]) -> Iterator[Block]:
    """The blocks of record file ``path`` in file order (see the module docstring); nothing if missing.

    Only the bytes the file has when reading starts are read. Lines not covered by a verified batch come
    in blocks of about 1 MiB that end at a line boundary (or at the end of the file).
    """
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        pos = 0
        for batch in _batches(_read_index(path)):
            start, end = batch.offset, batch.offset + batch.length
            if start < pos or end > size or batch.length == 0:
                break
            if start > pos and os.pread(fd, 1, start - 1) != b"\n":
                break
            block = _verified(batch, os.pread(fd, batch.length, start))
            if block is None:
                break
            yield from _line_blocks(fd, pos, start)
            yield block
            pos = end
        yield from _line_blocks(fd, pos, size)
    finally:
        os.close(fd)


def _verified(batch: _Batch, data: bytes) -> Block | None:
    """The batch as a block when ``data`` (its range's bytes) verifies against it, else None."""
    if len(data) != batch.length:
        return None
    if zlib.crc32(batch.columns, zlib.crc32(batch.fields, zlib.crc32(data))) != batch.crc:
        return None
    lines = data.split(b"\n")
    if len(lines) != batch.lines + 1 or lines.pop():  # n newlines, the last one ending the range
        return None
    flags_at = _KEY_SIZE * batch.lines
    keys = struct.unpack_from(f"{_KEY_SIZE}s" * batch.lines, batch.columns)
    return Block(data, lines, keys, batch.columns[flags_at:])


def _read_index(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(index_path(path), "rb") as handle:
            return handle.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return b""


def _line_blocks(fd: int, start: int, end: int) -> Iterator[Block]:
    """Blocks of whole lines for ``[start, end)``, ``start`` at a line boundary, in chunks of ~1 MiB."""
    pending = b""
    while start < end:
        chunk = pending + os.pread(fd, min(_CHUNK, end - start), start)
        if len(chunk) == len(pending):
            break  # the file shrank meanwhile
        start += len(chunk) - len(pending)
        cut = chunk.rfind(b"\n") + 1
        if start >= end:
            cut = len(chunk)
        if cut:
            yield Block(chunk[:cut], None, (), b"")
        pending = chunk[cut:]
    if pending:
        yield Block(pending, None, (), b"")


def trim_index(path: str | os.PathLike[str], *, rewritten: bool) -> None:
    """Make record file ``path``'s index hold only batches it can still verify against (the writer's open,
    under the shard lock, after repairing ``path``).

    ``rewritten`` (lines moved out of the middle: every offset may have moved) empties the index; otherwise
    it is cut after the last structurally whole batch whose range lies within the file (a torn tail's
    repair or a power loss shortened the file or the index). A missing index stays missing.

    Raises:
        OSError: Reading or truncating the index failed.
    """
    target = index_path(path)
    try:
        fd = os.open(target, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        keep = 0
        if not rewritten:
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                size = 0
            index = os.pread(fd, os.fstat(fd).st_size, 0)
            for batch in _batches(index):
                if batch.offset + batch.length > size:
                    break
                keep += _HEADER.size + batch.lines * _PER_LINE
        if keep < os.fstat(fd).st_size:
            os.ftruncate(fd, keep)
    finally:
        os.close(fd)
