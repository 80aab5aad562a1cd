"""Proof that planning's second pass reads the very bytes its first pass validated: a hash per chunk read.

Planning reads its input file twice (:mod:`gym_ray.plan.shards`). The first pass validates every row; the
second numbers and cuts them. Both must see the same input. The second pass used to prove it by taking
every row's 64-bit content digest again and hashing the sequence; here it proves it from the bytes:

1. Pass 1 (:class:`ChunkLog`): each chunk the reader takes from one part of the file (about 64 KiB; a
   byte range of the parallel pass, or the whole file) is hashed (SHA-256, 16 bytes kept) into a file next to
   the part's other records with its length, after a header holding the part's ``start`` and ``end``
   offsets (the parts must cover the file from byte 0, in order).
2. Pass 2 (:class:`ChunkCheck`): the file is read again from its start, cut into the same chunks (the
   lengths are recorded), and each chunk is compared with its recorded hash *before* any of its lines is
   parsed. A chunk that differs or bytes past the last part's end raise
   :class:`~gym_ray.errors.InputError` (:data:`CHANGED`, "the rows' contents differ"); a file that ends
   early ends the rows (the caller's count of rows then says how many are missing), and
   :meth:`ChunkCheck.finish` checks that every recorded chunk was compared.

Bytes proven equal parse to the same rows, which pass 1 validated (strict JSON included) and for which it
made its task-numbering lookups in order: pass 2 then numbers tasks by order alone
(:meth:`gym_ray.plan._spill_dedupe.DedupeReplay.trust_bytes`), with no digest and no strict-JSON check.
Nothing here is thread-safe.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from gym_ray.errors import InputError, InternalError

__all__ = ["CHANGED", "ChunkCheck", "ChunkLog", "Read", "changed", "chunks_path"]

#: The error text when the input changed between planning's passes (``detail`` says how).
CHANGED = (
    "the input changed between the validation pass and the planning pass ({detail}); "
    "do not edit the input file while a run is being planned, then run again"
)
_DIFFER = "the rows' contents differ"
_DIGEST_BYTES = 16
_HEADER = struct.Struct("<QQ")
_RECORD = struct.Struct(f"<Q{_DIGEST_BYTES}s")  # a chunk's length and hash
_TO_EOF = (1 << 64) - 1  # a part that runs to the end of the file
_RECORDS_PER_READ = 1024

#: A file's ``read(size)``.
Read = Callable[[int], bytes]


def changed(detail: str) -> InputError:
    """The :class:`InputError` saying the input changed between the passes (:data:`CHANGED`)."""
    return InputError(CHANGED.format(detail=detail), row=None)


def chunks_path(digests: Path) -> Path:
    """The chunk hashes file that belongs with a part's digests file (``name.digests`` -> ``name.chunks``)."""
    return digests.with_suffix(".chunks")


def _digest(data: bytes) -> bytes:
    # SHA-256 (about twice BLAKE2b's speed on CPUs with SHA instructions), its first 16 bytes kept
    return hashlib.sha256(data).digest()[:_DIGEST_BYTES]


class ChunkLog:
    """Pass 1: hashes every chunk read from one part of the input into ``path``.

    Args:
        path: The file to write (:func:`chunks_path` of the part's digests file).
        start: The part's first byte offset in the input file.
        end: The offset just past the part, or None when the part runs to the end of the file.
    """

    def __init__(self, path: Path, start: int, end: int | None) -> None:
        self._out = path.open("wb")
        self._out.write(_HEADER.pack(start, _TO_EOF if end is None else end))

    def wrap(self, read: Read) -> Read:
        """``read``, hashing each chunk it returns into the log."""
        write, pack = self._out.write, _RECORD.pack

        def logged(size: int) -> bytes:
            data = read(size)
            if data:
                write(pack(len(data), _digest(data)))
            return data

        return logged

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        self._out.close()


class _Part:
    __slots__ = ("chunks", "end", "path", "start")

    def __init__(self, path: Path) -> None:
        size = path.stat().st_size
        with path.open("rb") as src:
            header = src.read(_HEADER.size)
        if len(header) < _HEADER.size or (size - _HEADER.size) % _RECORD.size:
            raise InternalError(f"{path} is not a chunk hashes file ({size} bytes)")
        self.path = path
        self.start, end = _HEADER.unpack(header)
        self.end: int | None = None if end == _TO_EOF else end
        self.chunks = (size - _HEADER.size) // _RECORD.size

    def records(self) -> Iterator[tuple[int, bytes]]:
        """Each chunk's ``(length, hash)``, in order, read a block at a time."""
        with self.path.open("rb") as src:
            src.seek(_HEADER.size)
            while block := src.read(_RECORD.size * _RECORDS_PER_READ):
                yield from _RECORD.iter_unpack(block)


class ChunkCheck:
    """Pass 2: reads the input again as pass 1 did, comparing each chunk with its recorded hash.

    Memory: one block of recorded chunks at a time (the files hold 24 bytes per chunk read).

    Args:
        files: The parts' chunk hashes files, in input order, covering the file from byte 0 without gaps
            (only the last part may run to the end of the file).

    Raises:
        InternalError: The files do not describe contiguous parts from byte 0.
    """

    def __init__(self, files: list[Path]) -> None:
        self._parts = [_Part(path) for path in files]
        at: int | None = 0
        for part in self._parts:
            if at is None or part.start != at:
                raise InternalError(f"the recorded parts of the input are not contiguous at {part.start}")
            at = part.end
        self._recorded = sum(part.chunks for part in self._parts)
        self._compared = 0

    def reader(self, file_read: Read) -> Read:
        """A ``read(size)`` over ``file_read`` (the input file's, opened at byte 0) giving pass 1's chunks
        (each of the length pass 1 read, whatever ``size`` is asked: the line reader takes any length).

        Raises (from the returned function):
            InputError: A chunk differs from pass 1's, or the file holds more than pass 1 read.
        """
        chunks = (chunk for part in self._parts for chunk in part.records())

        def read(size: int) -> bytes:
            recorded = next(chunks, None)
            if recorded is None:
                if file_read(1):
                    raise changed(_DIFFER)  # bytes past those validated
                return b""
            length, digest = recorded
            data = file_read(length)
            if not data:
                return b""  # the file ends early: the rows counted at the end say how many are missing
            if len(data) != length or _digest(data) != digest:
                raise changed(_DIFFER)
            self._compared += 1
            return data

        return read

    def finish(self) -> None:
        """Check that every chunk pass 1 recorded was compared.

        Raises:
            InputError: Pass 2 read fewer chunks than pass 1.
        """
        if self._compared != self._recorded:
            raise changed(_DIFFER)
