"""The summary of a run's metrics file: its entries without the per-task lists (what a headline needs).

:func:`read_metrics_summary` reads a metrics file as a stream. The summary of the file this process wrote
last is kept under the file's identity (device, inode, size, mtime) and returned without reading it; a Ray
run's caller adopts its host actor's (:func:`written_summary` there, :func:`adopt_written_summary` here),
so printing a run's headline costs no second read of a file that grows with the number of tasks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gym_ray.errors import InputError, ServerResponseError
from gym_ray.finalize._aggregate_spool import STREAMED_REPLY_KEYS
from gym_ray.finalize.json_stream import iter_array_of_objects
from gym_ray.store import is_store_url

__all__ = [
    "WrittenSummary",
    "adopt_written_summary",
    "forget_written_summary",
    "note_written_summary",
    "read_metrics_summary",
    "written_summary",
]


def read_metrics_summary(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The entries of a metrics file without their per-task lists, read as a stream.

    Each entry is returned as the file holds it, minus ``group_level_metrics`` and
    ``repeat_level_metrics`` (one element per task or repeat: read and dropped element by element), so
    memory does not grow with the number of tasks. Load the file with ``json.load`` for the lists. The
    file this process wrote last, unchanged since (same device, inode, size and mtime), is not read again.

    Raises:
        InputError: the file cannot be read or is not a JSON list of objects (names the file).
    """
    if is_store_url(str(path)):  # a store folder's metrics: as adopted from its coordinator, else fetched
        if _adopted_url is not None and _adopted_url[0] == str(path):
            return list(json.loads(_adopted_url[1]))
        return _read_from_store(str(path))
    file = Path(path)
    written = _last_written
    try:
        if written is not None and written[0] == _identity(file):
            loaded: list[dict[str, Any]] = json.loads(written[1])
            return loaded
        entries = list(
            iter_array_of_objects(
                file,
                skipped=frozenset(STREAMED_REPLY_KEYS),
                what=f"the metrics file {file} holds text",
                hint="run `gym-ray aggregate RUN_DIR CONFIG` to write it again",
            )
        )
    except OSError as exc:
        raise InputError(
            f"cannot read the metrics file {file}: {exc}; run `gym-ray aggregate` to write it again",
            path=str(file),
        ) from exc
    except ServerResponseError as exc:
        raise InputError(str(exc), path=str(file)) from exc
    for entry in entries:
        for key in STREAMED_REPLY_KEYS:
            entry.pop(key, None)
    return entries


#: A metrics file's summary (its entries without the per-task lists, as JSON text) under the file's
#: (device, inode, size, mtime_ns) when it was written.
WrittenSummary = tuple[tuple[int, int, int, int], str]

#: The summary of the metrics file this process wrote (or adopted) last: ``read_metrics_summary`` of that
#: unchanged file returns it without reading the file again.
_last_written: WrittenSummary | None = None


def written_summary() -> WrittenSummary | None:
    """The summary of the metrics file this process wrote last, or None; for :func:`adopt_written_summary`
    in another process (a Ray run's caller takes what its host actor wrote)."""
    return _last_written


#: The summary a store run's coordinator wrote, under the metrics object's URL.
_adopted_url: tuple[str, str] | None = None


def adopt_written_summary(written: WrittenSummary | None, url: str | None = None) -> None:
    """Take ``written`` (from :func:`written_summary` in the process that wrote the file) as this process's
    own: :func:`read_metrics_summary` of that file returns it without reading the file, as long as the
    file's device, inode, size and mtime are those noted when it was written (another node, where the
    shared file system shows other numbers, or a file changed since, reads the file). With ``url`` (the
    metrics object of a folder on an object store, which it uploaded whole) it is that object's summary.
    None does nothing."""
    global _last_written, _adopted_url
    if written is None:
        return
    if url is not None and is_store_url(url):
        _adopted_url = (url, written[1])
    else:
        _last_written = written


def _read_from_store(url: str) -> list[dict[str, Any]]:
    """:func:`read_metrics_summary` of a metrics object: fetched into a temporary file, read as a stream."""
    import tempfile

    from gym_ray.store.objects import ObjectStore

    folder, _, name = url.rpartition("/")
    with tempfile.TemporaryDirectory(prefix="gym-ray-metrics-") as tmp:
        local = Path(tmp) / name
        try:
            ObjectStore(folder).download(name, local)
        except FileNotFoundError as exc:
            message = f"no metrics object {url}; run `gym-ray aggregate` to write it"
            raise InputError(message, path=url) from exc
        return read_metrics_summary(local)


def _identity(path: Path) -> tuple[int, int, int, int]:
    stat = path.stat()
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def note_written_summary(path: Path, summary: str) -> None:
    """Keep ``summary`` (JSON text) as the summary of the metrics file just written at ``path``."""
    global _last_written
    _last_written = (_identity(path), summary)


def forget_written_summary() -> None:
    """Keep no summary (a metrics file is being replaced)."""
    global _last_written
    _last_written = None
