"""Merge work done while the run goes on: each finished shard reduced ahead, and the output grown as a prefix.

The costly part of a merge is reading, ordering and keeping each shard's lines
(:func:`~gym_ray.finalize._merge_shard.reduce_shard`); what is left once every shard is reduced is appending
the kept files in identity order (in the kernel, ``copy_file_range``). :func:`reduce_ahead` does the costly
part for one shard as soon as that shard is finished (the coordinator calls it after each accepted shard
report), into ``<run_dir>/.merge-ahead/<shard>/``; :func:`merge_shards` then takes a shard's reduction from
there instead of reducing it again, so the work left after the last rollout is the last shards' and the
appending.

A reduction is used only while it is the shard's: it carries the shard files' identity (size, modification
time in ns, inode, device of the success and failure files) taken before and checked again after reading,
and the merge compares it with the files as they are. A shard written after its reduction (a resume, a
repaired tail, a zombie writer's late line) has other files and is reduced again; a reduction that cannot
be read is ignored. So the merged bytes and counts are what a merge without it writes (tests compare them).

The prefix: shards are contiguous blocks of the input, so the merged output can grow while the run goes on.
:func:`grow_prefix` (the coordinator calls it after each reduction) appends, in plan order, every next shard
whose reduction is stored to ``.merge-ahead/prefix.jsonl`` and ``prefix-failures.jsonl``, fsyncs them and
records the shards in it (with their files' identity, span and counts) and the files' sizes in
``prefix.json`` (atomic replace). :func:`finish_prefix` (called by the final merge) checks the prefix is still
valid (its shards are the run's first, their files unchanged, the rest after it in identity order), appends
the rest, fsyncs and renames the two files to ``rollouts_failures.jsonl`` then ``rollouts.jsonl``. So after
the last rollout only the last shards are read and written; the bytes and counts are a cold merge's. Where
the prefix does not hold (shards that share identities, a shard written again), the merge ignores it.

Crash safety: the prefix is published under another name (``.merge-ahead/prefix.jsonl``) until the end, and
renamed into place only when whole: a reader never sees a half-written ``rollouts.jsonl``. Bytes appended
after the last ``prefix.json`` (a crash mid-append) are cut off before the prefix grows or is finished. A
reduction is written into a temp folder and renamed into place; a killed run's ``.merge-ahead`` is swept at
the next start (``.merge-*``).

Concurrency: one reduction or prefix step at a time (the coordinator runs them one after the other in a
thread); the final merge must start after the last of them returned, and removes the folder when done.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from gym_ray.finalize._merge_shard import Reduced, Tally, in_identity_order, reduce_shard
from gym_ray.record.atomic import atomic_write_bytes, fsync_dir
from gym_ray.record.shard_files import shard_paths

__all__ = [
    "AHEAD_DIR",
    "append_file",
    "cached_reduction",
    "discard_reductions",
    "finish_prefix",
    "grow_prefix",
    "prefix_output",
    "reduce_ahead",
    "shards_to_reduce",
]

#: The folder of the reductions, in the run folder.
AHEAD_DIR = ".merge-ahead"
_META = "reduction.json"
_OK = "kept.jsonl"
_FAILED = "kept-failures.jsonl"
#: The output grown as a prefix: its record (shards in it, their files' identity, span and counts, the two
#: files' sizes) and the two files, which become rollouts.jsonl / rollouts_failures.jsonl at the end.
_PREFIX = "prefix.json"
_PREFIX_OK = "prefix.jsonl"
_PREFIX_FAILED = "prefix-failures.jsonl"
_READ_CHUNK = 1 << 20
_COPY_CHUNK = 1 << 30
#: copy_file_range errors that mean "not between these files": the copy goes on through a buffer.
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF})


def _files_identity(base: Path, shard: str) -> list[list[int] | None]:
    """What identifies the contents of the shard's success and failure files now (None: no such file)."""
    paths = shard_paths(base, shard)
    out: list[list[int] | None] = []
    for path in (paths.successes, paths.failures):
        try:
            st = path.stat()
        except FileNotFoundError:
            out.append(None)
            continue
        out.append([st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev])
    return out


def reduce_ahead(run_dir: str | os.PathLike[str], shard: str) -> bool:
    """Reduce finished shard ``shard`` now, for the final merge to reuse (blocking I/O; see the module).

    Returns:
        True when a reduction was stored; False when the shard's files changed while it was read (nothing
        is stored; the merge reduces the shard itself).

    Raises:
        InputError: A record of the shard has no integer task/rollout index (the merge raises the same).
        OSError: The reduction could not be written (the merge then reduces the shard itself).
    """
    base = Path(run_dir)
    ahead = base / AHEAD_DIR
    ahead.mkdir(exist_ok=True)
    before = _files_identity(base, shard)
    tmp = Path(tempfile.mkdtemp(dir=ahead, prefix=f".{shard}-"))
    try:
        part = reduce_shard(base, shard, 0, tmp)
        if _files_identity(base, shard) != before:
            return False
        os.replace(part.successes, tmp / _OK)
        os.replace(part.failures, tmp / _FAILED)
        meta = {"files": before, "span": part.span, "tally": vars(part.tally)}
        (tmp / _META).write_text(json.dumps(meta), encoding="utf-8")
        final = ahead / shard
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def cached_reduction(base: Path, shard: str) -> Reduced | None:
    """The stored reduction of ``shard`` if it is still the shard's (its files unchanged), else None."""
    folder = base / AHEAD_DIR / shard
    try:
        meta: dict[str, Any] = json.loads((folder / _META).read_text(encoding="utf-8"))
        if meta["files"] != _files_identity(base, shard):
            return None
        tally = Tally()
        for name, value in meta["tally"].items():
            if not hasattr(tally, name) or type(value) is not int:
                return None
            setattr(tally, name, value)
        span = meta["span"]
        identity = None if span is None else ((span[0][0], span[0][1]), (span[1][0], span[1][1]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    ok, failed = folder / _OK, folder / _FAILED
    if not (ok.is_file() and failed.is_file()):
        return None
    return Reduced(identity, ok, failed, tally)


def discard_reductions(run_dir: str | os.PathLike[str]) -> None:
    """Remove every stored reduction of ``run_dir`` (after the merge that used them)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(Path(run_dir) / AHEAD_DIR)


def append_file(path: Path, out: BinaryIO) -> None:
    """Append ``path``'s bytes to ``out``: in the kernel (``os.copy_file_range``) where the platform and
    the file systems allow, else through a buffer."""
    out.flush()
    with path.open("rb", buffering=0) as source:
        src, dst = source.fileno(), out.fileno()
        copy_range = getattr(os, "copy_file_range", None)
        if copy_range is not None:
            try:
                while copy_range(src, dst, _COPY_CHUNK):
                    pass
                return
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
        # what copy_file_range copied moved both file offsets, so the buffered copy goes on from there
        while chunk := os.read(src, _READ_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view) :]


Span = tuple[tuple[int, int], tuple[int, int]]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _span_of(value: Any) -> Span | None:
    return None if value is None else ((value[0][0], value[0][1]), (value[1][0], value[1][1]))


def _comes_after(last: Span | None, span: Span | None) -> bool:
    """Whether the lines of ``span`` all come after a prefix whose lines end at ``last`` (None: yes)."""
    return last is None or span is None or last[1] < span[0]


def shards_to_reduce(base: Path, shards: list[str]) -> list[str]:
    """The shards a merge of ``shards`` has to reduce itself: those neither in the prefix (if it holds) nor
    with a valid stored reduction (for sizing its process pool; the merge checks each again)."""
    covered = _prefix_covers(base, shards, _read_json(base / AHEAD_DIR / _PREFIX)) or 0
    return [shard for shard in shards[covered:] if cached_reduction(base, shard) is None]


def _prefix_covers(base: Path, shards: list[str], record: Any) -> int | None:
    """How many of ``shards`` the recorded prefix holds, or None when it does not hold (none recorded, it
    stopped, its shards are not the first of ``shards``, or one's files changed since it went in)."""
    if not record or record["stopped"] or not record["shards"]:
        return None
    entries: list[dict[str, Any]] = record["shards"]
    if shards[: len(entries)] != [e["shard"] for e in entries] or any(
        e["files"] != _files_identity(base, e["shard"]) for e in entries
    ):
        return None
    return len(entries)


def grow_prefix(run_dir: str | os.PathLike[str], planned: Sequence[str]) -> int:
    """Append to the prefix output every next shard, in plan order, whose reduction is stored and still the
    shard's; fsync; record it; drop those reductions. Returns the shards in the prefix now.

    The prefix stops growing for good (its record says so) when a shard's span does not come after the
    prefix's last identity (shards that share identities: the final merge takes the general way) or when
    its files are not as recorded; the final merge then ignores it.
    """
    ahead = Path(run_dir) / AHEAD_DIR
    record = _read_json(ahead / _PREFIX) or {"shards": [], "sizes": [0, 0], "last": None, "stopped": False}
    if record["stopped"]:
        return len(record["shards"])
    shards: list[dict[str, Any]] = record["shards"]
    if list(planned[: len(shards)]) != [entry["shard"] for entry in shards]:
        return len(shards)
    grown = []
    with (ahead / _PREFIX_OK).open("ab") as out_ok, (ahead / _PREFIX_FAILED).open("ab") as out_failed:
        for handle, size in zip((out_ok, out_failed), record["sizes"], strict=True):
            handle.truncate(size)  # bytes appended after the last record (a crash) are not the prefix's
            handle.seek(size)
        for shard in planned[len(shards) :]:
            part = cached_reduction(Path(run_dir), shard)
            if part is None:
                break
            if not _comes_after(_span_of(record["last"]), part.span):
                record["stopped"] = True
                break
            append_file(part.successes, out_ok)
            append_file(part.failures, out_failed)
            meta = _read_json(ahead / shard / _META)
            shards.append(
                {"shard": shard, "files": meta["files"], "span": part.span, "tally": vars(part.tally)}
            )
            record["last"] = part.span if part.span is not None else record["last"]
            grown.append(shard)
        for handle in (out_ok, out_failed):
            handle.flush()
            os.fsync(handle.fileno())
        record["sizes"] = [out_ok.tell(), out_failed.tell()]
    atomic_write_bytes(ahead / _PREFIX, json.dumps(record).encode())
    for shard in grown:
        shutil.rmtree(ahead / shard, ignore_errors=True)
    return len(shards)


def prefix_output(run_dir: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """The prefix output's success file and the size its record vouches for (bytes past it may be a crash's
    and are cut before the prefix grows), or None when there is no prefix or it stopped growing."""
    ahead = Path(run_dir) / AHEAD_DIR
    record = _read_json(ahead / _PREFIX)
    if not record or record["stopped"] or not record["shards"]:
        return None
    return ahead / _PREFIX_OK, int(record["sizes"][0])


def finish_prefix(
    base: Path,
    shards: list[str],
    successes_path: Path,
    failures_path: Path,
    reduce_rest: Callable[[Path, list[str]], list[Reduced]],
) -> Tally | None:
    """Finish the merge from the prefix output grown while the run went on, when it is still valid: its
    shards are the first of ``shards``, with their files as recorded, and the rest come after it in identity
    order. Appends the rest, fsyncs, and renames the two files into place (failures first, as the merge
    does). Returns the merge's counts, or None (nothing touched) when there is no usable prefix.
    """
    ahead = base / AHEAD_DIR
    record = _read_json(ahead / _PREFIX)
    covered = _prefix_covers(base, shards, record)
    if covered is None:
        return None
    entries: list[dict[str, Any]] = record["shards"]
    paths = (ahead / _PREFIX_OK, ahead / _PREFIX_FAILED)
    if any(
        not path.is_file() or path.stat().st_size < size
        for path, size in zip(paths, record["sizes"], strict=True)
    ):
        return None
    rest = reduce_rest(base, shards[len(entries) :])
    kept = in_identity_order(rest)
    if kept is None or (kept and not _comes_after(_span_of(record["last"]), kept[0].span)):
        return None
    tally = Tally()
    for entry in entries:
        for name, value in entry["tally"].items():
            setattr(tally, name, getattr(tally, name) + value)
    for part in rest:
        tally.add(part.tally)
    with paths[0].open("r+b") as out_ok, paths[1].open("r+b") as out_failed:
        for handle, size in zip((out_ok, out_failed), record["sizes"], strict=True):
            handle.truncate(size)
            handle.seek(size)
        for part in kept:
            append_file(part.successes, out_ok)
            append_file(part.failures, out_failed)
        for handle in (out_ok, out_failed):
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(paths[1], failures_path)
    os.replace(paths[0], successes_path)
    fsync_dir(base)
    return tally
