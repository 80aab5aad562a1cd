"""orjson where its result is provably what the stdlib ``json`` module gives; ``json`` everywhere else.

gym_ray's files and wire bytes are defined by ``json`` (compact separators, ``ensure_ascii=False``; the
metrics file with ``indent=2``), and its readers by ``json.loads``. orjson is several times faster; where
it could differ, the caller falls back to ``json``, so no byte written and no value read changes:

- **Encoding.** orjson writes floats that Python writes with an exponent (``1e-05``, ``1e+16``) in its own
  form, writes NaN and infinities as ``null``, and serializes a few types ``json`` refuses (it is told to
  pass dataclasses, datetimes and subclasses through, which it then refuses too; a plain ``enum.Enum``
  member is the one thing it still writes where ``json`` raises). With digits mapped to ``0``, its text is
  refused when it holds ``0e`` (an exponent), 17 zeros (a long number), ``0.0000`` (a small float) or
  ``null``; everything else it writes exactly as ``json`` does (strings, escapes, key order, integers,
  floats in positional form). It refuses integers past 64 bits, lone surrogates, non-string keys and
  circular values: ``json`` then writes or raises.
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
    # one test per mark of _UNSURE, spelled out: a generator over the tuple costs more than the tests
    if b"0e" in marked or _UNSURE[1] in marked or b"0.0000" in marked:
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
    if b"0e" in marked or _UNSURE[1] in marked or b"0.0000" in marked or b"null" in marked:
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
