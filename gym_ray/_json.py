"""orjson where its result is provably what the stdlib ``json`` module gives; ``json`` everywhere else.

gym_ray's files are defined by ``json`` (compact separators, ``ensure_ascii=False``; the metrics file with
``indent=2``), and its readers by ``json.loads``. (Request bodies are ``json``'s compact form with
``ensure_ascii=True``, what NeMo Gym's client sends: ``dispatch/client.py`` writes them with ``json``.)
orjson is several times faster; where it could differ, the caller falls back to ``json``, so no byte
written and no value read changes:

- **Encoding.** orjson writes floats that Python writes with an exponent (``1e-05``, ``1e+16``) in its own
  form, writes NaN and infinities as ``null``, and serializes a few types ``json`` refuses (it is told to
  pass dataclasses, datetimes and subclasses through, which it then refuses too; a plain ``enum.Enum``
  member is the one thing it still writes where ``json`` raises). Its text is refused when a number in it
  has an exponent, 17 or more integer digits or 4 or more fraction digits, or when it holds a ``null``
  that is not a None; everything else it writes exactly as ``json`` does (strings, escapes, key order,
  integers, floats in positional form). A cheap scan (digits mapped to ``0``: ``0e``, 17 zeros,
  ``0.0000``) finds candidates anywhere in the text, strings included; only then is each candidate's run
  of digits checked to be a number (a token after ``:``, ``,``, ``[`` or a newline; indented, also a
  space), so a string such as a hex id (``resp_6e6a...``) does not send a record to ``json``.
  orjson refuses integers past 64 bits, lone surrogates, non-string keys and circular values: ``json``
  then writes or raises.
- **Decoding.** orjson accepts no text ``json.loads`` refuses, and reads the same values, except integers
  past 64 bits (it reads them as floats): text holding a run of 19 digits goes to ``json``. It refuses
  ``NaN`` / ``Infinity``, overflowing numbers, lone surrogates and invalid UTF-8, which ``json`` then reads
  or refuses with its own message.

``tests/test_json_equivalence.py`` checks both directions against ``json`` on awkward and random values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

__all__ = ["NOT_SURE", "dumps_compact", "dumps_compact_lines", "loads", "orjson_loads", "orjson_text"]

#: What :func:`orjson_loads` returns when the caller must ask ``json``.
NOT_SURE: Any = object()

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789E", b"000000000e")
_UNSURE = (b"0e", b"0" * 17, b"0.0000", b"null")
_PASSTHROUGH = (
    orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
)
_NINETEEN_DIGITS = b"0" * 19
#: Bytes a number's text is made of once digits are mapped to ``0`` (the exponent aside).
_NUMBER_BYTES = b"0.-"
#: What may come right before a number in orjson's compact text: ``:``, ``,``, ``[``, or a newline between
#: the lines of a block (a string cannot hold one unescaped). Indented text adds a space.
_BEFORE_NUMBER = b":,[\n"
_BEFORE_INDENTED_NUMBER = b":,[\n "


def _unsure_number(marked: bytes, option: int = 0) -> bool:
    """Whether orjson's text (``marked``: its digits mapped to ``0``; ``option`` as it was written) holds a
    number ``json`` may write otherwise: an exponent, 17 or more integer digits, 4 or more fraction digits.

    A mark of ``_UNSURE`` (but ``null``) found anywhere is a candidate; it is a number when the run of
    ``0``, ``.`` and ``-`` it sits in starts the text or follows what may come before a number. A mark in
    a string (a hex id such as ``resp_6e6a``) is not, unless the string itself holds something like
    ``:1e5``: such a false alarm only costs a fallback to ``json``.
    """
    before = _BEFORE_INDENTED_NUMBER if option & orjson.OPT_INDENT_2 else _BEFORE_NUMBER
    for mark in (b"0e", _UNSURE[1], b"0.0000"):
        at = marked.find(mark)
        while at != -1:
            start = at
            while start and marked[start - 1] in _NUMBER_BYTES:
                start -= 1
            if not start or marked[start - 1] in before:
                return True
            at = marked.find(mark, at + len(mark))
    return False


def orjson_text(value: Any, option: int = 0) -> bytes | None:
    """orjson's UTF-8 text of ``value`` where it provably equals ``json``'s, else None.

    Args:
        value: The value to encode.
        option: 0 for ``json``'s compact form (``separators=(",", ":")``), ``orjson.OPT_INDENT_2`` for
            ``indent=2``; both with ``ensure_ascii=False``.
    """
    try:
        text = orjson.dumps(value, option=option | _PASSTHROUGH)
    except orjson.JSONEncodeError:
        return None
    marked = text.translate(_DIGITS_AS_ZERO)
    if _unsure_number(marked, option):
        return None
    if b"null" in marked and not _nulls_are_none(text, value):
        return None
    return text


def _nulls_are_none(text: bytes, value: Any) -> bool:
    """Whether every ``null`` in orjson's ``text`` of ``value`` stands for a None (not a NaN or infinity).

    orjson writes NaN and infinities as ``null`` where ``json`` writes ``NaN`` / ``Infinity``. Reading the
    text back and comparing decides it: a float that became ``null`` reads back as None, which equals no
    float, so the values differ exactly when one did. (Every other value orjson writes reads back equal:
    the caller's other marks have already sent exponents and long numbers to ``json``.) Records often
    hold ``null`` (e.g. ``"error": null``); this keeps them on orjson: about 3 us instead of ``json``'s 12.
    """
    try:
        return bool(orjson.loads(text) == value)
    except (orjson.JSONDecodeError, RecursionError):  # pragma: no cover - orjson reads its own text
        return False


def dumps_compact(value: Any) -> bytes:
    """``json.dumps(value, separators=(",", ":"), ensure_ascii=False)`` in UTF-8, byte for byte.

    Raises:
        TypeError: A value is not JSON-serializable (from ``json``).
        ValueError: A circular reference or a lone surrogate (from ``json``).
    """
    text = orjson_text(value)
    return _COMPACT.encode(value).encode("utf-8") if text is None else text


def dumps_compact_lines(values: Sequence[Any]) -> bytes:
    """``dumps_compact(v) + b"\\n"`` for every value, joined: the bytes of a JSONL block.

    orjson encodes the values and one scan of the whole block stands for :func:`orjson_text`'s scan of
    each (no mark spans a newline, so a mark is in the block exactly when it is in one value's text);
    when the block holds a mark, or orjson refuses a value, each value is encoded by :func:`dumps_compact`.

    Raises:
        TypeError / ValueError: As :func:`dumps_compact`.
    """
    try:
        texts = [orjson.dumps(value, option=_PASSTHROUGH) for value in values]
    except orjson.JSONEncodeError:
        return b"".join([dumps_compact(value) + b"\n" for value in values])
    texts.append(b"")
    block = b"\n".join(texts)
    marked = block.translate(_DIGITS_AS_ZERO)
    if b"null" in marked or _unsure_number(marked):
        return b"".join([dumps_compact(value) + b"\n" for value in values])
    return block


def orjson_loads(raw: bytes) -> Any:
    """orjson's reading of ``raw`` where it provably equals ``json.loads``', else :data:`NOT_SURE`.

    :data:`NOT_SURE` covers text ``json`` reads differently or refuses: the caller then calls ``json``,
    which gives its value or its error.
    """
    if _NINETEEN_DIGITS in raw.translate(_DIGITS_AS_ZERO):
        return NOT_SURE
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return NOT_SURE


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``: the same value, or the same error.

    Raises:
        ValueError: ``raw`` is not JSON (``json``'s ``JSONDecodeError`` or ``UnicodeDecodeError``).
    """
    value = orjson_loads(raw)
    return json.loads(raw) if value is NOT_SURE else value
