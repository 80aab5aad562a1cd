"""Read one JSON object from a file without holding it: top-level members whole, named lists element-wise.

``iter_object(path, streamed=..., what=..., hint=...)`` reads a file that holds one JSON object (a
reply body written to disk by ``ServerClient.post_json_file(..., reply_path=...)``) and yields its
top-level ``(key, value)`` pairs in file order. For a key named in ``streamed`` whose value is an
array, the elements are handed one at a time to that key's callback and the pair yielded is
``(key, StreamedList(count))``; any other value of such a key (``null``, an object, ...) is yielded
whole, as it is, for the caller to validate.

How: the file is decoded as UTF-8 incrementally in chunks of ``chunk_bytes`` (1 MiB by default) into a
sliding text buffer; each member (and each element of a streamed list) is decoded with
``json.JSONDecoder().raw_decode`` (so values mean what ``json.loads`` says they mean, ``NaN`` included),
except runs of a streamed list's elements read at once by orjson where that provably gives the same
values (``_Runs``).
A value cut at the end of the buffer is decoded again after reading more: a failed decode is retried
until the end of the file, and a number that reaches the end of the buffer is only accepted once the
next character is known. Memory: the buffer (one chunk plus the member or element being decoded) and
the value (or the run of one buffer's elements) being handed over, whatever the file's size. On
malformed input the text from the bad value to the end of the file is read before the error is raised
(it could have been a cut value).

Not thread-safe: one iterator is used from one thread at a time.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gym_ray._json import NOT_SURE, orjson_loads
from gym_ray.errors import ServerResponseError, UsageError

__all__ = ["EXCERPT_BYTES", "StreamedList", "iter_array_of_objects", "iter_object"]

#: Bytes of the file kept as ``body_excerpt`` of the errors raised.
EXCERPT_BYTES = 2000
_CHUNK_BYTES = 1 << 20
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER_TAIL = frozenset("0123456789.eE+-")
_DECODER = json.JSONDecoder()
#: Failed tries of a run per buffer (``_Runs``) before the rest of the buffer is read element by element.
_RUN_TRIES = 8
_FIRST_KEY = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"(?:[^"\\]|\\.)*"')


@dataclass(frozen=True)
class StreamedList:
    """The value yielded for a streamed key whose array was handed over element by element."""

    count: int  #: number of elements handed to the callback


class _Cut(Exception):
    """The buffer ends inside the value being decoded: read more and decode it again."""


class _Bad(Exception):
    """The text is not valid JSON here (only an error once the file is read to its end)."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos


class _Reader:
    def __init__(self, handle: BinaryIO, chunk_bytes: int) -> None:
        self._handle = handle
        self._chunk_bytes = chunk_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = ""
        self.pos = 0  # committed position in ``text``: everything before it is done with
        self.offset = 0  # characters dropped from the front of the file so far
        self.eof = False

    def more(self) -> None:
        """Drop the committed text, append the next chunk (decoded); set ``eof`` at the end."""
        data = self._handle.read(self._chunk_bytes)
        self.eof = not data
        decoded = self._decoder.decode(data, final=self.eof)
        self.offset += self.pos
        self.text = self.text[self.pos :] + decoded
        self.pos = 0


def _skip(text: str, i: int) -> int:
    match = _WS.match(text, i)
    return match.end() if match is not None else i


def _char(text: str, i: int) -> str:
    if i >= len(text):
        raise _Cut
    return text[i]


def _value(text: str, i: int) -> tuple[Any, int]:
    """Decode the value at ``i`` (after whitespace); return it and the position after it."""
    i = _skip(text, i)
    if i >= len(text):
        raise _Cut
    try:
        value, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError as exc:
        raise _Bad(exc.msg, exc.pos) from None
    if isinstance(value, int | float) and not isinstance(value, bool):
        tail = end
        while tail < len(text) and text[tail] in _NUMBER_TAIL:
            tail += 1
        if tail == len(text):
            raise _Cut  # the number may go on in the next chunk
    return value, end


def _expect(text: str, i: int, allowed: str, what: str) -> tuple[str, int]:
    i = _skip(text, i)
    char = _char(text, i)
    if char not in allowed:
        raise _Bad(f"Expecting {what}", i)
    return char, i + 1


def _type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def iter_object(
    path: str | Path,
    *,
    streamed: Mapping[str, Callable[[dict[str, Any]], None]],
    what: str,
    hint: str,
    chunk_bytes: int = _CHUNK_BYTES,
) -> Iterator[tuple[str, Any]]:
    """Yield the top-level members of the JSON object in ``path``; stream the arrays of ``streamed``.

    Example::

        rows = []
        for key, value in iter_object(reply, streamed={"items": rows.append}, what="the reply",
                                      hint="the server must answer an object"):
            ...  # ("items", StreamedList(count=...)), ("other", {...}), ...

    Args:
        path: the file (UTF-8 JSON text holding one object).
        streamed: key -> callback called with each element of that key's array, in order (elements
            must be objects). An exception raised by a callback propagates unchanged. A callback with
            an ``on_run(elements)`` method is handed a run of elements read at once (by orjson, where
            it provably reads what ``json`` reads: plain JSON values) in one call instead.
        what: names the file in error messages (``"/aggregate_metrics on 'env' answered a body"``).
        hint: what to do, appended to error messages.
        chunk_bytes: bytes read (and decoded) at a time.

    Yields:
        ``(key, value)`` per member in file order; ``(key, StreamedList(n))`` for a streamed array.
        A key that appears twice is yielded twice.

    Raises:
        ServerResponseError: the text is not UTF-8 / not JSON / not one object (truncated, trailing
            data), or an element of a streamed array is not an object. ``body_excerpt`` holds the first
            ``EXCERPT_BYTES`` bytes of the file.
        OSError: the file cannot be read.
        UsageError: ``chunk_bytes`` < 1.
    """
    if chunk_bytes < 1:
        raise UsageError(f"iter_object: chunk_bytes={chunk_bytes} is invalid; pass a positive size")
    with Path(path).open("rb") as handle:
        reader = _Reader(handle, chunk_bytes)
        with _errors(reader, path, what, hint, "one JSON object"):
            yield from _members(reader, streamed)
            _finish(reader)


def iter_array_of_objects(
    path: str | Path,
    *,
    skipped: frozenset[str],
    what: str,
    hint: str,
    chunk_bytes: int = _CHUNK_BYTES,
) -> Iterator[dict[str, Any]]:
    """Yield each object of the JSON array of objects in ``path``, without the arrays under ``skipped``.

    An array under a skipped key is read element by element and dropped: the object yielded holds
    ``StreamedList(count)`` in its place. Memory: one object without its skipped arrays, and the buffer.

    Raises:
        ServerResponseError: the text is not a JSON array of objects (see :func:`iter_object`).
        OSError: the file cannot be read.
    """
    drop: Mapping[str, Callable[[dict[str, Any]], None]] = {key: _drop for key in skipped}
    with Path(path).open("rb") as handle:
        reader = _Reader(handle, chunk_bytes)
        with _errors(reader, path, what, hint, "a JSON array of objects"):
            _step(reader, lambda text, i: _expect(text, i, "[", "a JSON array '['"))
            if not _step(reader, _opt_close("]")):
                while True:
                    yield dict(_members(reader, drop))
                    if _step(reader, lambda text, i: _expect(text, i, ",]", "',' or ']'")) == "]":
                        break
            _finish(reader)


def _drop(_element: dict[str, Any]) -> None:
    return None


@contextlib.contextmanager
def _errors(reader: _Reader, path: str | Path, what: str, hint: str, shape: str) -> Iterator[None]:
    """Turn the reader's internal exceptions into one ServerResponseError naming the file's problem."""
    try:
        yield
    except _Bad as exc:
        where = reader.offset + exc.pos
        cut = exc.message == "truncated" or exc.pos >= len(reader.text)
        problem = "it ends too early (truncated)" if cut else exc.message
        raise _error(path, what, f"is not {shape}: {problem} at character {where}", hint) from None
    except UnicodeDecodeError as exc:
        raise _error(path, what, f"is not UTF-8 ({exc})", hint) from None
    except _ElementError as exc:
        raise _error(path, what, str(exc), hint) from None


class _ElementError(Exception):
    pass


def _error(path: str | Path, what: str, problem: str, hint: str) -> ServerResponseError:
    try:
        with Path(path).open("rb") as handle:
            excerpt = handle.read(EXCERPT_BYTES).decode("utf-8", errors="replace")
    except OSError:
        excerpt = None
    return ServerResponseError(f"{what} that {problem}; {hint}", body_excerpt=excerpt)


def _step(reader: _Reader, parse: Callable[[str, int], tuple[Any, int]]) -> Any:
    """Run ``parse(text, pos)``; on a cut (or, before the end of the file, a bad) value read more, retry."""
    while True:
        try:
            result, end = parse(reader.text, reader.pos)
        except _Cut:
            if reader.eof:
                raise _Bad("truncated", len(reader.text)) from None
        except _Bad:
            if reader.eof:
                raise
        else:
            reader.pos = end
            return result
        reader.more()


def _members(
    reader: _Reader, streamed: Mapping[str, Callable[[dict[str, Any]], None]]
) -> Iterator[tuple[str, Any]]:
    _step(reader, lambda text, i: _expect(text, i, "{", "a JSON object '{'"))
    first = True
    while True:
        if first:
            closing = _step(reader, _opt_close("}"))
            if closing:
                break
        key = _step(reader, _key)
        callback = streamed.get(key)
        if callback is None:
            value, sep = _step(reader, _member_value)
            yield key, value
        else:
            is_array = _step(reader, _array_start)
            if is_array:
                yield key, StreamedList(_stream_elements(reader, key, callback))
                sep = _step(reader, lambda text, i: _expect(text, i, ",}", "',' or '}'"))
            else:
                value, sep = _step(reader, _member_value)
                yield key, value
        first = False
        if sep == "}":
            break


def _opt_close(char: str) -> Callable[[str, int], tuple[bool, int]]:
    def parse(text: str, i: int) -> tuple[bool, int]:
        j = _skip(text, i)
        if _char(text, j) == char:
            return True, j + 1
        return False, i

    return parse


def _key(text: str, i: int) -> tuple[str, int]:
    i = _skip(text, i)
    if _char(text, i) != '"':
        raise _Bad("Expecting property name enclosed in double quotes", i)
    key, end = _value(text, i)
    _, end = _expect(text, end, ":", "':' delimiter")
    return str(key), end


def _member_value(text: str, i: int) -> tuple[tuple[Any, str], int]:
    value, end = _value(text, i)
    sep, end = _expect(text, end, ",}", "',' or '}'")
    return (value, sep), end


def _array_start(text: str, i: int) -> tuple[bool, int]:
    j = _skip(text, i)
    if _char(text, j) == "[":
        return True, j + 1
    return False, i


def _element(text: str, i: int) -> tuple[tuple[Any, str], int]:
    value, end = _value(text, i)
    sep, end = _expect(text, end, ",]", "',' or ']'")
    return (value, sep), end


def _finish(reader: _Reader) -> None:
    """Only whitespace may follow the object, up to the end of the file."""
    while True:
        j = _skip(reader.text, reader.pos)
        if j < len(reader.text):
            raise _Bad("Extra data after the object", j)
        reader.pos = j
        if reader.eof:
            return
        reader.more()


def _stream_elements(reader: _Reader, key: str, callback: Callable[[dict[str, Any]], None]) -> int:
    count = 0
    if _step(reader, _opt_close("]")):
        return 0
    runs = _Runs()
    on_run: Callable[[list[dict[str, Any]]], None] | None = getattr(callback, "on_run", None)
    while True:
        run = runs.take(reader)
        if run is not None:
            if on_run is not None:
                on_run(run)
            else:
                for value in run:
                    callback(value)
            count += len(run)
            _step(reader, lambda text, i: _expect(text, i, ",", "','"))  # the run ends before a ','
            continue
        value, sep = _step(reader, _element)
        if not isinstance(value, dict):
            raise _ElementError(
                f"has {key}[{count}] = a JSON {_type_name(value)} ({json.dumps(value)[:100]}), not an object"
            )
        callback(value)
        count += 1
        if sep == "]":
            return count
        runs.learn(reader)


class _Runs:
    """Runs of whole elements of a streamed array read at once by orjson, where it reads what json reads.

    After an element read by ``json`` and followed by ``,``, the text from its closing ``}`` to the next
    element's first key (``}, {"key"``) is the *marker*. From then on, at the start of an element, the
    text up to the last marker in the buffer (its ``}``) is read as ``[...]`` by
    :func:`gym_ray._json.orjson_loads`. Where that succeeds and every value is an object, the text is a
    run of whole elements followed by ``,``, and the values are what ``json`` reads element by element
    (orjson vouches for them), so the run is handed over as the one-by-one reading would hand it over.
    Where it fails (a marker inside an element leaves the text unbalanced; text orjson cannot vouch for:
    NaN, big integers, ...), the text up to an earlier marker is tried (half as long each time), and
    the elements of the shortest text that failed are read by ``json``. At most ``_RUN_TRIES`` failed
    tries per buffer: then the rest of the buffer is read by ``json``. Memory: at most the elements of
    one buffer.
    """

    def __init__(self) -> None:
        self.marker: str | None = None
        self.slow_until = 0  # file position before which elements are read one by one
        self.buffer_end = -1  # file position of the end of the buffer the tries were counted in
        self.tries = 0

    def learn(self, reader: _Reader) -> None:
        if self.marker is None:
            brace = reader.text.rfind("}", 0, reader.pos)
            match = _FIRST_KEY.match(reader.text, reader.pos)
            if brace >= 0 and match is not None:
                self.marker = reader.text[brace : match.end()]

    def take(self, reader: _Reader) -> list[dict[str, Any]] | None:
        if self.marker is None or reader.offset + reader.pos < self.slow_until:
            return None
        text, start = reader.text, reader.pos
        if reader.offset + len(text) != self.buffer_end:
            self.buffer_end, self.tries = reader.offset + len(text), _RUN_TRIES
        limit = len(text)
        while True:
            end = text.rfind(self.marker, start, limit) + 1
            if end <= start:
                return None
            run = orjson_loads(b"[" + text[start:end].encode() + b"]")
            if run is not NOT_SURE and all(type(value) is dict for value in run):
                reader.pos = end
                return run  # type: ignore[no-any-return]
            self.tries -= 1
            self.slow_until = reader.offset + end if self.tries > 0 else self.buffer_end
            if self.tries <= 0:
                return None
            limit = start + (end - start) // 2
