"""Planning's second pass over proven bytes in one loop: read, number and stamp common rows (planning speed).

When the validation pass read the input file, :func:`gym_ray.plan.shards.iter_prepare_run` reads it again
through a :class:`~gym_ray.plan._input_chunks.ChunkCheck` (each chunk proven to be the one validated) and
numbers tasks by order (:meth:`~gym_ray.plan._spill_dedupe.DedupeReplay.trust_bytes`). The general form of
that pass is a chain of generators: the file's lines (:func:`gym_ray.plan.load._load_jsonl_via`), a stop
check (:func:`~gym_ray.plan.load.until_stopped`), preprocessing
(:func:`~gym_ray.plan.preprocess.iter_preprocess` with its common-row path,
:mod:`gym_ray.plan._common_rows`). :func:`proven_rows` is the same pass as one loop per line, for the
case that dominates: no ``limit`` and no knob that rewrites rows. Each step is the general one's, in the
same order, with the same helpers for anything but the common line (a block that is not plain, a line
that orjson refuses, a row of another shape or that the common path does not take): the same rows come
out, numbered alike, and the same errors are raised (``tests/plan/test_proven_pass.py`` compares both
forms).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import orjson

from gym_ray import keys
from gym_ray._json import _PASSTHROUGH
from gym_ray.config.settings import RunSettings
from gym_ray.config.topology import Topology
from gym_ray.plan import load
from gym_ray.plan._line_flags import STAMP_AS_READ, LineFlags, written_as_is
from gym_ray.plan._stage import StampedLine
from gym_ray.plan._validate_pass import preprocess_knobs
from gym_ray.plan.load import MAX_LINE_BYTES, ReadWrapper, Stopped
from gym_ray.plan.preprocess import TaskNumbering, _Preprocessor

__all__ = ["proven_rows"]

_TASK_ID = keys.TASK_ID
_ENV = keys.ENVIRONMENT_SERVER
_AGENT_REF = keys.AGENT_REF
_PARAMS = keys.RESPONSES_CREATE_PARAMS
_TASK = keys.TASK_INDEX
_ROLLOUT = keys.ROLLOUT_INDEX
_ATTEMPT = keys.ATTEMPT_INDEX
#: What stamping appends to a row's text (json's compact text: the two keys last, as ``dict(row)`` adds them).
_STAMP = b'%%s,"%s":%%d,"%s":%%d}\n' % (_TASK.encode(), _ROLLOUT.encode())


def proven_rows(
    settings: RunSettings,
    topology: Topology,
    stop: threading.Event | None,
    wrap_read: ReadWrapper,
    numbering: TaskNumbering,
    flags: LineFlags | None = None,
) -> Iterator[dict[str, Any] | StampedLine] | None:
    """The preprocessed rows of the input file read through ``wrap_read``, or None when this loop does not
    apply (``limit`` set, or a knob that rewrites rows: the caller takes the general pass).

    What ``input_rows(settings, topology, None, stop, proven_by=wrap_read)(numbering)`` yields
    (:func:`gym_ray.plan.first_pass.input_rows`), with the same errors; the preprocessing knobs are checked
    at this call, as there. ``flags``: what the validation pass learnt of each line of these very bytes
    (:mod:`gym_ray.plan._line_flags`; ``numbering`` then numbers by order): a line flagged
    :data:`~gym_ray.plan._line_flags.STAMP_AS_READ` is stamped without being parsed again.
    """
    if settings.limit or settings.input_jsonl_fpath is None:
        return None
    state = _Preprocessor(
        **preprocess_knobs(settings), topology=topology, task_numbering=numbering, from_json=True
    )
    if state.common is None:
        return None
    return _rows(os.fspath(settings.input_jsonl_fpath), wrap_read, state, stop, flags)


def _rows(
    name: str,
    wrap_read: ReadWrapper,
    state: _Preprocessor,
    stop: threading.Event | None,
    flags: LineFlags | None,
) -> Iterator[dict[str, Any] | StampedLine]:
    common = state.common
    assert common is not None  # checked by the caller
    repeats = common.num_repeats
    task_index, take, keys_seen = state.number, state.next_rollout.take, state.keys_seen
    expand = state.expand
    loads, decode_error, written_as_read = orjson.loads, orjson.JSONDecodeError, _written_as_read
    slow, fast_decode, settle = load._SLOW, load._fast_decode, load.settled_row
    bom, digits_as_zero, nineteen = load._BOM, load._DIGITS_AS_ZERO, load._NINETEEN_DIGITS
    max_line, check_every = MAX_LINE_BYTES, load.STOP_CHECK_ROWS
    decoder = load._LENIENT_DECODER  # proven bytes: read as with strict_json off (pass 1 checked them)
    next_task = state.task_by_digest.add  # flagged lines: numbered by order (the bytes are proven)
    stamp_as_read = STAMP_AS_READ
    pos = line_no = 0
    handle = load._open_input(name)
    with handle:
        for block in load._line_blocks(wrap_read(handle.read), name, max_line, 0):
            lines = block.split(b"\n")
            marks = bytes(len(lines)) if flags is None else flags.take(len(lines))
            if marks.count(stamp_as_read) < len(lines):  # some line is parsed
                plain = nineteen not in block.translate(digits_as_zero)
                as_is = written_as_is(block)
            for content, mark in zip(lines, marks, strict=True):
                line_no += 1
                if len(content) > max_line:
                    raise load._line_error(name, line_no, load._too_long(max_line))
                if mark == stamp_as_read:  # the validation pass's facts: stamp the line read
                    fast = content[3:] if line_no == 1 and content.startswith(bom) else content
                    if stop is not None and not pos % check_every and stop.is_set():
                        raise Stopped("stopped")
                    number = next_task(0)
                    text = fast[:-1]
                    if repeats == 1:
                        rollout = take(number)
                        yield (number, rollout, 0, _STAMP % (text, number, rollout))
                    else:
                        for _ in range(repeats):
                            rollout = take(number)
                            yield (number, rollout, 0, _STAMP % (text, number, rollout))
                    pos += 1
                    continue
                # the row is read (load._read_rows's steps) ...
                fast = content[3:] if line_no == 1 and content.startswith(bom) else content
                if plain:
                    try:
                        row = loads(fast)
                    except decode_error:
                        row = slow
                else:
                    row = fast_decode(fast, False)
                row = settle(row, content, name, line_no, decoder)
                # ... the stop is looked at (load.until_stopped's steps) ...
                if stop is not None and not pos % check_every and stop.is_set():
                    raise Stopped("stopped")
                # ... and the row is expanded (CommonRows.expand's steps, else the general path's)
                done = False
                if type(row) is dict and _TASK_ID not in row and _ENV not in row:
                    ref, params = row.get(_AGENT_REF), row.get(_PARAMS)
                    if type(params) is dict and type(ref) is dict:
                        agent = ref.get("name")
                        if type(agent) is str and agent:
                            task = row.get(_TASK)
                            if task is None:
                                try:
                                    task = task_index(row)
                                except (TypeError, ValueError):
                                    task = -1  # the general path reports the row
                            if type(task) is int and task >= 0:
                                keys_seen.add(agent)
                                if (
                                    as_is
                                    and _TASK not in row
                                    and _ROLLOUT not in row
                                    and written_as_read(row, fast)
                                ):
                                    # json's text of the row is the line read: stamp the line, not a copy
                                    attempt = row.get(_ATTEMPT)
                                    attempt = attempt if type(attempt) is int else 0
                                    text = fast[:-1]
                                    if repeats == 1:
                                        rollout = take(task)
                                        yield (task, rollout, attempt, _STAMP % (text, task, rollout))
                                    else:
                                        for _ in range(repeats):
                                            rollout = take(task)
                                            yield (task, rollout, attempt, _STAMP % (text, task, rollout))
                                    pos += 1
                                    continue
                                base = dict(row)
                                base[_PARAMS] = dict(params)
                                base[_TASK] = task
                                if repeats == 1:
                                    base[_ROLLOUT] = take(task)
                                    yield base
                                else:
                                    for _ in range(repeats):
                                        item = dict(base)
                                        item[_ROLLOUT] = take(task)
                                        yield item
                                done = True
                if not done:
                    yield from expand(pos, row)
                pos += 1
    if stop is not None and stop.is_set():
        raise Stopped("stopped")
    state.finish()


def _written_as_read(row: Any, line: bytes) -> bool:
    """Whether orjson's compact text of ``row`` is ``line``; False when orjson cannot write the row (nested
    deeper than it writes: ``json`` then encodes the row's copy)."""
    try:
        return orjson.dumps(row, option=_PASSTHROUGH) == line
    except orjson.JSONEncodeError:
        return False
