"""Quarantine: corrupt lines anywhere in a shard file are moved out, so that their rollouts run again.

A power loss or a hand edit can leave lines that are not records in the *middle* of a shard file, not
only a torn tail (:func:`gym_ray.record.jsonl.repair_torn_tail` handles that). Readers skip such lines,
so the identity they held counts as missing and resume runs it again; but left in place they would keep
the run's ledger at ``corrupt_lines > 0`` for good. :func:`quarantine_corrupt_lines`, called by the shard
writer when it opens a shard (under the shard's lock, with a fresh token, before any append), moves them:

- each corrupt line is appended to ``<file>.quarantine`` (one JSON object per line: ``line``, ``offset``
  and ``length`` in the original file, ``text`` with undecodable bytes escaped, ``quarantined_at``), and
  that file is fsynced;
- then the shard file is rewritten without those lines (temp file in the same folder, fsync,
  ``os.replace``, fsync of the folder). Every record line is kept, byte for byte and in order.

A crash between the two steps leaves the lines in both files; the next open quarantines them again (the
quarantine file may then list a line twice; the shard never loses a record). The ``.quarantine`` name
ends in none of the shard file suffixes, so no reader mistakes it for a shard.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

from gym_ray.record.atomic import fsync_dir
from gym_ray.record.jsonl import parse_record

__all__ = ["QUARANTINE_SUFFIX", "quarantine_corrupt_lines", "quarantine_path"]

logger = logging.getLogger("gym_ray.record.quarantine")

#: Appended to a shard file's name to name its quarantine file.
QUARANTINE_SUFFIX = ".quarantine"


def quarantine_path(path: str | os.PathLike[str]) -> Path:
    """The quarantine file of shard file ``path`` (``rollouts-00001.jsonl.quarantine``)."""
    p = Path(path)
    return p.with_name(p.name + QUARANTINE_SUFFIX)


def quarantine_corrupt_lines(path: str | os.PathLike[str]) -> int:
    """Move every non-blank line of ``path`` that is not a JSON object record to its quarantine file.

    The caller must hold whatever excludes writers of ``path`` (the shard lock) and must not have the
    file open for appending (the file is replaced). A missing file has nothing to repair.

    Returns:
        The number of lines moved (0: the file was not touched).

    Raises:
        OSError: Reading, writing, syncing or replacing failed (the shard file is then unchanged).
    """
    source = Path(path)
    try:
        if not stat.S_ISREG(os.stat(source).st_mode):
            return 0  # a device or pipe: nothing to rewrite (and reading /dev/zero would never end)
    except FileNotFoundError:
        return 0
    if source.is_symlink():
        source = source.resolve()  # rewrite the file itself, keep the link
    corrupt: list[tuple[int, int, bytes]] = []  # (line number, offset, raw line)
    handle = source.open("rb")
    with handle:
        offset = 0
        for number, raw in enumerate(handle, start=1):
            body = raw.rstrip(b"\r\n")
            if body.strip() and parse_record(body) is None:
                corrupt.append((number, offset, raw))
            offset += len(raw)
    if not corrupt:
        return 0
    stamp = time.time()
    entries = b"".join(
        json.dumps(
            {
                "line": number,
                "offset": start,
                "length": len(raw),
                "text": raw.decode("utf-8", errors="backslashreplace"),
                "quarantined_at": stamp,
            }
        ).encode()
        + b"\n"
        for number, start, raw in corrupt
    )
    fd = os.open(quarantine_path(source), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(entries)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    skip = {number for number, _, _ in corrupt}
    temp = source.with_name(f".{source.name}.repair-{os.getpid()}")
    try:
        with source.open("rb") as reader, temp.open("wb") as writer:
            for number, raw in enumerate(reader, start=1):
                if number not in skip:
                    writer.write(raw)
            writer.flush()
            os.fsync(writer.fileno())
        os.replace(temp, source)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(source.parent)
    logger.warning(
        "Moved %d corrupt line(s) (lines %s) of %s to %s; their rollouts run again on resume.",
        len(corrupt),
        ", ".join(str(number) for number, _, _ in corrupt[:10]) + (", ..." if len(corrupt) > 10 else ""),
        source,
        quarantine_path(source).name,
    )
    return len(corrupt)
