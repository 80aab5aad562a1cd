"""Names and locking of a shard's files: labels, paths, discovery, record identity, the lock file.

The lock (:class:`ShardLock`) is an exclusive ``flock`` on ``rollouts-<shard>.lock``, a file that is never
unlinked or replaced, so every writer of a label locks the same inode (unlinking a lock file lets two
holders lock two different files; filelock issue #574). Its content is the token of the writer that opened
the shard last. See :mod:`gym_ray.record.writer` for how the writer uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.errors import ConfigError, UsageError

__all__ = [
    "Identity",
    "ShardLock",
    "ShardPaths",
    "file_sha256",
    "list_shards",
    "record_identity",
    "shard_paths",
    "validate_shard_label",
]

Identity = tuple[int, int]

_LABEL_RE = re.compile(r"[A-Za-z0-9._-]+")
_RESERVED_SUFFIXES = ("_failures", "_materialized_inputs")
_MAX_LABEL = 200
_PREFIX = "rollouts-"
# Longest suffix first, so "_failures.jsonl" is not mistaken for a shard named "x_failures".
_SUFFIXES = (
    "_materialized_inputs.jsonl",
    "_failures.jsonl",
    ".manifest.json",
    ".progress.json",
    ".jsonl",
    ".lock",
)


def validate_shard_label(shard: str) -> str:
    """Check a shard label and return it.

    A label is 1-200 characters of ``[A-Za-z0-9._-]``, contains no ``..`` and does not end in
    ``_failures`` or ``_materialized_inputs`` (those would name another shard's sidecar files).

    Raises:
        ConfigError: The label is not valid (``key="shard"``).
    """
    problem = None
    if not isinstance(shard, str) or not shard:
        problem = "must be a non-empty string"
    elif len(shard) > _MAX_LABEL:
        problem = f"is {len(shard)} characters long; the limit is {_MAX_LABEL}"
    elif not _LABEL_RE.fullmatch(shard):  # (match() would accept a trailing newline: "$" matches before it)
        problem = "may only contain letters, digits, '.', '_' and '-' (no path separators)"
    elif ".." in shard:
        problem = "must not contain '..'"
    elif shard.endswith(_RESERVED_SUFFIXES):
        problem = "must not end in '_failures' or '_materialized_inputs' (reserved for sidecar files)"
    if problem is not None:
        raise ConfigError(f"shard label {shard!r} {problem}; choose a label like 'shard-0007'", key="shard")
    return shard


@dataclass(frozen=True)
class ShardPaths:
    """The files of one shard in a run folder."""

    run_dir: Path
    shard: str
    successes: Path
    failures: Path
    materialized_inputs: Path
    manifest: Path
    progress: Path
    lock: Path
    attempt_log: Path


def shard_paths(run_dir: str | os.PathLike[str], shard: str) -> ShardPaths:
    """The file paths of shard ``shard`` in ``run_dir`` (nothing is created).

    Raises:
        ConfigError: The label is not valid.
    """
    validate_shard_label(shard)
    base = Path(run_dir)
    stem = f"{_PREFIX}{shard}"
    return ShardPaths(
        run_dir=base,
        shard=shard,
        successes=base / f"{stem}.jsonl",
        failures=base / f"{stem}_failures.jsonl",
        materialized_inputs=base / f"{stem}_materialized_inputs.jsonl",
        manifest=base / f"{stem}.manifest.json",
        progress=base / f"{stem}.progress.json",
        lock=base / f"{stem}.lock",
        attempt_log=base / f"{stem}.attempts.log",
    )


def list_shards(run_dir: str | os.PathLike[str]) -> list[str]:
    """Labels of every shard with at least one file in ``run_dir``, sorted. A missing folder has none."""
    labels: set[str] = set()
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                label = name[len(_PREFIX) : -len(suffix)]
                with contextlib.suppress(ConfigError):
                    labels.add(validate_shard_label(label))
                break
    return sorted(labels)


def record_identity(record: Mapping[str, Any]) -> Identity | None:
    """The resume key ``(_ng_task_index, _ng_rollout_index)`` of a record, or None if either is not an int."""
    task = record.get(keys.TASK_INDEX)
    rollout = record.get(keys.ROLLOUT_INDEX)
    if type(task) is int and type(rollout) is int:
        return (task, rollout)
    return None


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ShardLock:
    """An exclusive cross-process lock on a lock file that is never unlinked or replaced.

    ``flock`` excludes other open file descriptions (other processes, or other ``ShardLock`` objects in
    this process); a ``threading.Lock`` also excludes threads sharing this object. The file's content is
    the token of the writer that opened the shard last.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Prepare a lock on ``path`` (nothing is opened yet)."""
        self.path = Path(path)
        self._fd: int | None = None
        self._mutex = threading.Lock()

    def open(self) -> None:
        """Open (creating if needed) the lock file; the file is never truncated away or unlinked."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @property
    def fd(self) -> int:
        """The open descriptor.

        Raises:
            UsageError: The lock is not open.
        """
        if self._fd is None:
            raise UsageError(f"lock {self.path} is not open; call open() first")
        return self._fd

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the ``with`` block (blocking until it is free)."""
        fd = self.fd
        with self._mutex:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def read_token(self, limit: int = 4096) -> bytes:
        """The lock file's content (at most ``limit`` bytes). Call while holding the lock."""
        return os.pread(self.fd, limit, 0)

    def write_token(self, data: bytes) -> None:
        """Replace the lock file's content with ``data`` in place and fsync. Call while holding the lock."""
        fd = self.fd
        os.ftruncate(fd, 0)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, data[offset:], offset)
        os.fsync(fd)

    def close(self) -> None:
        """Close the descriptor (idempotent). The file stays."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
