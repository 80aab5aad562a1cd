"""The RL controls of a stream: policy versions, pause for weight sync, batches, and the step figures.

:class:`StreamControls` is the part of :class:`~gym_ray.streaming.stream.RolloutStream` a trainer drives
between steps (the stream module keeps the data path: reader, feeders, pullers, workers, closing).

- **Versions.** Every rollout carries the policy version its worker admitted it under
  (``_ng_policy_version`` on the row, on the result and on its recorded line);
  :meth:`~StreamControls.set_policy_version` returns once every worker stamps the new version.
  A :class:`~gym_ray.streaming.groups.RolloutGroup` knows its oldest and newest version.
- **Pause.** :meth:`~StreamControls.pause` stops admission on every worker before it returns: ``drain``
  lets in-flight rollouts finish (still delivered), ``abort`` cancels them (the servers see their handlers
  cancelled) and puts their rows back at the head of their worker's queue, to run first after
  :meth:`~StreamControls.resume`. Finished outcomes can be taken while paused. A worker that replaces a
  dead one starts with the stream's version and pause state.
- **Staleness.** With ``max_staleness=k`` no outcome is delivered whose version is below the version
  current at delivery minus ``k``; its row runs again under the current version (see
  :mod:`gym_ray.streaming.delivery`).
- **Batches.** :meth:`~StreamControls.next_batch` returns the first ``n_groups`` groups to complete; with
  ``oversample`` the reader keeps ``ceil(n_groups * oversample)`` groups running so the slowest do not hold
  the batch; groups still running at the batch's end carry over or are cancelled.
- **Filters** (:mod:`gym_ray.streaming.filters`) drop complete groups; a dropped group's place goes to the
  next input row.

Concurrency: the controls run in the stream's event loop; ``pause``, ``resume``, ``set_policy_version``
and a batch's cancellations hold one lock, so they never interleave with each other.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Any, Literal, Protocol

from gym_ray.errors import UsageError
from gym_ray.streaming.delivery import Delivery, Ready
from gym_ray.streaming.step_stats import StepMeter, StreamStats
from gym_ray.streaming.worker import SeqRow

__all__ = ["StreamControls"]


class _Host(Protocol):
    """What the controls need of the stream they are part of."""

    _state: str
    _slots: list[Any]
    _queue: deque[SeqRow]
    _version: int
    _paused: bool
    _group_budget: int | None
    _run_ahead: int | None
    _oversample: float
    _wanted: int
    _delivered_at_version: int
    _held: int
    _group_size: int | None
    _error: BaseException | None
    _meter: StepMeter
    _delivery: Delivery
    _control_lock: asyncio.Lock
    _source_done: bool
    _read: int
    _skipped: int
    _requeued: int
    _lost: int

    async def start(self) -> None: ...
    async def _shutdown(self, *, drain: bool) -> list[Any]: ...
    def _notify(self) -> None: ...
    async def _wait(self) -> None: ...
    def _take(self) -> Ready | None: ...
    def _finished(self) -> bool: ...
    def _check_open(self, method: str) -> None: ...
    async def _broadcast(self, method: str, *args: Any) -> list[Any]: ...
    async def _cancel_groups(self, gids: set[int]) -> None: ...


class StreamControls:
    """Versions, pause / resume, ``next_batch`` and ``stats`` of a stream (see the module docstring)."""

    # Set by the stream; assigned here too.
    _version: int
    _paused: bool
    _group_budget: int | None
    _run_ahead: int | None
    _oversample: float
    _wanted: int
    _delivered_at_version: int
    _held: int
    _queue: deque[SeqRow]

    def stats(self: _Host) -> StreamStats:
        """Counters so far (see :class:`~gym_ray.streaming.step_stats.StreamStats`)."""
        meter = self._meter
        return StreamStats(
            read=self._read,
            skipped=self._skipped,
            delivered=self._delivery.delivered,
            buffered=self._delivery.buffered,
            queued=len(self._queue),
            at_workers=sum(len(slot.assigned) for slot in self._slots),
            requeued=self._requeued,
            workers_lost=self._lost,
            policy_version=self._version,
            paused=self._paused,
            paused_s=meter.paused_total_s(),
            aborted=meter.aborted,
            stale=meter.stale,
            retried=meter.retried,
            filtered=dict(meter.filtered),
            carried_over=meter.carried_over,
            cancelled=meter.cancelled,
            staleness=dict(sorted(meter.staleness.items())),
            rollouts_per_s=meter.rate(self._delivery.delivered),
            server_latency_ms=meter.server_latency_ms(),
            run_ahead=self._run_ahead,
        )

    @property
    def policy_version(self: _Host) -> int:
        """The current policy version (stamped on rollouts admitted from now on)."""
        return self._version

    async def set_policy_version(self: _Host, version: int) -> None:
        """Make ``version`` current: every rollout admitted after this returns carries it.

        Returns once every live worker stamps ``version`` on the rows it admits (rows admitted before,
        and still running, keep their older version). With ``max_staleness``, outcomes that fall more than
        ``max_staleness`` behind are no longer delivered from now on.

        Raises:
            UsageError: ``version`` is not an int, is lower than the current version, or the stream is
                closed.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < self._version:
            raise UsageError(
                f"set_policy_version({version!r}): versions are ints that never go back; "
                f"the current version is {self._version}"
            )
        async with self._control_lock:
            if version > self._version:  # the run-ahead window opens again (see stream())
                self._delivered_at_version = self._delivery.delivered
            self._version = version
            await self._broadcast("set_policy_version", version)
            self._notify()

    async def pause(
        self: _Host, mode: Literal["drain", "abort"] = "drain", *, timeout_s: float | None = None
    ) -> int:
        """Stop admission on every worker; returns once none admits (for a weight sync).

        ``drain`` then waits until every in-flight rollout has finished (their outcomes are still
        delivered); with ``timeout_s``, the rollouts still running after that many seconds are aborted.
        ``abort`` cancels them at once (the servers see their handlers cancelled) and puts their rows back
        at the head of their worker's queue, to run again first after :meth:`resume`. Finished outcomes
        can still be taken while paused. Idempotent (a second call still drains or aborts).

        Returns:
            The rollouts aborted by this call (also counted in ``stats().aborted``).

        Raises:
            UsageError: A mode other than ``"drain"`` / ``"abort"``, a ``timeout_s`` that is not > 0 or is
                given with ``"abort"``, or the stream is closed.
        """
        if mode not in ("drain", "abort"):
            raise UsageError(f"pause(mode={mode!r}): mode must be 'drain' or 'abort'")
        if timeout_s is not None:
            if mode != "drain":
                raise UsageError("pause(timeout_s=...): a deadline is for mode='drain' (abort does not wait)")
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
                raise UsageError(f"pause(timeout_s={timeout_s!r}): must be > 0 seconds, or None")
        self._check_open("pause")
        if self._state == "new":
            await self.start()
        async with self._control_lock:
            self._paused = True
            self._meter.pause()
            results = await self._broadcast("pause", mode == "abort", timeout_s)
            aborted = sum(r for r in results if isinstance(r, int))
            self._meter.count("aborted", aborted)
            return aborted

    async def resume(self: _Host) -> None:
        """Restart admission on every worker (under the current policy version). No-op when not paused.

        Raises:
            UsageError: The stream is closed.
        """
        self._check_open("resume")
        async with self._control_lock:
            if not self._paused:
                return
            self._paused = False
            await self._broadcast("resume", self._version)
            self._meter.resume()
            self._notify()

    async def next_batch(
        self: _Host,
        n_groups: int,
        *,
        timeout_s: float | None = None,
        oversample: float | None = None,
        carry_over: bool = True,
    ) -> list[Any]:
        """The first ``n_groups`` groups to complete (items without ``group_size``), as a list.

        Args:
            n_groups: Groups wanted (>= 1).
            timeout_s: Return what is complete after this many seconds (None: wait for all).
            oversample: From this call on, keep at most ``ceil(n_groups * oversample)`` groups running
                (read from the input and not yet complete), so that the slowest groups do not hold the
                batch back (None: keep the current bound, ``max_groups_in_flight``).
            carry_over: Groups still running when the batch is complete stay running and count toward the
                next batch (True), or are cancelled: their ``/run`` requests are cancelled before this
                returns, and they are neither delivered nor recorded (False).

        Returns:
            ``n_groups`` groups, or fewer when ``timeout_s`` passed or the input ended first; ``[]`` only
            when the input is exhausted (or ``timeout_s`` passed with nothing complete).

        Raises:
            UsageError: A bad argument, or the stream is closed (every call after ``aclose()``).
            CancelledError: The call was cancelled (``asyncio.wait_for``, a task's cancel): the stream stays
                open and the groups this call had taken go back to the head of the buffer, so the next call
                delivers them.
        """
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise UsageError(f"next_batch({n_groups!r}): n_groups must be an int >= 1")
        if oversample is not None and not (isinstance(oversample, int | float) and oversample >= 1):
            raise UsageError(f"next_batch(oversample={oversample!r}): must be a number >= 1")
        if timeout_s is not None and not timeout_s > 0:
            raise UsageError(f"next_batch(timeout_s={timeout_s!r}): must be > 0 seconds, or None")
        self._check_open("next_batch")
        if oversample is not None:
            self._oversample = oversample
            self._group_budget = math.ceil(n_groups * oversample)
        staleness = self._delivery.max_staleness
        if staleness is not None:  # the run-ahead window: (max_staleness + 1) batches (see stream())
            batch_groups = math.ceil(n_groups * self._oversample)
            self._run_ahead = (staleness + 1) * batch_groups * self._delivery.width
        if self._state == "new":  # after the window is set: the reader starts inside it
            await self.start()
        self._notify()
        batch: list[Ready] = []
        deadline = asyncio.timeout(timeout_s)
        try:
            try:
                async with deadline:
                    while len(batch) < n_groups:
                        entry = self._take()
                        if entry is not None:
                            batch.append(entry)
                            self._held += self._delivery.width  # still ahead of the trainer
                            continue
                        if self._error is not None:
                            raise self._error
                        if self._finished():
                            break
                        self._wanted = (n_groups - len(batch)) * self._delivery.width
                        self._notify()
                        await self._wait()
            except TimeoutError:
                if not deadline.expired():
                    raise
            finally:
                self._wanted = 0
            async with self._control_lock:
                running = set(self._delivery.running)
                if carry_over:
                    self._meter.count("carried_over", len(running))
                else:
                    await self._cancel_groups(running)
        except asyncio.CancelledError:
            self._held = 0
            if self._state == "running":  # the caller gave up on this call, not on the stream
                self._delivery.unread(batch)
                self._notify()
            else:
                await self._shutdown(drain=False)
            raise
        except BaseException:
            self._held = 0
            await self._shutdown(drain=False)
            raise
        # delivery is the last step, with no await after it: a cancelled call has delivered nothing
        groups = [group for _, group in batch]
        self._held = 0
        self._delivery.commit(groups, self._version)
        self._notify()
        return groups if self._group_size is not None else [group[0] for group in groups]

    def _check_open(self: _Host, method: str) -> None:
        """Raise the stream's error, or ``UsageError``, when the stream is closing or closed."""
        if self._state in ("closing", "closed"):
            if self._error is not None:
                raise self._error
            raise UsageError(f"{method}: this stream is closed")

    def _finished(self: _Host) -> bool:
        return self._state in ("closing", "closed") or (self._source_done and self._delivery.open == 0)

    def _take(self: _Host) -> Ready | None:
        """The next deliverable ``(group id, group)``, queueing stale rollouts again on the way (see
        Delivery.take)."""
        while True:
            entry, requeue = self._delivery.take(self._version)
            if not requeue:
                return entry
            self._queue.extendleft(reversed(requeue))
            self._notify()

    async def _broadcast(self: _Host, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every live worker; a worker that died meanwhile is skipped (its rows are
        re-queued and its replacement starts with the stream's version and pause state)."""
        import ray

        if self._state in ("closing", "closed"):
            raise UsageError(f"{method}: this stream is closed")
        handles = [slot.handle for slot in self._slots if slot.handle is not None]
        results = await asyncio.gather(
            *(getattr(handle, method).remote(*args) for handle in handles), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ray.exceptions.RayActorError):
                raise result
        return results

    async def _cancel_groups(self: _Host, gids: set[int]) -> None:
        """Cancel running groups: their queued rows are dropped, their rows at workers cancelled."""
        import ray

        if not gids:
            return
        width = self._delivery.width
        self._queue = deque(item for item in self._queue if item[0] // width not in gids)
        calls = []
        for slot in self._slots:
            seqs = [seq for seq in slot.assigned if seq // width in gids]
            for seq in seqs:
                del slot.assigned[seq]
            if seqs and slot.handle is not None:
                calls.append(slot.handle.cancel.remote(seqs))
        self._delivery.cancel(gids)
        self._meter.count("cancelled", len(gids))
        self._notify()
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, ray.exceptions.RayActorError):
                raise result
