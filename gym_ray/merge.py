"""Merge a run's shards into ``rollouts.jsonl`` and ``rollouts_failures.jsonl`` (PROTOCOL.md section 5).

Order and deduplication (the merged files are what users consume, so each identity appears once):

- Both files are ordered by ``(task, rollout, attempt)``; ties keep shard-label order, then file order.
- ``rollouts.jsonl``: exactly one success per ``(task, rollout)``: the first in that order (the lowest
  attempt index). Further successes of the same identity are dropped and counted.
- ``rollouts_failures.jsonl``: for identities *without* a success, every failure attempt, one line per
  ``(task, rollout, attempt)`` (a repeated attempt index is a duplicate and is dropped).
  ``MergeResult.terminal_failures`` counts the identities among them with a terminal failure. Failures of an
  identity that has a success are superseded and dropped; they stay in the shard sidecars.
- Omitted rows (``_ng_no_persist``, present only under ``record_omitted_rollouts``) are not outcomes and
  are left out. Corrupt lines and torn tails are skipped and counted.

Each merged line is the shard's line byte for byte (plus ``\n`` when a last line had lost it); records
are parsed only to check them and to read their top-level keys, never re-encoded.

Memory is bounded by one shard (a unit of work), not by the run: each shard is sorted in memory into a
temp file under ``<run_dir>/.merge-*``, then the sorted files are heap-merged as streams (in several
passes when there are more than ``fan_in`` shards, to bound open files). Each temp line starts with an
order-preserving text encoding of its sort key, so sorting and heap-merging compare plain bytes.

Durability: each output is written to a temp file, fsynced and renamed into place, so a reader sees the
old or the new file, never a partial one. The two files are replaced one after the other (failures first),
not together. Merging reads the shard files without taking their locks: merge a run once its writers are
done.
"""

from __future__ import annotations

import binascii
import contextlib
import heapq
import itertools
import os
import re
import stat
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from pydantic import BaseModel, ConfigDict
from pydantic_core import from_json

from gym_ray import keys
from gym_ray._internal.atomic import atomic_writer
from gym_ray._internal.jsonl import parse_record
from gym_ray._internal.shard_files import list_shards, shard_paths
from gym_ray.errors import ConfigError, InputError, RecordError

__all__ = ["MergeResult", "merge_shards"]

_SUCCESS, _FAILURE = 0, 1
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_READ_CHUNK = 1 << 20
_RUN_BUFFER = 1 << 18
_WRITE_BATCH = 4096
# A temp line is the hex of (task, rollout, kind, attempt, shard number, sequence in shard, terminal)
# followed by the shard's line. task, rollout and attempt take ``width`` hex digits each, offset by half
# the range so that negative values sort first; kind (0 = success, 1 = failure) and the terminal flag take
# 2, the shard number 8 and the sequence 16. Fixed widths make byte order equal key order; the terminal
# flag after the unique (shard, sequence) pair never decides an order. Width 16 (signed 64-bit values)
# is packed by _KEY16; a wider value restarts the merge with a wider layout (_WidthExceeded).
_WIDTH = 16
_OFFSET = 1 << 63
_KEY16 = struct.Struct(">QQBQIQB")
_SHARD_SEQ_DIGITS = 24


class _Run(NamedTuple):
    """A sorted temp file with its first and last (smallest and largest) line."""

    path: Path
    first: bytes
    last: bytes


class _WidthExceeded(Exception):
    """A task/rollout/attempt index needs more hex digits than the current layout has."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class MergeResult(BaseModel):
    """What :func:`merge_shards` wrote and dropped."""

    model_config = ConfigDict(frozen=True)

    successes_path: Path
    failures_path: Path
    shards: tuple[str, ...]
    successes: int
    failures: int
    terminal_failures: int
    duplicate_successes_dropped: int
    superseded_failures_dropped: int
    duplicate_failures_dropped: int
    omitted_rows_skipped: int
    corrupt_lines: int


class _Tally:
    def __init__(self) -> None:
        self.successes = 0
        self.failures = 0
        self.terminal = 0
        self.duplicate_successes = 0
        self.superseded_failures = 0
        self.duplicate_failures = 0
        self.omitted = 0
        self.corrupt = 0


def merge_shards(
    run_dir: str | os.PathLike[str], *, output_prefix: str = "rollouts", fan_in: int = 64
) -> MergeResult:
    """Merge every shard of ``run_dir`` into ``<prefix>.jsonl`` and ``<prefix>_failures.jsonl``.

    See the module docstring for the order, deduplication and durability rules.

    Args:
        run_dir: The run folder.
        output_prefix: Stem of the merged files (``[A-Za-z0-9._-]``).
        fan_in: Most sorted shard files merged at once (>= 2).

    Returns:
        Paths and counts.

    Raises:
        InputError: The folder has no shards, or a record has no integer ``_ng_task_index`` /
            ``_ng_rollout_index`` (names file and line).
        ConfigError: ``output_prefix`` or ``fan_in`` is invalid.
        RecordError: Reading or writing failed (the merged files are left as they were).

    Example:
        >>> result = merge_shards("runs/2024-06-01")  # doctest: +SKIP
        >>> result.successes, result.duplicate_successes_dropped  # doctest: +SKIP
        (2000, 0)
    """
    if (
        not isinstance(output_prefix, str)
        or not _PREFIX_RE.match(output_prefix)
        or ".." in output_prefix
        or output_prefix.startswith("rollouts-")
    ):
        raise ConfigError(
            f"output_prefix={output_prefix!r} must be a file stem of letters, digits, '.', '_' and '-' "
            "(no path separators, no '..') that does not start with 'rollouts-' (shard files do); the "
            "default is 'rollouts'",
            key="output_prefix",
        )
    if type(fan_in) is not int or fan_in < 2:
        raise ConfigError(f"fan_in={fan_in!r} must be an integer >= 2", key="fan_in")
    base = Path(run_dir)
    shards = list_shards(base)
    if not shards:
        raise InputError(
            f"run folder {base} has no shard files (rollouts-<shard>.*); nothing to merge. Check the path",
            path=str(base),
        )
    successes_path = base / f"{output_prefix}.jsonl"
    failures_path = base / f"{output_prefix}_failures.jsonl"
    width = _WIDTH
    try:
        while True:
            try:
                tally = _merge(base, shards, successes_path, failures_path, fan_in, width)
            except _WidthExceeded as exc:
                width = max(exc.needed, 2 * width)
                continue
            break
    except OSError as exc:
        raise RecordError(
            f"merging the shards of {base} failed ({exc}); the merged files are unchanged"
        ) from exc
    return MergeResult(
        successes_path=successes_path,
        failures_path=failures_path,
        shards=tuple(shards),
        successes=tally.successes,
        failures=tally.failures,
        terminal_failures=tally.terminal,
        duplicate_successes_dropped=tally.duplicate_successes,
        superseded_failures_dropped=tally.superseded_failures,
        duplicate_failures_dropped=tally.duplicate_failures,
        omitted_rows_skipped=tally.omitted,
        corrupt_lines=tally.corrupt,
    )


def _merge(
    base: Path, shards: list[str], successes_path: Path, failures_path: Path, fan_in: int, width: int
) -> _Tally:
    """One attempt at the merge with indices laid out in ``width`` hex digits.

    Raises:
        _WidthExceeded: Before any output is touched, when an index needs a wider layout.
    """
    tally = _Tally()
    with tempfile.TemporaryDirectory(dir=base, prefix=".merge-") as tmp:
        runs = [
            run
            for number, shard in enumerate(shards)
            if (run := _sort_shard(base, shard, number, Path(tmp), tally, width)) is not None
        ]
        runs = _reduce_runs(runs, Path(tmp), fan_in)
        with (
            _merged(runs) as lines,
            atomic_writer(successes_path) as out_ok,
            atomic_writer(failures_path) as out_failed,
        ):
            _write_merged(lines, out_ok, out_failed, tally, width)
    return tally


def _hex_digits(value: int) -> int:
    """Hex digits a field needs to hold ``value`` (with a sign bit) in the offset layout."""
    return (value.bit_length() + 4) // 4


def _sort_shard(base: Path, shard: str, number: int, tmp: Path, tally: _Tally, width: int) -> _Run | None:
    """Sort one shard's successes and failures into a temp file of key-prefixed lines.

    Raises:
        _WidthExceeded: An index does not fit in ``width`` hex digits.
    """
    half = 1 << (4 * width - 1)
    pack, hexlify = _KEY16.pack, binascii.hexlify
    paths = shard_paths(base, shard)
    entries: list[bytes] = []
    seq = 0
    for kind, path in ((_SUCCESS, paths.successes), (_FAILURE, paths.failures)):
        for line_no, raw in _file_lines(path):
            # parse_record's verdict (the JsonlReader rule), faster for the usual line: pydantic-core's
            # from_json (about twice as fast as json.loads) accepts no line that json.loads rejects (strict
            # UTF-8, no control characters in strings, no trailing data; NaN/Infinity and repeated keys
            # read alike) and reads the same values. Lines it rejects that json.loads accepts (lone
            # surrogate escapes, nesting deeper than its limit) go to parse_record. A line starting with
            # "{" that parses is an object. tests/test_merge.py checks the equivalence on mutated lines.
            if raw[:1] == b"{":
                try:
                    record = from_json(raw)
                except ValueError:
                    record = parse_record(raw)
            elif raw.strip():
                record = parse_record(raw)
            else:
                continue
            if record is None:
                tally.corrupt += 1
                continue
            if kind == _FAILURE and record.get(keys.NO_PERSIST):
                tally.omitted += 1
                continue
            task = record.get(keys.TASK_INDEX)
            rollout = record.get(keys.ROLLOUT_INDEX)
            if type(task) is not int or type(rollout) is not int:
                raise InputError(
                    f"{path}:{line_no}: record has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX} (got "
                    f"{task!r}, {rollout!r}), so it cannot be ordered or deduplicated; fix or remove that "
                    "line and merge again",
                    path=str(path),
                    line=line_no,
                )
            attempt = record.get(keys.ATTEMPT_INDEX)
            if type(attempt) is not int:
                attempt = 0
            terminal = kind == _FAILURE and record.get(keys.FAILURE_TERMINAL) is True
            seq += 1
            if (
                width == _WIDTH
                and -_OFFSET <= task < _OFFSET
                and -_OFFSET <= rollout < _OFFSET
                and -_OFFSET <= attempt < _OFFSET
            ):
                key = hexlify(
                    pack(task + _OFFSET, rollout + _OFFSET, kind, attempt + _OFFSET, number, seq, terminal)
                )
            else:
                needed = max(_hex_digits(task), _hex_digits(rollout), _hex_digits(attempt))
                if needed > width:
                    raise _WidthExceeded(needed)
                key = b"%0*x%0*x%02x%0*x%08x%016x%02x" % (
                    width,
                    task + half,
                    width,
                    rollout + half,
                    kind,
                    width,
                    attempt + half,
                    number,
                    seq,
                    terminal,
                )
            entries.append(key + raw + b"\n")
    if not entries:
        return None
    entries.sort()
    out = tmp / f"shard-{number:06d}.sorted"
    with out.open("wb", buffering=_READ_CHUNK) as handle:
        handle.writelines(entries)
    return _Run(out, entries[0], entries[-1])


def _file_lines(path: Path) -> Iterable[tuple[int, bytes]]:
    """``(line number, line without its newline)`` of the bytes ``path`` has now, like ``JsonlReader``.

    A missing file has no lines; a last line without ``\n`` is yielded as it is.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        remaining = st.st_size if stat.S_ISREG(st.st_mode) else 0
        line_no = 0
        pending = b""
        while remaining > 0:
            chunk = os.read(fd, min(_READ_CHUNK, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            parts = (pending + chunk).split(b"\n")
            pending = parts.pop()
            for part in parts:
                line_no += 1
                yield line_no, part
        if pending:
            yield line_no + 1, pending
    finally:
        os.close(fd)


@contextlib.contextmanager
def _merged(runs: list[_Run]) -> Iterator[Iterator[bytes]]:
    """The lines of the sorted ``runs`` in byte order, which is key order.

    Runs whose line ranges do not overlap (the usual case: planning gives each shard a contiguous block of
    tasks) are simply read one after the other; otherwise they are heap-merged.
    """
    ordered = sorted(runs, key=lambda run: run.first)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(run.path.open("rb", buffering=_RUN_BUFFER)) for run in ordered]
        if all(before.last < after.first for before, after in itertools.pairwise(ordered)):
            yield itertools.chain.from_iterable(handles)
        else:
            yield heapq.merge(*handles)


def _reduce_runs(runs: list[_Run], tmp: Path, fan_in: int) -> list[_Run]:
    """Merge sorted files in groups until at most ``fan_in`` remain (bounds the files open at once)."""
    level = 0
    while len(runs) > fan_in:
        level += 1
        reduced: list[_Run] = []
        for group_no, start in enumerate(range(0, len(runs), fan_in)):
            out = tmp / f"level-{level}-{group_no:06d}.sorted"
            group = runs[start : start + fan_in]
            with _merged(group) as lines, out.open("wb", buffering=_READ_CHUNK) as handle:
                handle.writelines(lines)
            for run in group:
                run.path.unlink()
            reduced.append(_Run(out, min(run.first for run in group), max(run.last for run in group)))
        runs = reduced
    return runs


def _write_merged(
    lines: Iterable[bytes], out_ok: BinaryIO, out_failed: BinaryIO, tally: _Tally, width: int
) -> None:
    """Write the kept lines of the merged temp ``lines`` (in key order) and count what is dropped."""
    ident_end = 2 * width  # task + rollout
    kind_at = ident_end + 1  # low digit of the kind: "0" success, "1" failure
    attempt_end = ident_end + 2 + width
    terminal_at = attempt_end + _SHARD_SEQ_DIGITS + 1  # low digit of the terminal flag
    raw_start = terminal_at + 1
    ok: list[bytes] = []
    failed: list[bytes] = []
    successes = failures = terminal = dup_successes = superseded = dup_failures = 0
    ident = last_attempt = b""
    has_success = group_terminal = False
    for line in lines:
        if not line.startswith(ident) or not ident:
            terminal += group_terminal
            ident = line[:ident_end]
            has_success = group_terminal = False
            last_attempt = b""
        if line[kind_at] == 48:
            if has_success:
                dup_successes += 1
                continue
            has_success = True
            successes += 1
            ok.append(line[raw_start:])
            if len(ok) >= _WRITE_BATCH:
                out_ok.write(b"".join(ok))
                ok.clear()
        elif has_success:
            superseded += 1
        elif (attempt := line[ident_end:attempt_end]) == last_attempt:
            dup_failures += 1
        else:
            last_attempt = attempt
            failures += 1
            group_terminal = group_terminal or line[terminal_at] == 49
            failed.append(line[raw_start:])
            if len(failed) >= _WRITE_BATCH:
                out_failed.write(b"".join(failed))
                failed.clear()
    terminal += group_terminal
    out_ok.write(b"".join(ok))
    out_failed.write(b"".join(failed))
    tally.successes += successes
    tally.failures += failures
    tally.terminal += terminal
    tally.duplicate_successes += dup_successes
    tally.superseded_failures += superseded
    tally.duplicate_failures += dup_failures
