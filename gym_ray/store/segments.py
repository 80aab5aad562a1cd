"""A shard's records on an object store: immutable segment objects, committed through one head object.

Objects cannot be appended to or locked, so a shard's append-only files (successes, failures, attempt log)
live on the store as *segments*: each holds the lines its writer appended since its last publication.
Which segments count is said by one object per shard, the *head*
(``.gym_ray_shards/<shard>/head.json``)::

    {"epoch": 3, "owner": "host:pid:token",
     "files": {"rollouts-<s>.jsonl": 81234, ...},            # committed bytes of each file
     "segments": [{"key": ".gym_ray_shards/<s>/e000002-s000001.seg",
                   "parts": [["rollouts-<s>.jsonl", 40112], ...]}, ...]}

- **Taking a shard** writes the head with a conditional write (``If-None-Match: *`` for the first owner,
  ``If-Match: <etag read>`` with ``epoch + 1`` for a later one), then rebuilds the shard's local files from
  the committed segments. From then on every earlier owner's commit fails.
- **Publishing** puts a new segment under a key of its own (``e<epoch>-s<seq>``, created only if free),
  then replaces the head with ``If-Match`` on the ETag this writer last wrote. A writer whose shard was
  taken since gets :class:`~gym_ray.errors.ShardLockError`: the store refused its commit, so its segment
  is never read.
- **Reading** a shard (resume, merge, ledger, status) reads the head and exactly the segments it lists.

What a crash leaves: before the segment put, nothing; between the segment put and the head write, an
unlisted segment that no reader reads (its lines run again); after the head write, a committed segment.
Lines written on the writer's disk and not yet published are not on the store: the next owner runs those
rollouts again, as it runs rollouts that were in flight. So no line is counted twice, and none that was
committed is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_ray.errors import ShardLockError
from gym_ray.record.shard_files import ShardLock, shard_paths
from gym_ray.store.objects import ObjectStore, StoreConflict, StoreError

__all__ = ["SHARDS_PREFIX", "ShardHead", "ShardLease", "published_files", "read_head", "restore_shard"]

#: Where the heads and segments live, under the run folder's prefix.
SHARDS_PREFIX = ".gym_ray_shards"
_TAKE_TRIES = 5


def published_files(run_dir: Path, shard: str) -> list[Path]:
    """The shard's append-only files that go to the store as segments, in publication order."""
    paths = shard_paths(run_dir, shard)
    return [paths.successes, paths.failures, paths.attempt_log]


@dataclass
class ShardHead:
    """The parsed head object of one shard (see the module docstring)."""

    epoch: int = 0
    owner: str = ""
    files: dict[str, int] = field(default_factory=dict)
    segments: list[dict[str, Any]] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps(
            {"epoch": self.epoch, "owner": self.owner, "files": self.files, "segments": self.segments},
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, data: bytes, name: str) -> ShardHead:
        try:
            raw = json.loads(data)
            return cls(int(raw["epoch"]), str(raw["owner"]), dict(raw["files"]), list(raw["segments"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{name} is not a shard head gym_ray wrote ({exc})") from exc


def _head_name(shard: str) -> str:
    return f"{SHARDS_PREFIX}/{shard}/head.json"


def read_head(store: ObjectStore, shard: str) -> tuple[ShardHead, str] | None:
    """The shard's head and its ETag, or None when the shard was never taken."""
    got = store.get(_head_name(shard))
    if got is None:
        return None
    return ShardHead.decode(got[0], str(store.url) + "/" + _head_name(shard)), got[1]


def restore_shard(store: ObjectStore, run_dir: Path, shard: str, head: ShardHead | None) -> None:
    """Make the shard's local append-only files hold exactly what ``head`` commits (nothing if None).

    Under the shard's lock with a fresh token, so a local writer of the shard (a zombie in this process's
    folder) fails on its next write; line indexes of the replaced files are removed.
    """
    paths = shard_paths(run_dir, shard)
    run_dir.mkdir(parents=True, exist_ok=True)
    files = published_files(run_dir, shard)
    parts = {path.name: path.with_name(path.name + ".restore") for path in files}
    outs = {name: part.open("wb") for name, part in parts.items()}  # one segment in memory at a time
    try:
        for segment in head.segments if head is not None else ():
            got = store.get(str(segment["key"]))
            if got is None:
                raise StoreError(f"{store.url}: committed segment {segment['key']} is missing from the store")
            data, at = memoryview(got[0]), 0
            for name, length in segment["parts"]:
                outs[name].write(data[at : at + length])
                at += length
    finally:
        for out in outs.values():
            out.close()
    lock = ShardLock(paths.lock)
    lock.open()
    try:
        with lock.held():
            lock.write_token(b"restore:" + secrets.token_hex(8).encode())
            for path in files:
                Path(f"{path}.idx").unlink(missing_ok=True)
                if parts[path.name].stat().st_size:
                    os.replace(parts[path.name], path)
                else:
                    parts[path.name].unlink()
                    path.unlink(missing_ok=True)
    finally:
        lock.close()


class ShardLease:
    """This process's ownership of one shard on the store, and the publication of its new lines.

    Args:
        store: The run folder's store.
        run_dir: This process's local copy of the run folder.
        shard: The shard label.
    """

    def __init__(self, store: ObjectStore, run_dir: Path, shard: str) -> None:
        self.store = store
        self.run_dir = run_dir
        self.shard = shard
        self.head = ShardHead()
        self._etag = ""
        self._seq = 0
        self.published_lines = 0

    def take(self) -> ShardLease:
        """Become the shard's owner on the store and rebuild the local files from what it commits.

        Raises:
            StoreError: The store could not be reached, or other takers kept winning.
        """
        owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"
        current: tuple[ShardHead, str] | None = None  # a shard never taken is the usual case: create first
        for _ in range(_TAKE_TRIES):
            head = current[0] if current else ShardHead()
            mine = ShardHead(head.epoch + 1, owner, dict(head.files), list(head.segments))
            try:
                if current is None:
                    self._etag = self.store.put(_head_name(self.shard), mine.encode(), create=True)
                else:
                    self._etag = self.store.put(_head_name(self.shard), mine.encode(), if_match=current[1])
            except StoreConflict:  # taken before (or by another at this moment): read it, take it from them
                current = read_head(self.store, self.shard)
                continue
            self.head = mine
            restore_shard(self.store, self.run_dir, self.shard, mine)
            return self
        raise StoreError(f"shard {self.shard}: {_TAKE_TRIES} tries to take it on {self.store.url} all raced")

    def publish(self) -> int:
        """Commit the whole lines appended locally since the last publication; returns lines committed.

        Raises:
            ShardLockError: The shard was taken by another owner since: the store refused this commit.
            StoreError: The store could not be written (nothing is committed; a later call retries).
        """
        parts: list[list[Any]] = []
        chunks: list[bytes] = []
        for path in published_files(self.run_dir, self.shard):
            done = self.head.files.get(path.name, 0)
            try:
                with path.open("rb") as f:
                    f.seek(done)
                    data = f.read()
            except FileNotFoundError:
                continue
            data = data[: data.rfind(b"\n") + 1]  # whole lines only; a line being written waits
            if data:
                parts.append([path.name, len(data)])
                chunks.append(data)
        if not chunks:
            return 0
        self._seq += 1
        key = f"{SHARDS_PREFIX}/{self.shard}/e{self.head.epoch:06d}-s{self._seq:06d}.seg"
        self.store.put(key, b"".join(chunks), create=True)
        files = dict(self.head.files)
        for name, length in parts:
            files[name] = files.get(name, 0) + length
        head = ShardHead(
            self.head.epoch, self.head.owner, files, [*self.head.segments, {"key": key, "parts": parts}]
        )
        try:
            self._etag = self.store.put(_head_name(self.shard), head.encode(), if_match=self._etag)
        except StoreConflict as exc:
            with contextlib.suppress(StoreError):
                self.store.delete(key)  # never listed, so never read; removed to keep the folder tidy
            raise ShardLockError(
                f"shard {self.shard}: another writer took the shard on {self.store.url} since this one "
                "did; the store refused this writer's publication (its lines are not recorded)",
                shard=self.shard,
            ) from exc
        self.head = head
        lines = sum(
            chunk.count(b"\n")
            for chunk, (name, _) in zip(chunks, parts, strict=True)
            if "attempts" not in name
        )
        self.published_lines += lines
        return lines
