"""One shard's part of a merge: read and check its lines, order them, keep what the merge rules keep.

``merge.py`` owns the whole merge; this module holds what it does per shard and per ordered stream of
lines, so that the two ways it combines shards share one reading rule and one keeping rule:

- **Disjoint shards** (the usual case: planning gives each shard a contiguous block of tasks, and a task's
  rollouts, retries and resumed attempts stay in its shard): each shard is reduced on its own
  (:func:`reduce_shard`, in a pool process or in the caller) to the lines it keeps, and the reduced files
  are concatenated in identity order. No line is touched by Python after its shard is reduced.
- **Shards sharing identities**: every shard's ordered lines are merged first, then kept (``merge.py``).

Both apply :func:`keep_lines` to lines in ``(task, rollout, kind, attempt, shard, sequence)`` order, so a
line kept (or dropped, and under which count) does not depend on the way taken. A disjoint shard whose
indices all fit in int64 (every shard gym_ray writes) takes a faster form of the same rules: one packed
integer key per line, sorted, and kept with no per-line Python where nothing is dropped
(:func:`_read_packed`, :func:`_keep_packed`; the same bytes and counts, ``tests/finalize/
test_merge_packed.py``). Where reading costs go (one bench shard of 15,625 lines of 316 bytes, in process,
December 2, loaded machine): reading and splitting ~0.4 us per line, ``orjson.loads`` 1.5-2 (the check that
a line is a JSON object; it also builds the record), keys ~0.6, sorting and writing ~1. Lines covered by a
verified batch of the shard writer's line index (:mod:`gym_ray.record.line_index`) skip ``orjson.loads``
and the per-line keying: a batch's lines come from one split and its keys from ``map`` over the index's key
column (December 2, the same shards in process, loaded machine: 2.3-2.5 us per line for the whole merge
against 5.2-5.7 parsing every line).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import orjson

from gym_ray import keys
from gym_ray.errors import InputError
from gym_ray.record.jsonl import line_batches, parse_record
from gym_ray.record.line_index import NO_PERSIST, TERMINAL, index_blocks
from gym_ray.record.shard_files import shard_paths

SUCCESS, FAILURE = 0, 1
_READ_CHUNK = 1 << 20
_WRITE_BATCH = 4096

#: One line of a shard as the merge orders it: ``(task, rollout, kind, attempt, sequence, terminal, raw)``.
#: ``kind`` is SUCCESS or FAILURE, ``sequence`` the line's place in its shard (successes file first, so it
#: is unique and decides every tie), ``terminal`` the failure's ``_ng_failure_terminal`` flag and ``raw``
#: the line's bytes without their newline. Tuple order is merge order, since ``sequence`` is unique.
Entry = tuple[Any, Any, int, Any, int, bool, bytes]


class Tally:
    """Counts of a merge (or of one shard's part of it); :meth:`add` sums parts."""

    def __init__(self) -> None:
        self.successes = 0
        self.failures = 0
        self.terminal = 0
        self.duplicate_successes = 0
        self.superseded_failures = 0
        self.duplicate_failures = 0
        self.omitted = 0
        self.corrupt = 0

    def add(self, other: Tally) -> None:
        """Add ``other``'s counts to these."""
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


class ShardLines(NamedTuple):
    """A shard's lines that take part in the merge, in merge order, and the lines it skipped."""

    entries: list[Entry]
    corrupt: int
    omitted: int


class Reduced(NamedTuple):
    """One shard reduced on its own: the files of the lines it keeps and their identity range.

    ``span`` is the smallest and the largest ``(task, rollout)`` among the shard's lines (None when it has
    none); ``successes`` / ``failures`` are the kept lines (each ending in ``\\n``).
    """

    span: tuple[tuple[int, int], tuple[int, int]] | None
    successes: Path
    failures: Path
    tally: Tally


def read_shard(base: Path, shard: str) -> ShardLines:
    """Read, check and order the lines of one shard's successes and failures files.

    A line's verdict is ``parse_record``'s (the ``JsonlReader`` rule): a blank line is skipped, a line that
    is not a JSON object is corrupt (counted), a failure line with ``_ng_no_persist`` is an omitted row
    (counted, not an outcome). orjson reads the usual line: it accepts no line ``json.loads`` rejects and
    reads the same values, except integers beyond 64 bits (a float there), so a line whose indices are not
    all integers is read again with ``parse_record``; any line orjson refuses goes to ``parse_record`` too.
    ``tests/finalize/test_merge.py`` checks the verdicts on mutated lines.

    Raises:
        InputError: A record has no integer task/rollout index (names file and line).
    """
    task_key, rollout_key, attempt_key = keys.TASK_INDEX, keys.ROLLOUT_INDEX, keys.ATTEMPT_INDEX
    no_persist_key, terminal_key = keys.NO_PERSIST, keys.FAILURE_TERMINAL
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    paths = shard_paths(base, shard)
    entries: list[Entry] = []
    append = entries.append
    seq = corrupt = omitted = 0
    for kind, path in ((SUCCESS, paths.successes), (FAILURE, paths.failures)):
        is_failure = kind == FAILURE
        line_no = 0
        for lines, _ in line_batches(path, missing_ok=True):
            for raw in lines:
                line_no += 1
                record: dict[str, Any] | None
                if raw[:1] == b"{":
                    try:
                        record = loads(raw)
                    except decode_error:
                        record = parse_record(raw)
                elif raw.strip():
                    record = parse_record(raw)
                else:
                    continue
                if record is None:
                    corrupt += 1
                    continue
                if is_failure and record.get(no_persist_key):
                    omitted += 1
                    continue
                task = record.get(task_key)
                rollout = record.get(rollout_key)
                attempt = record.get(attempt_key, 0)
                if type(task) is not int or type(rollout) is not int or type(attempt) is not int:
                    task, rollout, attempt = _identity_again(raw, record, path, line_no)
                seq += 1
                append(
                    (task, rollout, kind, attempt, seq, is_failure and record.get(terminal_key) is True, raw)
                )
    entries.sort()
    return ShardLines(entries, corrupt, omitted)


def _identity_again(raw: bytes, record: dict[str, Any], path: Path, line_no: int) -> tuple[int, int, int]:
    """``(task, rollout, attempt)`` of a record whose first read gave an index that is not an int.

    orjson reads an integer past 64 bits as a float, so the line is read again by ``parse_record`` (the
    ``json`` rule); a non-integer attempt index counts as 0.

    Raises:
        InputError: The task or rollout index is not an integer (names file and line).
    """
    task_key, rollout_key, attempt_key = keys.TASK_INDEX, keys.ROLLOUT_INDEX, keys.ATTEMPT_INDEX
    record = parse_record(raw) or record
    task, rollout, attempt = (record.get(k) for k in (task_key, rollout_key, attempt_key))
    if type(task) is not int or type(rollout) is not int:
        raise InputError(
            f"{path}:{line_no}: record has no integer {task_key}/{rollout_key} (got "
            f"{task!r}, {rollout!r}), so it cannot be ordered or deduplicated; fix or remove "
            "that line and merge again",
            path=str(path),
            line=line_no,
        )
    return task, rollout, attempt if type(attempt) is int else 0


def reduce_shard(base: Path, shard: str, number: int, tmp: Path) -> Reduced:
    """Keep one shard's lines by the merge rules into two files in ``tmp`` (valid alone when no other
    shard has lines of its identities).

    The usual shard (every index a signed 64-bit value) is read into packed integer keys
    (:func:`_read_packed`) and kept by :func:`_keep_packed`; any other goes the per-entry way
    (:func:`read_shard` and :func:`keep_lines`). Both write the same bytes and counts (``tests/finalize/
    test_merge_packed.py`` compares them). Runs in this process or in a pool process (its arguments and
    result are picklable).

    Raises:
        InputError: A record has no integer task/rollout index (names file and line).
    """
    successes, failures = tmp / f"kept-{number:06d}.jsonl", tmp / f"kept-{number:06d}-failures.jsonl"
    packed = _read_packed(base, shard)
    if packed is not None:
        return _keep_packed(packed, successes, failures)
    lines = read_shard(base, shard)
    tally = Tally()
    with (
        successes.open("wb", buffering=_READ_CHUNK) as out_ok,
        failures.open("wb", buffering=_READ_CHUNK) as out,
    ):
        keep_lines(lines.entries, out_ok, out, tally)
    tally.corrupt, tally.omitted = lines.corrupt, lines.omitted
    if not lines.entries:
        return Reduced(None, successes, failures, tally)
    first, last = lines.entries[0], lines.entries[-1]
    return Reduced(((first[0], first[1]), (last[0], last[1])), successes, failures, tally)


class _Packed(NamedTuple):
    """A shard read by :func:`_read_packed`.

    ``successes`` / ``failures`` hold one key per line: ``((task + 2**63) << 128 | (rollout + 2**63) << 64
    | (attempt + 2**63)) << 64 | sequence``, where ``sequence`` indexes ``raws`` (successes file first, then
    failures; a slot of ``raws`` may hold an omitted row, which has no key). Integer order of the keys is
    ``(task, rollout, attempt, sequence)`` order, and ``key >> 128`` is the identity, equal exactly when
    ``(task, rollout)`` is.
    """

    successes: list[int]
    failures: list[int]
    raws: list[bytes]
    terminal: set[int]
    corrupt: int
    omitted: int


_HALF = 1 << 63
_LOW64 = (1 << 64) - 1
_SEQ_BITS = 64


def _read_packed(base: Path, shard: str) -> _Packed | None:
    """Read, check and key one shard's lines like :func:`read_shard`, or None when an index is outside
    ``[-2**63, 2**63)``.

    Lines in a batch of the writer's line index that verifies (:func:`~gym_ray.record.line_index.
    index_blocks`) take their keys and flags from the index, unparsed, a whole batch at a time (``map``
    over its columns, no per-line Python); every other line is parsed, its verdict :func:`read_shard`'s,
    statement for statement.

    Raises:
        InputError: A record has no integer task/rollout index (names file and line).
    """
    task_key, rollout_key, attempt_key = keys.TASK_INDEX, keys.ROLLOUT_INDEX, keys.ATTEMPT_INDEX
    no_persist_key, terminal_key = keys.NO_PERSIST, keys.FAILURE_TERMINAL
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    from_bytes = int.from_bytes
    half = _HALF
    paths = shard_paths(base, shard)
    success_keys: list[int] = []
    failure_keys: list[int] = []
    raws: list[bytes] = []
    terminal: set[int] = set()
    add_raw = raws.append
    seq = corrupt = omitted = 0
    for kind, path in ((SUCCESS, paths.successes), (FAILURE, paths.failures)):
        is_failure = kind == FAILURE
        key_list = failure_keys if is_failure else success_keys
        add_key = key_list.append
        line_no = 0
        for data, covered, line_keys, flags in index_blocks(path):
            if covered is not None:  # a verified batch of the index: every line a record, keyed
                lines = len(covered)
                raws.extend(covered)
                keyed = map(int.__add__, map(from_bytes, line_keys), range(seq, seq + lines))
                if is_failure and flags.count(0) != lines:
                    dropped = bytes(map(NO_PERSIST.__and__, flags))  # omitted rows: a slot, no key
                    omitted += lines - dropped.count(0)
                    key_list.extend(itertools.compress(keyed, map(operator.not_, dropped)))
                    terminal.update(itertools.compress(range(seq, seq + lines), map(TERMINAL.__and__, flags)))
                else:
                    key_list.extend(keyed)
                seq += lines
                line_no += lines
                continue
            split = data.split(b"\n")
            if not split[-1]:
                split.pop()
            for raw in split:
                line_no += 1
                record: dict[str, Any] | None
                if raw[:1] == b"{":
                    try:
                        record = loads(raw)
                    except decode_error:
                        record = parse_record(raw)
                elif raw.strip():
                    record = parse_record(raw)
                else:
                    continue
                if record is None:
                    corrupt += 1
                    continue
                if is_failure and record.get(no_persist_key):
                    omitted += 1
                    continue
                task = record.get(task_key)
                rollout = record.get(rollout_key)
                attempt = record.get(attempt_key, 0)
                if type(task) is not int or type(rollout) is not int or type(attempt) is not int:
                    task, rollout, attempt = _identity_again(raw, record, path, line_no)
                task += half
                rollout += half
                attempt += half
                if (task | rollout | attempt) >> 64:  # an index outside [-2**63, 2**63)
                    return None
                add_key(((task << 64 | rollout) << 64 | attempt) << 64 | seq)
                add_raw(raw)
                if is_failure and record.get(terminal_key) is True:
                    terminal.add(seq)
                seq += 1
    return _Packed(success_keys, failure_keys, raws, terminal, corrupt, omitted)


def _keep_packed(packed: _Packed, successes_path: Path, failures_path: Path) -> Reduced:
    """:func:`keep_lines` for a packed shard, with the same bytes and counts, into the two files.

    A success is kept when it is its identity's first (keys sorted); a failure when its identity has no
    success and its attempt is not the one kept just before it. Successes and failures are in separate
    lists, so the usual shard (no duplicate success) needs no per-line Python beyond one set and one list.
    """
    seq_bits = _SEQ_BITS
    shift = 64 + seq_bits
    seq_mask = (1 << seq_bits) - 1
    raws, terminal_seqs = packed.raws, packed.terminal
    tally = Tally()
    tally.corrupt, tally.omitted = packed.corrupt, packed.omitted
    success_keys = sorted(packed.successes)
    failure_keys = sorted(packed.failures)
    with_success = {key >> shift for key in success_keys}
    if len(with_success) == len(success_keys):
        kept = success_keys
    else:
        kept = []
        last = -1  # identities are >= 0
        for key in success_keys:
            ident = key >> shift
            if ident != last:
                last = ident
                kept.append(key)
        tally.duplicate_successes = len(success_keys) - len(kept)
    tally.successes = len(kept)
    kept_failures: list[int] = []
    last_attempt = last_terminal = -1
    for key in failure_keys:
        ident = key >> shift
        if ident in with_success:
            tally.superseded_failures += 1
            continue
        attempt = key >> seq_bits
        if attempt == last_attempt:
            tally.duplicate_failures += 1
            continue
        last_attempt = attempt
        kept_failures.append(key)
        if ident != last_terminal and key & seq_mask in terminal_seqs:
            last_terminal = ident
            tally.terminal += 1
    tally.failures = len(kept_failures)
    _write_lines(successes_path, kept, raws, seq_mask)
    _write_lines(failures_path, kept_failures, raws, seq_mask)
    ends = [keys[i] for keys in (success_keys, failure_keys) if keys for i in (0, -1)]
    if not ends:
        return Reduced(None, successes_path, failures_path, tally)
    first, last_ident = min(ends) >> shift, max(ends) >> shift
    span = (
        ((first >> 64) - _HALF, (first & _LOW64) - _HALF),
        ((last_ident >> 64) - _HALF, (last_ident & _LOW64) - _HALF),
    )
    return Reduced(span, successes_path, failures_path, tally)


def _write_lines(path: Path, keys: list[int], raws: list[bytes], seq_mask: int) -> None:
    """Write the lines of ``keys`` (in order), each ending in ``\n``, in batches of ``_WRITE_BATCH``."""
    with path.open("wb") as out:  # buffered: a short write of a large batch is written on, not dropped
        for start in range(0, len(keys), _WRITE_BATCH):
            batch = [raws[key & seq_mask] for key in keys[start : start + _WRITE_BATCH]]
            batch.append(b"")
            out.write(b"\n".join(batch))


def in_identity_order(parts: Iterable[Reduced]) -> list[Reduced] | None:
    """The parts with lines, ordered by identity, when no two of them can share an identity; else None.

    Two parts cannot share one when their spans do not overlap; then concatenating their kept lines in
    this order gives the order and the counts a merge of all their lines would.
    """
    spans = sorted(
        ((part.span, part) for part in parts if part.span is not None), key=lambda pair: pair[0][0]
    )
    if any(before[0][1] >= after[0][0] for before, after in itertools.pairwise(spans)):
        return None
    return [part for _, part in spans]


def keep_lines(entries: Iterable[Entry], out_ok: BinaryIO, out_failed: BinaryIO, tally: Tally) -> None:
    """Write the kept lines of ``entries`` (in merge order), each ending in ``\\n``, and count the rest.

    Per identity ``(task, rollout)``: the first success is kept and later ones are duplicates; without a
    success, each failure attempt is kept once (a repeated attempt is a duplicate) and the identity counts
    as terminal when a kept failure is; with a success, every failure is superseded. Only equality of the
    task, rollout and attempt fields is used, so they may be ints or any equal-comparable encoding.
    """
    ok: list[bytes] = []
    failed: list[bytes] = []
    successes = failures = terminal = dup_successes = superseded = dup_failures = 0
    task: Any = object()
    rollout: Any = None
    last_attempt: Any = None
    has_success = group_terminal = False
    for entry in entries:
        if entry[0] != task or entry[1] != rollout:
            terminal += group_terminal
            task, rollout = entry[0], entry[1]
            has_success = group_terminal = False
            last_attempt = None
        if entry[2] == SUCCESS:
            if has_success:
                dup_successes += 1
                continue
            has_success = True
            successes += 1
            ok.append(entry[6])
            if len(ok) >= _WRITE_BATCH:
                out_ok.write(b"\n".join(ok) + b"\n")
                ok.clear()
        elif has_success:
            superseded += 1
        elif entry[3] == last_attempt:
            dup_failures += 1
        else:
            last_attempt = entry[3]
            failures += 1
            group_terminal = group_terminal or entry[5]
            failed.append(entry[6])
            if len(failed) >= _WRITE_BATCH:
                out_failed.write(b"\n".join(failed) + b"\n")
                failed.clear()
    terminal += group_terminal
    if ok:
        out_ok.write(b"\n".join(ok) + b"\n")
    if failed:
        out_failed.write(b"\n".join(failed) + b"\n")
    tally.successes += successes
    tally.failures += failures
    tally.terminal += terminal
    tally.duplicate_successes += dup_successes
    tally.superseded_failures += superseded
    tally.duplicate_failures += dup_failures
