"""A shard's attempt log: which ``(task, rollout, attempt)`` its owners were about to send.

A ``/run`` may reach its server and leave no record: its owner was cancelled, killed, frozen or taken
over while the request was in flight. A server that deduplicates on ``(task, rollout, attempt)`` must not
see that triple again, so the next owner of the shard has to know the attempt index was used. Records
cannot tell it (there is none); this log does.

``rollouts-<shard>.attempts.log`` (``ShardPaths.attempt_log``) holds one line per batch,
``{"sent": [[task, rollout, attempt], ...]}``. Before a shard call sends a row whose identity is not
announced yet, :class:`AttemptAnnouncer` announces that row and the next :data:`ANNOUNCE_ROWS` - 1 rows
of its pending list (rows are sent in that order) through
:meth:`~gym_ray.record.writer.ShardWriter.announce_attempts`: one line written under the shard lock's
token check and fsynced before the request leaves. :func:`sent_attempts` reads the highest attempt
announced per identity, and :func:`gym_ray.plan.resume.plan_resume` runs a pending row with an attempt
index above it (and above its failure records'), so no attempt index is ever sent twice for a rollout.

Promises and trade-offs:

- **Announced before sent, durable.** A row's request leaves only after a line naming its attempt is
  fsynced; a stale writer's announcement is refused (``ShardLockError``) and it sends nothing more. So
  every request an earlier owner sent is in the log the next owner reads after taking the shard over.
- **Conservative.** Rows announced and never sent (the rest of a batch when the call stops, rows
  drained by the dispatch budget after their batch was announced) count as used: their next attempt
  index skips one. A row never announced (never reached the send step, drained before its batch) is not
  bumped. The cap on attempts counts failure records, not indices, so a skipped index costs no attempt.
- **Tolerant reader.** A torn or corrupt line is skipped (the writer fsyncs a line before its rows are
  sent, so a line lost to a crash named rows that were not sent); a folder written before the log
  existed has none and resumes as it did (attempt index = failures so far).
- **Cost.** One locked write and one fsync per :data:`ANNOUNCE_ROWS` rows sent; a dict lookup per send.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.shard_files import Identity, record_identity

__all__ = [
    "ANNOUNCE_ROWS",
    "SENT",
    "Attempt",
    "AttemptAnnouncer",
    "attempt_of",
    "encode_batch",
    "sent_attempts",
]

#: Rows announced per line of the log (one locked write and one fsync each).
ANNOUNCE_ROWS = 256

#: The key of a log line's list of ``[task, rollout, attempt]``.
SENT = "sent"

#: ``(task_index, rollout_index, attempt_index)`` of one request about to be sent.
Attempt = tuple[int, int, int]


def attempt_of(row: dict[str, Any]) -> int:
    """A row's ``_ng_attempt_index`` (0 when absent or not an int)."""
    attempt = row.get(keys.ATTEMPT_INDEX)
    return attempt if type(attempt) is int else 0


def encode_batch(attempts: Sequence[Attempt]) -> bytes:
    """One log line: ``{"sent": [[task, rollout, attempt], ...]}`` and a newline."""
    return json.dumps({SENT: [list(a) for a in attempts]}, separators=(",", ":")).encode() + b"\n"


def sent_attempts(path: Path, wanted: Container[Identity] | None = None) -> dict[Identity, int]:
    """The highest attempt index announced per identity (of ``wanted`` only, when given).

    A missing log is empty; torn and corrupt lines and malformed entries are skipped.
    """
    highest: dict[Identity, int] = {}
    for _, line in JsonlReader(path):
        entries = line.get(SENT)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3 and all(type(v) is int for v in entry)):
                continue
            identity = (entry[0], entry[1])
            if wanted is not None and identity not in wanted:
                continue
            if entry[2] > highest.get(identity, -1):
                highest[identity] = entry[2]
    return highest


class AttemptAnnouncer:
    """The before-send hook of one shard call: announces rows in batches before the first of them is sent.

    Args:
        rows: The call's pending rows, in the order it dispatches them.
        announce: Writes one batch durably (``ShardWriter.announce_attempts``); raises when the shard was
            taken over, so the row is not sent.
        batch: Rows per announcement.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        announce: Callable[[Sequence[Attempt]], None],
        *,
        batch: int = ANNOUNCE_ROWS,
    ) -> None:
        self._rows = rows
        self._announce = announce
        self._batch = max(1, batch)
        self._position: dict[Identity, int] = {}
        for position, row in enumerate(rows):
            identity = record_identity(row)
            if identity is not None:
                self._position.setdefault(identity, position)
        self._next = 0  # rows[:_next] are announced

    def __call__(self, row: dict[str, Any]) -> None:
        """Called just before ``row`` is sent (again, on an infrastructure retry: then a lookup only)."""
        identity = record_identity(row)
        position = None if identity is None else self._position.get(identity)
        if position is None:  # not one of the call's rows: announce it alone
            if identity is not None:
                self._announce([(identity[0], identity[1], attempt_of(row))])
            return
        if position < self._next:
            return
        end = min(len(self._rows), max(position + 1, self._next + self._batch))
        batch: list[Attempt] = []
        for pending in self._rows[self._next : end]:
            pending_identity = record_identity(pending)
            if pending_identity is not None:
                batch.append((pending_identity[0], pending_identity[1], attempt_of(pending)))
        self._announce(batch)
        self._next = end
