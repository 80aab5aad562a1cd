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
are parsed only to check them and to read their top-level keys, never re-encoded. A line the shard writer's
line index covers (:mod:`gym_ray.record.line_index`: its bytes and its entry verified together by CRC) is
not parsed: its keys and flags come from the index, the same values parsing gives. Any line the index does
not cover with a verified entry (no index, a shard from an older gym_ray, a torn or stale or lying index)
is parsed, so the output bytes and counts do not depend on the index.

Memory is bounded by one shard (a unit of work), not by the run. Two ways, same bytes and counts:
(a shard reduced while the run went on, :mod:`gym_ray.finalize.merge_ahead`, is taken from there in the
first way when its files are unchanged, and the stored reductions are removed after the merge)

- No two shards share an identity (the usual run: planning gives each shard a contiguous block of tasks,
  and retries and resumed attempts stay in their shard): each shard is read, ordered and kept on its own
  into temp files under ``<run_dir>/.merge-*``, which are then concatenated in identity order. After the
  shards, no line passes through Python again, so the merge scales with the processes sorting shards.
- Otherwise each shard's ordered lines go to a temp file, each line prefixed with an order-preserving text
  encoding of its sort key, and the files are heap-merged as streams (in several passes when there are
  more than ``fan_in`` shards, to bound open files) before the keeping rule runs over the merged stream.
  This way reads every shard a second time (the first way's pass showed they share identities).

Concurrency: the per-shard work (read, order, and in the first way keep) is independent per shard. With
at least two shards and more than ``pool_min_bytes`` of shard data, ``min(workers, shards)`` processes do
it: this one and a ``spawn`` process pool of the others. Every shard is queued on the pool, and this
process takes shards back from the end of the queue (those the pool has not started) and does them itself,
so it works while the pool's processes start; they do not import this process's main script
(:func:`gym_ray._spawn.main_script_not_rerun`). Each process holds one shard at a time, so each is bounded by
one shard. Otherwise this process does every shard. The pool
is owned by the call and shut down (its processes joined) before it returns or raises; only the
interpreter-wide multiprocessing resource tracker, started on first use, outlives it. Either way the
results are taken in shard order, so the output bytes, counts and the error raised (the first failing
shard's, with the same type and message) are the same as in-process.

Durability: each output is written to a temp file, fsynced and renamed into place, so a reader sees the
old or the new file, never a partial one. The two files are replaced one after the other (failures first),
not together. Merging reads the shard files without taking their locks: merge a run once its writers are
done.
"""

from __future__ import annotations

import binascii
import concurrent.futures
import contextlib
import heapq
import itertools
import multiprocessing
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict

from gym_ray._spawn import main_script_not_rerun
from gym_ray.errors import ConfigError, InputError, RecordError
from gym_ray.finalize._merge_shard import (
    Entry,
    Reduced,
    Tally,
    in_identity_order,
    keep_lines,
    read_shard,
    reduce_shard,
)
from gym_ray.finalize.merge_ahead import (
    append_file,
    cached_reduction,
    discard_reductions,
    finish_prefix,
    shards_to_reduce,
)
from gym_ray.record.atomic import atomic_writer
from gym_ray.record.shard_files import list_shards, shard_paths

if TYPE_CHECKING:
    from concurrent.futures import Executor

__all__ = ["POOL_MIN_BYTES", "MergeResult", "merge_shards"]

_T = TypeVar("_T")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_READ_CHUNK = 1 << 20
_RUN_BUFFER = 1 << 18
_WRITE_BATCH = 4096
#: Default ``pool_min_bytes``: below this much shard data, starting worker processes (each imports gym_ray,
#: about half a second) costs more than sorting in this process saves.
POOL_MIN_BYTES = 32 << 20
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


class _Sorted(NamedTuple):
    """What sorting one shard produced: its run (None if it kept no line) and what it skipped."""

    run: _Run | None
    corrupt: int
    omitted: int


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


def merge_shards(
    run_dir: str | os.PathLike[str],
    *,
    output_prefix: str = "rollouts",
    fan_in: int = 64,
    workers: int | None = None,
    pool_min_bytes: int = POOL_MIN_BYTES,
) -> MergeResult:
    """Merge every shard of ``run_dir`` into ``<prefix>.jsonl`` and ``<prefix>_failures.jsonl``.

    See the module docstring for the order, deduplication, durability and concurrency rules. The output
    bytes and counts do not depend on ``workers`` or ``pool_min_bytes``.

    Args:
        run_dir: The run folder.
        output_prefix: Stem of the merged files (``[A-Za-z0-9._-]``).
        fan_in: Most sorted shard files merged at once (>= 2).
        workers: Most processes sorting shards at once (>= 1), this one included; None means the CPUs
            this process may use. When ``min(workers, shards)`` is >= 2 and the shards hold more than
            ``pool_min_bytes``, a pool of ``min(workers, shards) - 1`` processes sorts shards beside this
            one; otherwise shards are sorted in this process.
        pool_min_bytes: Shard bytes (>= 0) above which a process pool is worth its start-up cost.

    Returns:
        Paths and counts.

    Raises:
        InputError: The folder has no shards, or a record has no integer ``_ng_task_index`` /
            ``_ng_rollout_index`` (names file and line).
        ConfigError: ``output_prefix``, ``fan_in``, ``workers`` or ``pool_min_bytes`` is invalid.
        RecordError: Reading or writing failed (each merged file is then its old or its new version), or
            a sorting process died (the merged files are left as they were).

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
    if workers is not None and (type(workers) is not int or workers < 1):
        raise ConfigError(
            f"workers={workers!r} must be an integer >= 1 (1 sorts in this process) or None (one per CPU)",
            key="workers",
        )
    if type(pool_min_bytes) is not int or pool_min_bytes < 0:
        raise ConfigError(
            f"pool_min_bytes={pool_min_bytes!r} must be an integer >= 0 (0 uses the process pool whenever "
            "there are >= 2 workers and shards and any shard data)",
            key="pool_min_bytes",
        )
    base = Path(run_dir)
    shards = list_shards(base)
    if not shards:
        raise InputError(
            f"run folder {base} has no shard files (rollouts-<shard>.*); nothing to merge. Check the path",
            path=str(base),
        )
    successes_path = base / f"{output_prefix}.jsonl"
    failures_path = base / f"{output_prefix}_failures.jsonl"
    try:
        with contextlib.ExitStack() as stack:
            pool: Executor | None = None
            # the shards left to reduce here: those the run did not reduce ahead (merge_ahead)
            pending = shards_to_reduce(base, shards)
            processes = min(_usable_cpus() if workers is None else workers, len(pending))
            if processes >= 2 and _shard_bytes(base, pending) > pool_min_bytes:
                # The pool starts its processes as shards are queued: inside the block, so that none
                # imports this process's main script (in a Ray actor: Ray itself, ~1 s of CPU each).
                stack.enter_context(main_script_not_rerun())
                pool = stack.enter_context(
                    concurrent.futures.ProcessPoolExecutor(
                        max_workers=processes - 1, mp_context=multiprocessing.get_context("spawn")
                    )
                )
            tally = _merge(base, shards, successes_path, failures_path, fan_in, pool)
    except OSError as exc:
        raise RecordError(
            f"merging the shards of {base} failed ({exc}); each merged file is its old or its new version "
            "(they are replaced one after the other, failures first). Fix the cause and merge again"
        ) from exc
    except concurrent.futures.BrokenExecutor as exc:
        raise RecordError(
            f"merging the shards of {base} failed: a shard-sorting process died ({exc}), e.g. killed for "
            "memory; the merged files are unchanged. Merge again, with workers=1 to sort in this process"
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


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _shard_bytes(base: Path, shards: list[str]) -> int:
    """Bytes in the success and failure files of ``shards`` (missing files count 0)."""
    total = 0
    for shard in shards:
        paths = shard_paths(base, shard)
        for path in (paths.successes, paths.failures):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
    return total


def _merge(
    base: Path,
    shards: list[str],
    successes_path: Path,
    failures_path: Path,
    fan_in: int,
    pool: Executor | None,
) -> Tally:
    """Merge by reducing each shard alone when no two shards share an identity, else by the general way."""
    tally = Tally()
    with tempfile.TemporaryDirectory(dir=base, prefix=".merge-") as tmp:
        # the output grown while the run went on, when it is still valid: only the rest is merged here
        done = finish_prefix(base, shards, successes_path, failures_path, _rest_reducer(Path(tmp), pool))
        if done is not None:
            discard_reductions(base)
            return done
        reduced = _each_shard(_reduce_or_reuse, base, shards, Path(tmp), pool)
        kept = in_identity_order(reduced)
        if kept is not None:
            for part in reduced:
                tally.add(part.tally)
            with atomic_writer(successes_path) as out_ok, atomic_writer(failures_path) as out_failed:
                for part in kept:
                    append_file(part.successes, out_ok)
                    append_file(part.failures, out_failed)
            discard_reductions(base)
            return tally
    discard_reductions(base)
    width = _WIDTH
    while True:
        try:
            return _merge_sorted(base, shards, successes_path, failures_path, fan_in, width, pool)
        except _WidthExceeded as exc:
            width = max(exc.needed, 2 * width)


def _rest_reducer(tmp: Path, pool: Executor | None) -> Callable[[Path, list[str]], list[Reduced]]:
    def reduce_rest(base: Path, rest: list[str]) -> list[Reduced]:
        return _each_shard(_reduce_or_reuse, base, rest, tmp, pool)

    return reduce_rest


def _reduce_or_reuse(base: Path, shard: str, number: int, tmp: Path) -> Reduced:
    """The shard's reduction made while the run went on, if still the shard's
    (:mod:`gym_ray.finalize.merge_ahead`), else a new one in ``tmp``."""
    return cached_reduction(base, shard) or reduce_shard(base, shard, number, tmp)


def _merge_sorted(
    base: Path,
    shards: list[str],
    successes_path: Path,
    failures_path: Path,
    fan_in: int,
    width: int,
    pool: Executor | None,
) -> Tally:
    """The general merge, for shards that share identities: each shard's lines are sorted into a temp file
    of key-prefixed lines (indices laid out in ``width`` hex digits), the files heap-merged, then kept.

    Raises:
        _WidthExceeded: Before any output is touched, when an index needs a wider layout.
    """
    tally = Tally()
    with tempfile.TemporaryDirectory(dir=base, prefix=".merge-") as tmp:
        runs: list[_Run] = []
        for sorted_shard in _each_shard(_sort_shard, base, shards, Path(tmp), pool, width):
            tally.corrupt += sorted_shard.corrupt
            tally.omitted += sorted_shard.omitted
            if sorted_shard.run is not None:
                runs.append(sorted_shard.run)
        runs = _reduce_runs(runs, Path(tmp), fan_in)
        with (
            _merged(runs) as lines,
            atomic_writer(successes_path) as out_ok,
            atomic_writer(failures_path) as out_failed,
        ):
            keep_lines(_entries(lines, width), out_ok, out_failed, tally)
    return tally


def _each_shard(
    job: Callable[..., _T], base: Path, shards: list[str], tmp: Path, pool: Executor | None, *args: Any
) -> list[_T]:
    """``job(base, shard, number, tmp, *args)`` for each shard, results in shard order.

    Without a pool, this process runs every job. With one, every job is queued on the pool and this
    process takes them back from the end of the queue (a job the pool has not started can be cancelled)
    and runs them itself, until it reaches one the pool has started: from then on every earlier one is
    the pool's. So this process works while the pool's processes start, and both end about together.

    The first failing shard in shard order raises its error (after an error here, this process takes no
    more jobs; the earlier ones still run, since one of them may fail first). Before this returns or
    raises, every shard job still queued is cancelled and every running one has finished, so none writes
    into ``tmp`` after it is removed.
    """
    if pool is None:
        return [job(base, shard, number, tmp, *args) for number, shard in enumerate(shards)]
    futures = [pool.submit(job, base, shard, number, tmp, *args) for number, shard in enumerate(shards)]
    here: dict[int, _T] = {}
    errors: dict[int, Exception] = {}
    try:
        for number in range(len(shards) - 1, -1, -1):
            if not futures[number].cancel():
                break  # the pool has started it, and (it starts them in order) every earlier one
            try:
                here[number] = job(base, shards[number], number, tmp, *args)
            except Exception as exc:  # raised below in shard order, as the pool's would be
                errors[number] = exc
                break
        results: list[_T] = []
        for number, future in enumerate(futures):
            if number in errors:
                raise errors[number]
            results.append(here[number] if number in here else future.result())
        return results
    finally:
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)


def _hex_digits(value: int) -> int:
    """Hex digits a field needs to hold ``value`` (with a sign bit) in the offset layout."""
    return (value.bit_length() + 4) // 4


def _sort_shard(base: Path, shard: str, number: int, tmp: Path, width: int) -> _Sorted:
    """Write one shard's lines, in merge order, to a temp file of key-prefixed lines.

    Runs in this process or in a pool process (its arguments and result are picklable).

    Raises:
        InputError: A record has no integer task/rollout index (names file and line).
        _WidthExceeded: An index does not fit in ``width`` hex digits.
    """
    pack, hexlify = _KEY16.pack, binascii.hexlify
    lines = read_shard(base, shard)
    keyed: list[bytes] = []
    append = keyed.append
    for task, rollout, kind, attempt, seq, terminal, raw in lines.entries:
        if width == _WIDTH:
            try:
                # struct.error exactly when an index is outside [-_OFFSET, _OFFSET).
                key = hexlify(
                    pack(task + _OFFSET, rollout + _OFFSET, kind, attempt + _OFFSET, number, seq, terminal)
                )
                append(key + raw + b"\n")
                continue
            except struct.error:
                pass
        append(_wide_key(task, rollout, kind, attempt, number, seq, terminal, width) + raw + b"\n")
    if not keyed:
        return _Sorted(None, lines.corrupt, lines.omitted)
    out = tmp / f"shard-{number:06d}.sorted"
    with out.open("wb", buffering=_READ_CHUNK) as handle:
        handle.writelines(keyed)
    return _Sorted(_Run(out, keyed[0], keyed[-1]), lines.corrupt, lines.omitted)


def _wide_key(
    task: int, rollout: int, kind: int, attempt: int, number: int, seq: int, terminal: bool, width: int
) -> bytes:
    """The temp-line key in the ``width``-digit layout (any width, slower than the packed one).

    Raises:
        _WidthExceeded: An index does not fit in ``width`` hex digits.
    """
    needed = max(_hex_digits(task), _hex_digits(rollout), _hex_digits(attempt))
    if needed > width:
        raise _WidthExceeded(needed)
    half = 1 << (4 * width - 1)
    return b"%0*x%0*x%02x%0*x%08x%016x%02x" % (
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


def _entries(lines: Iterable[bytes], width: int) -> Iterator[Entry]:
    """The merged temp ``lines`` as entries for ``keep_lines``: indices as their fixed-width hex text
    (equal exactly when the indices are), the line without its key."""
    ident_end = 2 * width  # task + rollout
    kind_at = ident_end + 1  # low digit of the kind: "0" success, "1" failure
    attempt_end = ident_end + 2 + width
    terminal_at = attempt_end + _SHARD_SEQ_DIGITS + 1  # low digit of the terminal flag
    raw_start = terminal_at + 1
    for line in lines:
        yield (
            line[:width],
            line[width:ident_end],
            line[kind_at] - 48,
            line[ident_end + 2 : attempt_end],
            0,
            line[terminal_at] == 49,
            line[raw_start:-1],
        )
