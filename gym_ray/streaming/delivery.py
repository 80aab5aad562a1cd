"""The stream's delivery side: from finished rollouts to the groups a consumer receives, exactly once.

A :class:`Delivery` holds every rollout row a stream has read and not yet delivered or dropped, in one of
these places: queued or at a worker (counted in ``open``, its group in ``running``), accepted into a
partial group (``partial``), or in a complete group waiting in the buffer (``ready``). Without
``group_size`` every rollout is a group of one.

Rules (see :mod:`gym_ray.streaming.groups` and :mod:`gym_ray.streaming.filters`):

- A finished rollout is stamped with the version it was admitted under (``_ng_policy_version`` on the row
  and on the result). With ``max_staleness`` it is checked when it arrives and again when its group is
  taken for delivery: a stale rollout goes back to the caller to be queued again (head of the queue),
  and ``on_stale(row, outcome)`` sees it first. Its group waits for the re-run.
- A complete group passes the group filters or is dropped (counted by reason); its place is free for
  the next input row.
- :meth:`commit` is the moment of delivery: the delivered rollouts are counted and, with a writer,
  recorded (a success line, or the failure record's line, each with its version). Nothing is recorded
  that was not delivered, so a resumed stream re-runs exactly what was never delivered.

Concurrency: one event loop (the stream's); no awaits inside, so every method is atomic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from gym_ray import keys
from gym_ray.dispatch.outcomes import RolloutFailureRecord
from gym_ray.errors import UsageError
from gym_ray.streaming.filters import GroupFilter, filter_names, filter_verdict
from gym_ray.streaming.groups import Item, RolloutGroup, Row, is_stale, version_of
from gym_ray.streaming.step_stats import StepMeter
from gym_ray.streaming.worker import Outcome, SeqRow

__all__ = ["Delivery", "Ready", "StaleCallback", "refuse_used_record_dir"]

#: ``on_stale(row, outcome)``: sees a stale rollout before its row runs again (to keep it elsewhere).
StaleCallback = Callable[[Row, Outcome], None]
#: A complete group in the buffer, with its group id.
Ready = tuple[int, RolloutGroup]


class Delivery:
    """Partial groups, the buffer of complete groups, staleness and filters (see module docstring).

    Args:
        group_size: Rollouts per group, or None (groups of one, delivered as single items).
        max_staleness: Versions a delivered rollout may lag behind the current one, or None (no bound).
        on_stale: Called with each stale ``(row, outcome)`` before the row is queued again.
        group_filter: One filter or a sequence of them (each ``(group) -> bool``).
        meter: Where drops, staleness and latencies are counted.
        max_rollout_attempts: Attempts of a rollout the server answered with a (non-terminal) failure
            before its failure record is delivered; each retry runs with the next ``_ng_attempt_index``.
        one_version_groups: Deliver only groups whose rollouts all ran under one policy version: when a
            group completes with mixed versions, its members older than the newest run again (counted as
            stale, shown to ``on_stale``) under the current version.
    """

    def __init__(
        self,
        *,
        group_size: int | None,
        max_staleness: int | None,
        on_stale: StaleCallback | None,
        group_filter: GroupFilter | Sequence[GroupFilter] | None,
        meter: StepMeter,
        max_rollout_attempts: int = 1,
        one_version_groups: bool = False,
    ) -> None:
        self.width = group_size or 1
        self.max_rollout_attempts = max_rollout_attempts
        self.one_version_groups = one_version_groups
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        if group_filter is None:
            self.filters: list[GroupFilter] = []
        elif callable(group_filter):
            self.filters = [group_filter]
        else:
            self.filters = list(group_filter)
        self.filter_names = filter_names(self.filters)
        self.meter = meter
        self.writer: Any = None  # a ShardWriter when the stream records
        self.partial: dict[int, dict[int, Item]] = {}
        self.ready: deque[Ready] = deque()
        self.running: set[int] = set()
        self.passed: set[int] = set()  # groups the filters kept, until delivered: never judged twice
        self.open = 0  # rows read and not in ``ready``, delivered, dropped or cancelled
        self.buffered = 0  # rows in ``ready``
        self.delivered = 0

    def open_writer(self, record_dir: str, shard: str, run_id: str, config_identity: str) -> None:
        """Record delivered rollouts in ``record_dir`` from now on, in shard ``shard`` (blocking I/O).

        Raises:
            ShardIOError: A file of the shard could not be opened, repaired or synced.
        """
        from gym_ray.record.writer import ShardWriter

        writer = ShardWriter(record_dir, shard, run_id=run_id, config_identity=config_identity)
        self.writer = writer.open()

    def close_writer(self) -> None:
        """Write the shard's progress file and close it (no-op when not recording). Idempotent."""
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.write_progress()
            finally:
                writer.close()

    def opened(self, gid: int) -> None:
        """The reader queued the ``width`` rows of group ``gid``."""
        self.running.add(gid)
        self.open += self.width

    def accept(self, seq: int, row: Row, outcome: Outcome, version: int, current: int) -> list[SeqRow]:
        """Take one finished rollout; returns the ``(seq, row)`` pairs to queue again: this one when it is
        already stale or a failure with attempts left (``max_rollout_attempts``; the row then carries the
        next attempt index), or, with ``one_version_groups``, the members of the group it completes that
        ran under an older version than the group's newest.

        Raises:
            UsageError: A group filter returned something other than a bool.
        """
        if isinstance(outcome, RolloutFailureRecord) and not outcome.terminal:
            attempt = int(row.get(keys.ATTEMPT_INDEX) or 0) + 1
            if attempt < self.max_rollout_attempts:
                self.meter.count("retried")
                retry = {k: v for k, v in row.items() if k != keys.POLICY_VERSION}
                retry[keys.ATTEMPT_INDEX] = attempt
                return [(seq, retry)]
        row[keys.POLICY_VERSION] = version
        if isinstance(outcome, dict):
            outcome[keys.POLICY_VERSION] = version
        if is_stale(version, current, self.max_staleness):
            return [self._stale(seq, row, outcome)]
        gid, index = divmod(seq, self.width)
        members = self.partial.setdefault(gid, {})
        members[index] = (row, outcome)
        if len(members) == self.width and self.one_version_groups:
            newest = max(version_of(item) for item in members.values())
            older = [i for i, item in members.items() if version_of(item) < newest]
            if older:  # run these again under the current version; the group waits for them
                return [self._stale(gid * self.width + i, *members.pop(i)) for i in sorted(older)]
        if len(members) == self.width:
            del self.partial[gid]
            self.running.discard(gid)
            self.open -= self.width
            group = RolloutGroup(members[i] for i in sorted(members))
            # a group back from a stale re-run was judged already: a filter with side effects (counts,
            # logs) sees each task once
            reason = None if gid in self.passed else filter_verdict(self.filters, self.filter_names, group)
            if reason is None:
                self.passed.add(gid)
                self.ready.append((gid, group))
                self.buffered += self.width
            else:
                self.meter.count("filtered", reason=reason)
        return []

    def take(self, current: int) -> tuple[Ready | None, list[SeqRow]]:
        """The next complete ``(group id, group)`` if none of its rollouts is stale; else ``(None, rows to
        queue again)``.

        Returns ``(None, [])`` when the buffer is empty. A group with stale rollouts goes back to
        ``partial`` (its fresh rollouts kept) until its re-runs arrive.
        """
        if not self.ready:
            return None, []
        gid, group = entry = self.ready.popleft()
        self.buffered -= self.width
        if not any(is_stale(version_of(item), current, self.max_staleness) for item in group):
            self.passed.discard(gid)
            return entry, []
        self.running.add(gid)
        self.open += self.width
        fresh: dict[int, Item] = {}
        requeue: list[SeqRow] = []
        for index, (row, outcome) in enumerate(group):
            if is_stale(version_of((row, outcome)), current, self.max_staleness):
                requeue.append(self._stale(gid * self.width + index, row, outcome))
            else:
                fresh[index] = (row, outcome)
        self.partial[gid] = fresh
        return None, requeue

    def unread(self, entries: Sequence[Ready]) -> None:
        """Put groups taken and not delivered back at the head of the buffer, in their order (a
        cancelled ``next_batch``)."""
        for entry in reversed(entries):
            self.ready.appendleft(entry)
            self.passed.add(entry[0])
            self.buffered += self.width

    def _stale(self, seq: int, row: Row, outcome: Outcome) -> SeqRow:
        self.meter.count("stale")
        if self.on_stale is not None:
            self.on_stale(row, outcome)
        return seq, {k: v for k, v in row.items() if k != keys.POLICY_VERSION}

    def cancel(self, gids: set[int]) -> None:
        """Forget running groups (the caller removed their rows from the queue and the workers)."""
        for gid in gids:
            self.partial.pop(gid, None)
            self.passed.discard(gid)
            if gid in self.running:
                self.running.discard(gid)
                self.open -= self.width

    def commit(self, groups: Sequence[RolloutGroup], current: int) -> None:
        """Deliver ``groups``: count them and record each rollout (when recording)."""
        for group in groups:
            self.delivered += len(group)
            self.meter.delivered(group, current)
            if self.writer is None:
                continue
            for row, outcome in group:
                if isinstance(outcome, RolloutFailureRecord):
                    self.writer.append({**outcome.to_row(), keys.POLICY_VERSION: row[keys.POLICY_VERSION]})
                else:
                    self.writer.append(outcome)

    def clear(self) -> None:
        """Drop every finished, undelivered rollout (a close without drain)."""
        self.ready.clear()
        self.partial.clear()
        self.passed.clear()
        self.buffered = 0

    def drain(self, current: int) -> list[RolloutGroup]:
        """Everything finished and undelivered, once: complete groups, then partial ones (shorter), each
        without its stale rollouts (counted and shown to ``on_stale``, not re-run)."""
        pending = [group for _, group in self.ready]
        pending += [
            RolloutGroup(members[i] for i in sorted(members)) for _, members in sorted(self.partial.items())
        ]
        self.ready.clear()
        self.partial.clear()
        self.buffered = 0
        out = []
        for group in pending:
            fresh = RolloutGroup(
                item for item in group if not is_stale(version_of(item), current, self.max_staleness)
            )
            for row, outcome in group:
                if is_stale(int(row[keys.POLICY_VERSION]), current, self.max_staleness):
                    self._stale(-1, row, outcome)
            if fresh:
                out.append(fresh)
        return out


def refuse_used_record_dir(record_dir: str) -> None:
    """A stream without ``resume=True`` starts a folder afresh: one that already holds shards is refused
    (a second recording in it would add rows nobody asked to re-collect)."""
    from gym_ray.record.shard_files import list_shards

    shards = list_shards(record_dir)
    if shards:
        raise UsageError(
            f"stream: record_dir {record_dir} already holds {len(shards)} recording(s) "
            f"({', '.join(shards)}); pass resume=True to skip what they hold (same input order), or give "
            "a new record_dir"
        )
