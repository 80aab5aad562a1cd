"""Reading an input file: JSONL rows streamed and checked line by line (PROTOCOL.md section 4).

``load_jsonl`` holds about 64 KiB of whole lines at a time (one longer line at most); every problem is an
:class:`~gym_ray.errors.InputError` naming the file and the 1-based line.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, TypeVar

import orjson

from gym_ray import keys
from gym_ray.errors import InputError
from gym_ray.plan.rows import (
    Row,
    shape_problem,
)

# The row checks moved to gym_ray.plan.validation and gym_ray.plan.rows; they stay importable from here.
__all__ = [
    "MAX_LINE_BYTES",
    "STRICT_JSON_HINT",
    "Stopped",
    "load_jsonl",
    "non_finite_problem",
    "until_stopped",
]

T = TypeVar("T")


#: Longest accepted input line, in bytes (without its newline).
MAX_LINE_BYTES = 64 * 1024 * 1024
#: How to accept what strict JSON refuses (the end of the duplicate-key message).
STRICT_JSON_HINT = "or set strict_json: false (+strict_json=false) to accept it as Python's json does"
#: Why a non-finite number is refused whatever ``strict_json`` says, and what to write instead.
NON_FINITE_HINT = (
    "JSON cannot carry it, so no request body may hold it; write null, a finite number, or a string "
    'such as "NaN" if the server expects one'
)


class _StrictJsonProblem(ValueError):
    """A line that is JSON to Python but not to a JSON reader (raised inside the decoder)."""


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _StrictJsonProblem(
                f"duplicate key {key!r} in one JSON object (a JSON reader keeps only one of the values); "
                f"remove or rename one of them, {STRICT_JSON_HINT}"
            )
        seen.add(key)
    return obj  # pragma: no cover - a shorter dict always has a repeated key


def _refuse_constant(name: str) -> float:
    raise _StrictJsonProblem(f"non-finite number {name} (not JSON); {NON_FINITE_HINT}")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _StrictJsonProblem(
            f"number {text[:40]} overflows a double to infinity (a JSON reader would read Infinity); "
            + NON_FINITE_HINT
        )
    return value


# Both refuse what JSON cannot carry to a server (NaN, infinities, numbers that overflow a double); the
# strict one also refuses a key given twice in one object, which the lenient one reads as json does.
_STRICT_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_object, parse_constant=_refuse_constant, parse_float=_finite_float
)
_LENIENT_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)

_BOM = b"\xef\xbb\xbf"
#: Bytes read at a time; lines are handled a block of whole lines at a time.
_BLOCK_BYTES = 1 << 16
#: Bytes read at a time when counting the lines before a span.
_COUNT_BYTES = 1 << 20
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19
_TASK_ID = keys.TASK_ID
_PARAMS = keys.RESPONSES_CREATE_PARAMS
#: Not a row: the line needs the ``json`` decoder (its errors name the problem).
_SLOW = object()


def _fast_decode(content: bytes, strict_json: bool) -> Any:
    """The line parsed by orjson where that provably equals what the ``json`` decoder gives, else _SLOW.

    Decided from the line's own bytes, never from the shape of orjson's output (which changes between
    orjson versions: 3.11 writes ``1.2345678901234568e+29`` where 3.10 wrote ``1.2345678901234568e29``):

    - a run of 19 or more digits may be an integer past 64 bits, which orjson reads as a float (or
      refuses, depending on its version) where ``json`` reads it exactly: the line goes to ``json``;
      shorter integers fit in 63 bits and every orjson reads them exactly;
    - orjson refuses invalid UTF-8, ``NaN`` / ``Infinity``, numbers that overflow a double and lone
      surrogates: ``json`` then reports them or, lenient, reads them;
    - strict mode refuses duplicate keys, which orjson (like ``json``) reads as the last one: each
      key-value pair has one colon outside strings, and re-encoding drops nothing but duplicates (and what
      they held) while copying every string's colons, so the colon count falls exactly when a key repeats.
      A ``\\u003a`` escape (a colon not written as one) goes to ``json``.
    """
    if _NINETEEN_DIGITS in content.translate(_DIGITS_AS_ZERO):
        return _SLOW  # maybe an integer past 64 bits: json reads it exactly
    try:
        row = orjson.loads(content)
    except orjson.JSONDecodeError:
        return _SLOW
    if strict_json:
        if b"\\u003" in content:
            return _SLOW  # a colon may be escaped: the count below cannot vouch for the keys
        try:
            again = orjson.dumps(row)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes
            return _SLOW
        if content.count(b":") != again.count(b":"):
            return _SLOW  # maybe a repeated key: the json decoder names it
    return row


def non_finite_problem(value: Any, *, at: str = "") -> str | None:
    """What JSON cannot carry in an in-memory row (``nan`` or an infinity anywhere in it), or None.

    Rows passed as Python objects cannot hold a duplicate key, but a float can be ``nan`` or ``inf``,
    which ``json.dumps`` would write as ``NaN`` / ``Infinity``: not JSON, so such a row is refused whatever
    ``strict_json`` says. The message names the place (``score``, ``w[1]``,
    ``responses_create_params.temperature``) and what to do.

    Example:
        >>> non_finite_problem({"score": 0.5, "w": [1.0, 2.0]}) is None
        True
        >>> non_finite_problem({"w": [1.0, float("inf")]}).split(" (")[0]
        'non-finite number inf at w[1]'
    """
    stack: list[tuple[str, Any]] = [(at, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return (
                    f"non-finite number {item!r} at {where or 'the row'} (not JSON); JSON cannot carry it, "
                    'so no request body may hold it; write None, a finite number, or a string such as "nan" '
                    "if the server expects one"
                )
        elif isinstance(item, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def load_jsonl(
    path: str | os.PathLike[str], *, max_line_bytes: int = MAX_LINE_BYTES, strict_json: bool = True
) -> Iterator[Row]:
    """Stream the rows of a JSONL input file, checking each line as it is read.

    Every line must be one JSON object in UTF-8: a flat row with ``responses_create_params`` or a
    materialized task row (``task_id: {taskset, task_id}`` and ``task_input``). A UTF-8 BOM on the first
    line is accepted. About 64 KiB of whole lines is held in memory at a time (or one line up to
    ``max_line_bytes``).

    Args:
        path: The JSONL file.
        max_line_bytes: Longest accepted line in bytes, without its newline (default 64 MiB).
        strict_json: Refuse a key given twice in one object, which Python's ``json`` accepts (the last
            one wins) and JSON leaves undefined. ``False`` accepts it, as ``json.loads`` does. What JSON
            cannot carry to a server (``NaN`` / ``Infinity`` / ``-Infinity``, numbers that overflow a
            double) is refused either way.

    Yields:
        Each row, in file order.

    Raises:
        InputError: The file is missing or unreadable, or a line is blank, malformed JSON (non-finite
            numbers included; duplicate keys unless ``strict_json=False``), not an object, not UTF-8,
            longer than ``max_line_bytes``, or not a valid row. The message and the error's
            ``path``/``line`` attributes give the file and the 1-based line. Raised while iterating, so a
            caller that dispatches only after it has read the whole input dispatches nothing.

    Example:
        >>> rows = list(load_jsonl("tasks.jsonl"))  # doctest: +SKIP
    """
    yield from _load_jsonl_via(path, max_line_bytes=max_line_bytes, strict_json=strict_json)


#: Wraps a file's ``read(size)`` (planning's chunk hashes: :mod:`gym_ray.plan._input_chunks`).
ReadWrapper = Callable[[Callable[[int], bytes]], Callable[[int], bytes]]


def _load_jsonl_via(
    path: str | os.PathLike[str],
    *,
    max_line_bytes: int = MAX_LINE_BYTES,
    strict_json: bool = True,
    wrap_read: ReadWrapper | None = None,
) -> Iterator[Row]:
    """:func:`load_jsonl`, the file's chunks read through ``wrap_read(handle.read)`` when given (planning's
    passes log or check them: the function sees the file opened at byte 0 and must give its bytes)."""
    name = os.fspath(path)
    handle = _open_input(name)
    with handle:
        read = handle.read if wrap_read is None else wrap_read(handle.read)
        yield from _read_rows(read, name, 0, max_line_bytes, strict_json)


class Stopped(Exception):
    """A pass over the input was asked to stop (its caller was cancelled); what it made is not kept."""


#: Rows between two looks at a stop event (at ~20 us a row, a stop is seen within ~20 ms).
STOP_CHECK_ROWS = 1024


def until_stopped(rows: Iterable[T], stop: threading.Event | None) -> Iterable[T]:
    """``rows`` (as is when ``stop`` is None), raising :class:`Stopped` once ``stop`` is set.

    For a pass that runs in a worker thread: a thread cannot be cancelled, so its awaiting caller sets
    ``stop`` when it is cancelled and waits the few milliseconds until the pass sees it.
    """
    return rows if stop is None else _checking(rows, stop)


def _checking(rows: Iterable[T], stop: threading.Event) -> Iterator[T]:
    for count, row in enumerate(rows):
        if not count % STOP_CHECK_ROWS and stop.is_set():
            raise Stopped("stopped")
        yield row
    if stop.is_set():
        raise Stopped("stopped")


def _open_input(name: str) -> BinaryIO:
    """The input file opened for reading bytes, or an :class:`InputError` naming it."""
    try:
        return open(name, "rb")
    except OSError as exc:
        raise InputError(f"cannot open input file '{name}': {exc.strerror}", path=name) from exc


def _load_jsonl_span(
    path: str | os.PathLike[str],
    start: int,
    end: int,
    *,
    max_line_bytes: int,
    strict_json: bool,
    wrap_read: ReadWrapper | None = None,
) -> Iterator[Row]:
    """The rows of bytes ``[start, end)`` of a JSONL file, read and checked as :func:`load_jsonl` does.

    ``start`` is 0 or just after a newline, ``end`` just after a newline or the file's size, so the span
    holds whole lines. Line numbers in errors are the file's own (the newlines before ``start`` are
    counted first), and a BOM is accepted only at the file's start. Planning's parallel validation pass
    (:mod:`gym_ray.plan._parallel_pass`) reads one span per process; ``wrap_read`` wraps the span's
    ``read(size)`` (planning logs a hash of each chunk).
    """
    name = os.fspath(path)
    handle = _open_input(name)
    with handle:
        lines_before, read = _span_read(handle, start, end)
        yield from _read_rows(
            read if wrap_read is None else wrap_read(read), name, lines_before, max_line_bytes, strict_json
        )


def _span_read(handle: BinaryIO, start: int, end: int) -> tuple[int, Callable[[int], bytes]]:
    """``(newlines before start, read)``: the file ``handle`` (opened at byte 0) moved to ``start``, the
    newlines before it counted, and a ``read(size)`` that gives the bytes up to ``end``."""
    lines_before = 0
    while handle.tell() < start:
        block = handle.read(min(_COUNT_BYTES, start - handle.tell()))
        if not block:
            break
        lines_before += block.count(b"\n")
    left = end - start

    def read(size: int) -> bytes:
        nonlocal left
        data = handle.read(min(size, left)) if left > 0 else b""
        left -= len(data)
        return data

    return lines_before, read


def _read_rows(
    read: Callable[[int], bytes], name: str, lines_before: int, max_line_bytes: int, strict_json: bool
) -> Iterator[Row]:
    """:func:`load_jsonl`'s loop over what ``read`` gives, the first line being line ``lines_before + 1``."""
    decoder = _STRICT_DECODER if strict_json else _LENIENT_DECODER
    line_no = lines_before
    for block in _line_blocks(read, name, max_line_bytes, lines_before):
        # Block-wide scans stand for the per-line ones (no pattern spans a newline): without a run of
        # 19 digits orjson reads every integer exactly; without a \u003 escape every colon is written.
        plain = _NINETEEN_DIGITS not in block.translate(_DIGITS_AS_ZERO) and not (
            strict_json and b"\\u003" in block
        )
        for content in block.split(b"\n"):
            line_no += 1
            if len(content) > max_line_bytes:
                raise _line_error(name, line_no, _too_long(max_line_bytes))
            fast = content[3:] if line_no == 1 and content.startswith(_BOM) else content
            row = _plain_decode(fast, strict_json) if plain else _fast_decode(fast, strict_json)
            yield settled_row(row, content, name, line_no, decoder)


def settled_row(row: Any, content: bytes, name: str, line_no: int, decoder: json.JSONDecoder) -> Any:
    """The end of reading line ``line_no`` (``content``) of input ``name``: a row the fast decoders left to
    ``json`` (:data:`_SLOW`) is read by ``decoder``, and a row of any shape but the common flat one is
    checked (:func:`shape_problem`). Every loop that reads input lines ends each line with it.

    Raises:
        InputError: The line is not JSON or not a row (names the file and the line).
    """
    if row is _SLOW:
        row = _slow_decode(content, line_no, decoder, functools.partial(_line_error, name, line_no))
    # a plain flat row (the common shape) has no shape problem: skip the general check
    if type(row) is not dict or _TASK_ID in row or type(row.get(_PARAMS)) is not dict:
        problem = shape_problem(row)
        if problem is not None:
            raise _line_error(name, line_no, f"the row {problem}")
    return row


def _too_long(max_line_bytes: int) -> str:
    return f"line is longer than max_line_bytes={max_line_bytes}; split the row or raise the limit"


def _line_blocks(
    read: Callable[[int], bytes], name: str, max_line_bytes: int, lines_before: int = 0
) -> Iterator[bytes]:
    """Whole lines of what ``read`` gives, about :data:`_BLOCK_BYTES` at a time, joined by newlines (the last
    newline of each block dropped; a last line without one is a block of its own).

    A line is never split between blocks. A line longer than ``max_line_bytes`` is refused (naming it)
    as soon as that many bytes of it are held, so memory stays within one block plus one such line.
    """
    pending: list[bytes] = []
    held = 0
    while True:
        chunk = read(_BLOCK_BYTES)
        if not chunk:
            if pending:
                yield b"".join(pending)
            return
        cut = chunk.rfind(b"\n")
        if cut < 0:
            pending.append(chunk)
            held += len(chunk)
            if held > max_line_bytes:
                raise _line_error(name, lines_before + 1, _too_long(max_line_bytes))
            continue
        pending.append(chunk[:cut])
        block = b"".join(pending)
        lines_before += block.count(b"\n") + 1
        yield block
        rest = chunk[cut + 1 :]
        pending, held = ([rest], len(rest)) if rest else ([], 0)


#: The last row :func:`_plain_decode` checked and its text with sorted keys (the content digest's input:
#: :func:`sorted_text`), so a row is encoded once. One tuple, replaced whole: safe to read from any thread.
_LAST_SORTED: tuple[Any, bytes] = (None, b"")


def sorted_text(row: Any) -> bytes | None:
    """``orjson.dumps(row, option=OPT_SORT_KEYS)`` when ``row`` is the last row :func:`load_jsonl` read with
    ``strict_json`` from a plain block (encoded already for its duplicate-key check), else None.

    The caller must not have changed ``row`` since it was read (planning digests rows it has not touched).
    """
    last = _LAST_SORTED
    return last[1] if last[0] is row else None


def _plain_decode(content: bytes, strict_json: bool) -> Any:
    """:func:`_fast_decode` for a line of a block that holds no run of 19 digits and, strict, no
    ``\\u003`` escape (so only the duplicate-key colon count is left to check). Sorting the keys does not
    change the count: the sorted text is kept for the row's content digest (:func:`sorted_text`)."""
    global _LAST_SORTED
    try:
        row = orjson.loads(content)
    except orjson.JSONDecodeError:
        return _SLOW
    if strict_json:
        try:
            text = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes
            return _SLOW
        if content.count(b":") != text.count(b":"):
            return _SLOW  # maybe a repeated key: the json decoder names it
        _LAST_SORTED = (row, text)
    return row


def _line_error(name: str, line: int, what: str) -> InputError:
    """The error for line ``line`` of input file ``name``."""
    return InputError(f"{name}, line {line}: {what}", path=name, line=line)


def _slow_decode(
    content: bytes, line_no: int, decoder: json.JSONDecoder, fail: Callable[[str], InputError]
) -> Any:
    """A line through the ``json`` decoder: the value, or the InputError ``fail`` builds naming it."""
    try:
        text = content.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise fail(
            f"not valid UTF-8 (byte 0x{content[exc.start]:02x} at offset {exc.start}); "
            "re-encode the file as UTF-8"
        ) from exc
    if not text.strip():
        raise fail("blank line; every line must hold one JSON object (remove the blank line)")
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as exc:
        excerpt = text.strip()[:80]
        raise fail(f"malformed JSON ({exc.msg} at column {exc.colno}): {excerpt!r}") from exc
    except _StrictJsonProblem as exc:
        raise fail(str(exc)) from exc
