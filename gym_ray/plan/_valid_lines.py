"""Planning's validation pass over a file (or a byte range of one) as one loop per line (planning speed).

The general form of the pass over an input file is a chain of generators: the file's lines
(:func:`gym_ray.plan.load._load_jsonl_via` or ``_load_jsonl_span``), a stop check
(:func:`~gym_ray.plan.load.until_stopped`) and :func:`gym_ray.plan._validate_pass.count_valid_rows` (number
a common row's task, check its ``(agent, task_source)``; any other row through the general expansion and
check). :func:`count_valid_lines` is that pass as one loop per line, for the case that dominates: no
``limit`` and no knob that rewrites rows. Each step is the general one's, in the same order (read and
check the line, look at the stop, number, check), with the same helpers for anything but the common line
(a block that is not plain, a line orjson refuses, a row of another shape or that the common path does not
take, a row whose canonical text holds ``null``): the same task-numbering lookups are made in the same
order, the same count comes out, and the same errors are raised (``tests/plan/test_valid_lines.py``
compares both forms). A common row's content digest is taken from the sorted text that its duplicate-key
check encoded (as :func:`gym_ray.plan.load.sorted_text` hands it to the general pass).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from gym_ray import keys
from gym_ray._json import _PASSTHROUGH
from gym_ray.config.topology import Topology
from gym_ray.plan import load
from gym_ray.plan._line_flags import PARSE, STAMP_AS_READ, written_as_is
from gym_ray.plan._validate_pass import RowsInvalid, preprocess_knobs
from gym_ray.plan.load import MAX_LINE_BYTES, ReadWrapper, Stopped
from gym_ray.plan.preprocess import TaskNumbering, _Preprocessor
from gym_ray.plan.validation import _Validator

if TYPE_CHECKING:  # the range process imports this module without pydantic
    from gym_ray.config.settings import RunSettings

__all__ = ["count_lines", "count_valid_lines"]

_TASK_ID = keys.TASK_ID
_ENV = keys.ENVIRONMENT_SERVER
_AGENT_REF = keys.AGENT_REF
_PARAMS = keys.RESPONSES_CREATE_PARAMS
_TASK = keys.TASK_INDEX
_ROLLOUT = keys.ROLLOUT_INDEX
_ATTEMPT = keys.ATTEMPT_INDEX
_SOURCE = keys.TASK_SOURCE


def count_valid_lines(
    settings: RunSettings,
    topology: Topology,
    numbering: TaskNumbering,
    *,
    span: tuple[int, int] | None = None,
    wrap_read: ReadWrapper | None = None,
    stop: threading.Event | None = None,
) -> int | None:
    """The rows the run plans from the input file (or bytes ``span`` of it), or None when this loop does not
    apply (no input file, ``limit`` set, or a knob that rewrites rows: nothing was read).

    What ``count_valid_rows(until_stopped(<the file's rows>, stop), settings, topology, numbering)`` gives
    (:func:`gym_ray.plan._validate_pass.count_valid_rows`), the rows read by ``_load_jsonl_via`` (or
    ``_load_jsonl_span`` for ``span``) with ``settings.strict_json`` and ``wrap_read``; the same lookups
    reach ``numbering``, in the same order.

    Raises:
        RowsInvalid: A row does not validate (lookups up to it were made).
        GymRayError: What reading or preprocessing the rows raises (the general pass raises it too).
        Stopped: ``stop`` was set.
    """
    path = settings.input_jsonl_fpath
    if settings.limit or path is None:
        return None
    return count_lines(
        os.fspath(path),
        preprocess_knobs(settings),
        settings.strict_json,
        topology,
        numbering,
        span=span,
        wrap_read=wrap_read,
        stop=stop,
    )


def count_lines(
    name: str,
    knobs: dict[str, Any],
    strict_json: bool,
    topology: Topology,
    numbering: TaskNumbering,
    *,
    span: tuple[int, int] | None = None,
    wrap_read: ReadWrapper | None = None,
    stop: threading.Event | None = None,
) -> int | None:
    """:func:`count_valid_lines` of the file ``name`` (no ``limit``) with the run's preprocessing ``knobs``
    (:func:`~gym_ray.plan._validate_pass.preprocess_knobs`) and ``strict_json``, as plain data (the range
    process gets no settings object); None, nothing read, when a knob rewrites rows."""
    state = _Preprocessor(**knobs, topology=topology, task_numbering=numbering, from_json=True)
    if state.common is None:
        return None
    handle = load._open_input(name)
    with handle:
        read: Callable[[int], bytes]
        if span is None:
            lines_before, read = 0, handle.read
        else:
            lines_before, read = load._span_read(handle, *span)
        if wrap_read is not None:
            read = wrap_read(read)
        return _count(name, read, lines_before, strict_json, state, _Validator(topology), stop)


def _count(
    name: str,
    read: Callable[[int], bytes],
    lines_before: int,
    strict: bool,
    state: _Preprocessor,
    validator: _Validator,
    stop: threading.Event | None,
) -> int:
    common = state.common
    assert common is not None  # checked by the caller
    repeats = common.num_repeats
    task_index, keys_seen, numbering = state.task_index, state.keys_seen, state.task_by_digest
    # Lookups of common rows are handed over a block at a time (in order; before any other lookup)
    add_many: Callable[[list[int]], None] = getattr(numbering, "add_many", None) or _one_by_one(numbering)
    known: dict[tuple[str, str | None], bool] = {}  # flat_row_clean's answer per (agent, task_source)
    # What the planning pass needs of each line, when the numbering records it (a RangeRecorder)
    add_flags: Callable[[bytes], None] | None = getattr(numbering, "add_line_flags", None)
    passthrough, no_flag, stamp_as_read = _PASSTHROUGH, PARSE, STAMP_AS_READ
    expand, clean, check = state.expand, validator.flat_row_clean, validator.check
    loads, decode_error, dumps, sort_keys = (
        orjson.loads,
        orjson.JSONDecodeError,
        orjson.dumps,
        orjson.OPT_SORT_KEYS,
    )
    encode_error = orjson.JSONEncodeError
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    slow, fast_decode, settle = load._SLOW, load._fast_decode, load.settled_row
    bom, digits_as_zero, nineteen = load._BOM, load._DIGITS_AS_ZERO, load._NINETEEN_DIGITS
    max_line, check_every = MAX_LINE_BYTES, load.STOP_CHECK_ROWS
    decoder = load._STRICT_DECODER if strict else load._LENIENT_DECODER
    pos = count = 0
    line_no = lines_before
    text: Any
    for block in load._line_blocks(read, name, max_line, lines_before):
        # as load._read_rows: block-wide scans stand for the per-line ones (no pattern spans a newline)
        plain = nineteen not in block.translate(digits_as_zero) and not (strict and b"\\u003" in block)
        pending: list[int] = []  # the block's lookups not handed over yet
        add = pending.append
        as_is = add_flags is not None and written_as_is(block)
        # a row's sorted text holds "null" only where its line does, or by a \u escape
        null_possible = b"null" in block or b"\\u" in block
        flags = bytearray()
        flag_line = flags.append
        for content in block.split(b"\n"):
            line_no += 1
            if len(content) > max_line:
                raise load._line_error(name, line_no, load._too_long(max_line))
            # the row is read (load._read_rows's steps, load._plain_decode's inline) ...
            fast = content[3:] if line_no == 1 and content.startswith(bom) else content
            text = None  # the row's sorted text when its duplicate-key check encoded it
            same = False  # json's compact text of the row is the line (orjson's, in a block without marks)
            if plain:
                try:
                    row = loads(fast)
                except decode_error:
                    row = slow
                else:
                    if strict:
                        try:
                            text = dumps(row, option=sort_keys)
                        except encode_error:  # nested deeper than orjson writes
                            row = slow
                        else:
                            # the row written back is the line: no key was dropped (a repeated key would be)
                            same = as_is and dumps(row, option=passthrough) == fast
                            if not same and fast.count(b":") != text.count(b":"):
                                row, text = slow, None  # maybe a repeated key: the json decoder names it
            else:
                row = fast_decode(fast, strict)
            row = settle(row, content, name, line_no, decoder)
            # ... the stop is looked at (load.until_stopped's steps) ...
            if stop is not None and not pos % check_every and stop.is_set():
                raise Stopped("stopped")
            # ... the task is numbered (CommonRows._numbered's steps) and the row checked (count_valid_rows's)
            agent = None
            flag = no_flag
            if type(row) is dict and _TASK_ID not in row and _ENV not in row:
                ref = row.get(_AGENT_REF)
                if type(row.get(_PARAMS)) is dict and type(ref) is dict:
                    agent = ref.get("name")
                    if type(agent) is not str or not agent:
                        agent = None
                    else:
                        task = row.get(_TASK)
                        if task is None:
                            if text is not None and not (null_possible and b"null" in text):
                                add(from_bytes(blake2b(text, digest_size=8).digest(), "little"))
                                if same and _TASK not in row and _ROLLOUT not in row:
                                    # the line is json's text of the row: the planning pass stamps it
                                    attempt = row.get(_ATTEMPT)
                                    if type(attempt) is not int or attempt == 0:
                                        flag = stamp_as_read
                            else:  # preprocess's own digest (json's form for a null)
                                if pending:
                                    add_many(pending)
                                    pending.clear()
                                try:
                                    task_index(row)
                                except (TypeError, ValueError):
                                    agent = None  # the general path reports the row
                        elif type(task) is not int or task < 0:
                            agent = None
                        if agent is not None:
                            keys_seen.add(agent)
            flag_line(flag)
            if agent is not None:
                source = row.get(_SOURCE)
                if source is None or type(source) is str:
                    ok = known.get((agent, source))
                    if ok is None:
                        ok = known[agent, source] = clean(agent, source)
                else:
                    ok = False
                if ok:
                    count += repeats
                    pos += 1
                    continue
                raise RowsInvalid(f"row {pos}")  # the general pass names it
            if pending:
                add_many(pending)
                pending.clear()
            for item in expand(pos, row):
                check(count, item)
                count += 1
            pos += 1
        if pending:
            add_many(pending)
        if add_flags is not None:
            add_flags(bytes(flags))
    if stop is not None and stop.is_set():
        raise Stopped("stopped")
    state.finish()
    if validator.found():
        raise RowsInvalid("rows expanded by the general path")
    return count


def _one_by_one(numbering: TaskNumbering) -> Callable[[list[int]], None]:
    """``add_many`` for a numbering that has only ``add``."""
    add = numbering.add

    def add_many(digests: list[int]) -> None:
        for digest in digests:
            add(digest)

    return add_many
