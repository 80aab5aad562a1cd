"""Merge work done while the run goes on: each finished shard reduced ahead, reused by the final merge.

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

Crash safety: a reduction is written into a temp folder beside it and renamed into place, so a reader sees a
whole one or none; a crash leaves at most a temp folder, which the next :func:`reduce_ahead` of the shard or
the merge removes. ``rollouts.jsonl`` itself is still published once, atomically, by the final merge: the
reductions are not a prefix of it that a reader could take for the output.

Concurrency: one reduction per shard at a time (the coordinator runs them one after the other in a thread);
the final merge must start after the last :func:`reduce_ahead` returned, and removes the folder when done.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from gym_ray.finalize._merge_shard import Reduced, Tally, reduce_shard
from gym_ray.record.shard_files import shard_paths

__all__ = ["AHEAD_DIR", "cached_reduction", "discard_reductions", "reduce_ahead"]

#: The folder of the reductions, in the run folder.
AHEAD_DIR = ".merge-ahead"
_META = "reduction.json"
_OK = "kept.jsonl"
_FAILED = "kept-failures.jsonl"


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
