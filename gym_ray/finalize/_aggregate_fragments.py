"""The per-task lists of an ``/aggregate_metrics`` reply, encoded as the metrics file holds them.

``FragmentWriter`` is the callback ``json_stream.iter_object`` hands each element of a streamed list
(``group_level_metrics`` / ``repeat_level_metrics``) to: it encodes the element as NeMo Gym 0.7 writes
its metrics file, ``orjson.dumps(..., option=OPT_INDENT_2)`` (:func:`indented`; NaN and infinity refused as
``json``'s ``allow_nan=False`` refuses them, ``json``'s text only for an integer beyond 64 bits, which
orjson cannot write), shifted to the element's nesting in the metrics file (six spaces), and appends it to
a fragment file (elements separated by ``",\\n"``).

A run of elements that ``json_stream`` read at once with orjson is encoded at once (``on_run``): orjson's
text of the run as one list, indented two more spaces per line, is the elements' own texts joined the
way one-by-one writing joins them; a run orjson cannot encode is written element by element. An element
orjson read cannot hold NaN, infinity or a lone surrogate, so a run raises no error one-by-one writing
would raise.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from gym_ray.errors import ServerResponseError

__all__ = ["STOP_CHECK_ROWS", "FragmentWriter", "Stopped", "indented"]

#: Work run through ``run_joined`` looks at its ``stop`` event once every this many rows.
STOP_CHECK_ROWS = 1024
_BUFFER_BYTES = 1 << 20
#: Nesting of the streamed lists' elements in the metrics file (list > entry > member > element).
_ELEMENT_INDENT = b" " * 6
_SHIFT = b"\n" + _ELEMENT_INDENT
# orjson's list indents its elements by two spaces: four more reach the element's nesting.
_RUN_SHIFT = b"\n" + b" " * 4
_INDENTED = json.JSONEncoder(indent=2, ensure_ascii=False, allow_nan=False)


class Stopped(Exception):
    """Raised by work run through ``run_joined`` when it notices that its caller was cancelled."""


def indented(value: Any) -> bytes:
    """``value`` as NeMo Gym 0.7 writes its metrics file: ``orjson.dumps(value, option=OPT_INDENT_2)``.

    Where orjson cannot encode it (an integer beyond 64 bits, on which 0.7's writer fails), ``json``'s text
    (indent 2, UTF-8).

    Raises:
        ValueError: NaN/infinity (orjson would write ``null``), or a lone surrogate.
    """
    try:
        text = orjson.dumps(value, option=orjson.OPT_INDENT_2)
    except orjson.JSONEncodeError:
        return _INDENTED.encode(value).encode("utf-8")
    if b"null" in text and orjson.loads(text) != value:  # a NaN or infinity became null
        _INDENTED.encode(value)  # raises json's ValueError naming it (allow_nan=False)
    return text


class FragmentWriter:
    """Callback of ``iter_object``: encodes each element (indent 2, shifted) and appends it to a file.

    Args:
        key: the streamed list's name (in error messages).
        path: the fragment file (created on the first element).
        stop: set when the caller was cancelled (``Stopped`` is raised at the next check).
        what: names the reply in error messages.
        hint: what to do, appended to error messages.
    """

    def __init__(self, key: str, path: Path, stop: threading.Event, what: str, hint: str) -> None:
        self.key, self.path, self.stop, self.what, self.hint = key, path, stop, what, hint
        self.handle: BinaryIO | None = None
        self.count = 0
        self.done = False

    def __call__(self, element: dict[str, Any]) -> None:
        """Append one element.

        Raises:
            ServerResponseError: the element is not strict JSON, or the list was already complete.
            Stopped: ``stop`` was set.
        """
        if self.count % STOP_CHECK_ROWS == 0 and self.stop.is_set():
            raise Stopped
        if self.done:
            raise ServerResponseError(f"{self.what} that names {self.key!r} twice; {self.hint}")
        try:
            text = indented(element).replace(b"\n", _SHIFT)
        except ValueError as exc:  # NaN/infinity, or a lone surrogate that UTF-8 cannot encode
            raise ServerResponseError(
                f"{self.what} whose {self.key}[{self.count}] is not strict JSON ({exc}); {self.hint}"
            ) from exc
        self._write(b",\n" + _ELEMENT_INDENT if self.count else _ELEMENT_INDENT, text)
        self.count += 1

    def on_run(self, run: list[dict[str, Any]]) -> None:
        """Append a run of elements orjson read (see the module docstring): the bytes one by one gives.

        Raises:
            ServerResponseError: the list was already complete.
            Stopped: ``stop`` was set.
        """
        if self.stop.is_set():
            raise Stopped
        if self.done:
            raise ServerResponseError(f"{self.what} that names {self.key!r} twice; {self.hint}")
        try:
            text: bytes | None = orjson.dumps(run, option=orjson.OPT_INDENT_2)
        except orjson.JSONEncodeError:  # an integer beyond 64 bits: element by element
            text = None
        if text is None or not run:
            for element in run:
                self(element)
            return
        # "[\n  {...},\n  {...}\n]" -> "      {...},\n      {...}" (inner lines shifted alike)
        self._write(b",\n    " if self.count else b"    ", text[2:-2].replace(b"\n", _RUN_SHIFT))
        self.count += len(run)

    def _write(self, separator: bytes, text: bytes) -> None:
        if self.handle is None:
            self.handle = self.path.open("wb", buffering=_BUFFER_BYTES)
        self.handle.write(separator)
        self.handle.write(text)
