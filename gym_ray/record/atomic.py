"""Atomic file replacement: write a temp file in the same folder, fsync it, ``os.replace``, fsync the folder.

Durability promise: after :func:`atomic_write_bytes` (or a clean exit of :func:`atomic_writer`) returns, a
reader sees either the whole new content or, if the process or machine died earlier, the whole old content
(or no file when there was none), never a mix. The temp file is removed when writing fails. A failed
``fsync`` is never retried here: the caller gets the ``OSError`` and decides (the shard writer fails the
shard), because after a failed fsync the kernel may have dropped the dirty pages and a retry could report
success for data that is not on disk.

These helpers raise plain ``OSError``; callers map it to their own error at their boundary.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write_bytes", "atomic_writer", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Fsync a folder so that entries created, renamed or removed in it survive a power loss.

    Args:
        path: The folder.

    Raises:
        OSError: Opening or syncing the folder failed.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(target: Path) -> Path:
    # Same folder as the target, so os.replace is a rename within one file system.
    return target.with_name(f".{target.name}.tmp-{secrets.token_hex(6)}")


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a binary temp file that replaces ``path`` atomically when the ``with`` block exits cleanly.

    On a clean exit the temp file is flushed, fsynced, renamed over ``path`` and the folder is fsynced.
    If the block raises, or any of those steps fails, the temp file is removed and ``path`` is untouched.

    Args:
        path: The file to create or replace. Its folder must exist.

    Yields:
        A writable binary file object.

    Raises:
        OSError: Creating, writing, syncing or renaming failed.
    """
    target = Path(path)
    tmp = _temp_path(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    replaced = False
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        replaced = True
        fsync_dir(target.parent)
    finally:
        if not replaced:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring).

    Args:
        path: The file to create or replace. Its folder must exist.
        data: The whole new content.

    Raises:
        OSError: Creating, writing, syncing or renaming failed; ``path`` is untouched.
    """
    with atomic_writer(path) as handle:
        handle.write(data)
