"""Reading the merged rollouts for aggregation: one parse per line, and the compact text of what it read.

``iter_merged(path)`` reads a merged ``rollouts.jsonl`` once, line by line, and yields each record with
whether it is *plain*: read by orjson (:func:`gym_ray._json.orjson_loads`, the value ``json.loads`` gives,
or nothing). A plain record holds only dicts, lists, strings without lone surrogates, integers of at
most 64 bits, finite floats, booleans and ``None``. Lines orjson cannot vouch for are read by ``json``
(through :func:`~gym_ray.record.jsonl.parse_record`) and are not plain. Blank lines are skipped; a line
that is not a JSON object raises the strict :class:`~gym_ray.record.jsonl.JsonlReader`'s error (same
text, same line number).

``group_merged(path, ...)`` is ``_aggregate_spool.group_results`` over ``iter_merged(path)``, each plain
record's stripped copy spooled with ``compact_plain``: the body ``/aggregate_metrics`` receives holds the
same JSON values, in the same order, as through ``group_results``.

``compact_plain(value)`` is the compact JSON text of a value built from a plain record (its stripped
copy): orjson's bytes, which hold the same JSON value as ``json.dumps(value, separators=(",", ":"))``
(the text ``/aggregate_metrics`` bodies held before), though not the same bytes: non-ASCII characters
are written as UTF-8 instead of ``\\uXXXX`` escapes, and floats in orjson's shortest form (``1e16``
where ``json`` writes ``1e+16``), which reads back as the same float. Nothing it could change the value
of can be in a plain record: orjson writes NaN and infinities as ``null`` and refuses big integers and
lone surrogates, and orjson's reading gives none of them. A value orjson refuses to write (nesting
deeper than orjson writes) gets ``json``'s text.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson

from gym_ray._json import NOT_SURE, orjson_loads
from gym_ray.errors import InputError
from gym_ray.finalize._aggregate_spool import Grouping, ServerSpools
from gym_ray.record.jsonl import line_batches, parse_record

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology

__all__ = ["ReadSoFar", "compact_plain", "group_merged", "group_more", "iter_merged"]

# ServerClient.post_json's encoder: the text a body held before (ASCII, json's float forms).
_COMPACT = json.JSONEncoder(separators=(",", ":"))


class ReadSoFar:
    """Where :func:`iter_merged` stopped: lines read, and whether the last one ended with its newline."""

    __slots__ = ("ended", "lines")

    def __init__(self, lines: int = 0) -> None:
        self.lines = lines
        self.ended = True


def iter_merged(
    path: str | os.PathLike[str],
    *,
    start: int = 0,
    end: int | None = None,
    read: ReadSoFar | None = None,
) -> Iterator[tuple[dict[str, Any], bool]]:
    """Yield ``(record, plain)`` per record of the JSONL file ``path`` (see the module docstring).

    ``start`` / ``end``: only the bytes from offset ``start`` (a line's start) to ``end``; ``read`` counts
    the lines read (and numbers them on from its count: pass the lines before ``start``).

    Raises:
        InputError: a line is not a JSON object (names the file and line, as ``JsonlReader(strict=True)``).
        FileNotFoundError: ``path`` does not exist.
    """
    read = read if read is not None else ReadSoFar()
    for lines, ended in line_batches(path, missing_ok=False, start=start, end=end):
        read.ended = ended
        for raw in lines:
            read.lines += 1
            line_no = read.lines
            value = orjson_loads(raw)
            plain = value is not NOT_SURE
            if not plain:
                if not raw.strip():
                    continue
                value = parse_record(raw)
            elif not isinstance(value, dict):
                value = None
            if value is None:
                excerpt = raw[:80].decode("utf-8", errors="replace")
                raise InputError(
                    f"{os.fspath(path)}:{line_no}: not a JSON object ({excerpt!r}); fix or remove this line",
                    path=os.fspath(path),
                    line=line_no,
                )
            yield value, plain


def compact_plain(value: Any) -> bytes:
    """The compact JSON text of ``value``, built from a plain record (see the module docstring).

    Raises:
        TypeError, ValueError: ``value`` is not JSON-serialisable (from ``json``; never for a value built
            from a plain record).
    """
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return _COMPACT.encode(value).encode()


def group_merged(
    path: str | os.PathLike[str], topology: Topology, spools: ServerSpools, stop: threading.Event
) -> Grouping:
    """``group_results`` over the records of ``path``, read once (see the module docstring).

    Raises:
        InputError: a line of ``path`` is not a JSON object.
        ValidationError: unknown stamps or unattributable rows (every one listed).
        RecordError: a spool cannot be written.
        Stopped: ``stop`` was set.
    """
    grouping = Grouping(topology, spools, stop)
    group_more(grouping, path, 0, None, ReadSoFar())
    spools.finish()
    grouping.raise_problems()
    return grouping


def group_more(
    grouping: Grouping, path: str | os.PathLike[str], start: int, end: int | None, read: ReadSoFar
) -> None:
    """Add the records of ``path`` between byte offsets ``start`` and ``end`` to ``grouping``, numbered on
    from the records it holds (``read`` counts the lines)."""
    for result, plain in iter_merged(path, start=start, end=end, read=read):
        grouping.add(result, grouping.positions, compact_plain if plain else None)
        grouping.positions += 1
