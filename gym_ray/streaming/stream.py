"""``stream(rows, ...)``: rollouts for trainers and notebooks, in completion order, with backpressure.

A :class:`RolloutStream` (the driver side, in the caller's event loop) reads input rows, stamps them
(task index, rollout index, run id; ``group_size`` copies of each input row), validates them against the
running config, and hands them to ``num_workers`` :class:`~gym_ray.streaming.worker.StreamWorker`
Ray actors through a bounded queue. Per worker, a feeder task ``submit``\\ s row batches and a puller task
long-polls ``pull`` for finished outcomes; outcomes reach the consumer through a buffer of ``buffer_size``.

Backpressure promise (exact, without ``group_size``): a puller asks a worker only for as many outcomes as
the buffer has free room, and a worker admits a row only while its rows admitted-and-unpulled stay below its
share of ``max_in_flight``. So after the consumer has taken ``C`` outcomes and stops pulling, the servers
receive at most ``C + buffer_size + max_in_flight`` ``/run`` requests (per attempt, with a healthy client:
retries after connection failures add to it). With ``group_size = k`` only complete groups count against
``buffer_size``; partial groups are bounded by the rows in the workers and the queue. With
``max_staleness``, ``next_batch`` also sets a run-ahead window on the rows read and not delivered
(:meth:`RolloutStream._may_open_group`; docs/internals.md gives the numbers).

Delivery promises: every input row's outcome is delivered once (unless a group filter drops its group,
or ``next_batch(carry_over=False)`` cancels it). A worker that dies (``RayActorError``) has
its undelivered rows (submitted, running, or finished but unpulled) put back at the front of the queue and
re-run by a replacement worker (up to ``max_worker_restarts``); its late outcomes can never be delivered
because they were never pulled. ``aclose()`` cancels in-flight rollouts on every worker (the servers see
their handlers cancelled) and drops what had finished; ``aclose_and_drain()`` cancels the same way and
returns, once, what had finished and was not yet delivered.

Tasks: the reader, the feeders and the pullers are tasks owned by the stream; ``aclose`` /
``aclose_and_drain`` (also called when iteration ends, fails or the consuming task is cancelled, e.g. a
notebook cell interrupt via ``async with``) cancel and join them, stop the workers and kill their actors.

Recording (``record_dir``): the stream appends every outcome it *delivers* (by iteration, ``next_batch``
or ``aclose_and_drain``) through one :class:`~gym_ray.record.writer.ShardWriter` (shard
``stream-<run>``), at the moment of delivery, with its ``_ng_policy_version``. Rollouts that were never
delivered (stale, filtered, aborted, cancelled, or unpulled at a close) are not recorded. A stream with
``resume=True`` on the same folder and the same input order skips rows already recorded as done (a success
or a terminal failure; in group mode a group is skipped only when all its rollouts are), so across a crash
and a resume every delivered rollout is recorded exactly once.

Async RL (versions, pause for weight sync, staleness, batches, group filters): ``gym_ray.streaming.control``.

Layout: this module holds the stream itself; groups and versions are in ``gym_ray.streaming.groups``,
filters in ``gym_ray.streaming.filters``; the input side (:class:`RowFeed`, source adaptation, row
stamping) is in ``gym_ray.streaming.row_feed``, the resume skip set (``recorded_keys``) in
``gym_ray.record.recorded``, and :func:`stream_sync` / :class:`SyncRolloutStream` in
``gym_ray.streaming.sync``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import deque
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from gym_ray import keys
from gym_ray.errors import GymRayError, InputError, NoProgressError, UsageError
from gym_ray.plan.load import non_finite_problem
from gym_ray.record.recorded import recorded_keys
from gym_ray.record.run_lock import RunLock
from gym_ray.run.preflight import check_ports, check_servers
from gym_ray.streaming.config_check import check_stream_config
from gym_ray.streaming.control import StreamControls
from gym_ray.streaming.delivery import Delivery, StaleCallback, refuse_used_record_dir
from gym_ray.streaming.filters import GroupFilter
from gym_ray.streaming.groups import Item, RolloutGroup, Row
from gym_ray.streaming.row_feed import aiter_rows, stamp_rows
from gym_ray.streaming.step_stats import StepMeter, StreamStats
from gym_ray.streaming.worker import (
    STREAM_WORKER_MAX_CONCURRENCY,
    Finished,
    SeqRow,
    StreamWorker,
)

logger = logging.getLogger(__name__)

__all__ = ["RolloutStream", "StreamStats"]

#: Seconds a ``pull`` long-poll waits for a first outcome.
PULL_WAIT_S = 0.25
#: Rows per ``submit`` call at most.
SUBMIT_BATCH = 64
#: Seconds the workers get to ``close()`` (end their runs, flush telemetry) before they are killed.
CLOSE_GRACE_S = 30.0


@dataclass
class _Slot:
    """One worker position: the live actor, its quota and the rows it holds (seq -> row)."""

    index: int
    quota: int
    incarnation: int = 0
    handle: Any = None
    run_ref: Any = None
    assigned: dict[int, Row] = field(default_factory=dict)


def _worker_error(exc: Exception) -> Exception:
    """The error a worker raised, without Ray's wrapping: a ``RayTaskError`` of a gym_ray error (e.g.
    ``ServerOutageError``) would otherwise reach the consumer with the worker's whole traceback as its
    message."""
    import ray

    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, GymRayError):
        return cause
    return exc


class RolloutStream(StreamControls):
    """An async iterator of ``(row, result | RolloutFailureRecord)`` in completion order (see module doc).

    With ``group_size`` it yields :class:`~gym_ray.streaming.groups.RolloutGroup` lists of ``group_size``
    items (one task's rollouts, by rollout index). Build it with :func:`stream`; use ``async with`` so that
    leaving the block (or a cancelled cell) closes it.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
        *,
        config: Mapping[str, Any] | str | os.PathLike[str],
        num_workers: int = 2,
        group_size: int | None = None,
        max_in_flight: int = 64,
        buffer_size: int | None = None,
        timeout_s: float | None = None,
        record_dir: str | os.PathLike[str] | None = None,
        resume: bool = False,
        address: str | None = None,
        max_worker_restarts: int | None = None,
        connect_timeout_s: float = 10.0,
        retry_requests: bool = True,
        run_id: str | None = None,
        policy_version: int = 0,
        max_staleness: int | None = None,
        on_stale: StaleCallback | None = None,
        group_filter: GroupFilter | Sequence[GroupFilter] | None = None,
        max_groups_in_flight: int | None = None,
        health_check: bool = True,
        max_rollout_attempts: int = 1,
        one_version_groups: bool = False,
    ) -> None:
        for name, value, low in (
            ("num_workers", num_workers, 1),
            ("group_size", group_size, 1),
            ("max_in_flight", max_in_flight, num_workers),
            ("buffer_size", buffer_size, 1),
            ("policy_version", policy_version, 0),
            ("max_staleness", max_staleness, 0),
            ("max_groups_in_flight", max_groups_in_flight, 1),
            ("max_rollout_attempts", max_rollout_attempts, 1),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise UsageError(f"stream: {name}={value!r} must be an int >= {low}")
        if timeout_s is not None and not timeout_s > 0:
            raise UsageError(f"stream: timeout_s={timeout_s!r} must be > 0 seconds, or None for no limit")
        if resume and record_dir is None:
            raise UsageError("stream: resume=True needs record_dir=<the run folder to resume>")
        if "://" in str(record_dir):  # object-store folders (s3://) are for collect and gym-ray run
            raise UsageError(f"stream: record_dir={str(record_dir)!r} is a URL; a stream records to a folder")
        if group_filter is not None and group_size is None:
            raise UsageError("stream: group_filter needs group_size (a filter judges a task's whole group)")
        if one_version_groups and group_size is None:
            raise UsageError("stream: one_version_groups needs group_size (it is about a task's group)")
        if on_stale is not None and max_staleness is None and not one_version_groups:
            raise UsageError("stream: on_stale needs max_staleness=<versions a rollout may lag behind>")
        self._rows = rows
        self._config = config
        self._num_workers = num_workers
        self._group_size = group_size
        self._max_in_flight = max_in_flight
        self._buffer_size = buffer_size  # None: max_in_flight, or the run-ahead window once it is known
        # rollouts read and not delivered, at most: set by next_batch with max_staleness (_may_open_group)
        self._run_ahead: int | None = None
        self._timeout_s = timeout_s
        self._record_dir = str(record_dir) if record_dir is not None else None
        self._resume = resume
        self._address = address
        self._restarts_left = 2 * num_workers if max_worker_restarts is None else max_worker_restarts
        self._connect_timeout_s = connect_timeout_s
        self._retry_requests = retry_requests
        self._health_check = health_check
        self.run_id = run_id or uuid.uuid4().hex
        self._state = "new"  # new -> running -> closed
        self._owns_ray = False
        self._lock: RunLock | None = None
        self._topology: Any = None
        self._settings: Any = None
        self._slots: list[_Slot] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._pullers: set[asyncio.Task[None]] = set()
        self._queue: deque[SeqRow] = deque()
        self._meter = StepMeter(self.run_id)
        self._delivery = Delivery(
            group_size=group_size,
            max_staleness=max_staleness,
            on_stale=on_stale,
            group_filter=group_filter,
            meter=self._meter,
            max_rollout_attempts=max_rollout_attempts,
            one_version_groups=one_version_groups,
        )
        self._version = policy_version
        self._paused = False
        self._group_budget = max_groups_in_flight
        self._oversample = 1.0  # next_batch's last oversample
        self._wanted = 0  # rollouts a waiting next_batch still lacks
        self._held = 0  # rollouts a waiting next_batch has taken and not yet delivered
        self._delivered_at_version = 0  # delivered when the policy version last moved
        self._changed = asyncio.Event()
        self._source_done = False
        self._error: BaseException | None = None
        self._reserved = 0
        self._read = self._skipped = self._requeued = self._lost = 0
        self._start_lock = asyncio.Lock()
        self._control_lock = asyncio.Lock()  # pause / resume / set_policy_version / next_batch ends

    # --- public ---------------------------------------------------------------------------------

    async def worker_pids(self) -> list[int]:
        """Process ids of the live workers, by slot (starts the stream if needed)."""
        await self.start()
        return list(await asyncio.gather(*(slot.handle.pid.remote() for slot in self._slots)))

    async def worker_stats(self) -> list[Any]:
        """:class:`~gym_ray.streaming.worker.StreamWorkerStats` of the live workers, by slot."""
        await self.start()
        return list(await asyncio.gather(*(slot.handle.stats.remote() for slot in self._slots)))

    async def start(self) -> None:
        """Resolve the config, connect to Ray and start the workers (done by the first ``anext`` too).

        Raises:
            UsageError: The stream is closed.
            ConfigError: The config is bad (before Ray starts).
            RunLockError: Another run holds ``record_dir`` (before Ray starts).
            UsageError: ``record_dir`` already holds a recording and ``resume`` is not set.
        """
        async with self._start_lock:
            if self._state in ("closing", "closed"):
                raise UsageError("this stream is closed; build a new one with gym_ray.stream(...)")
            if self._state == "running":
                return
            try:
                await self._start()
            except BaseException:
                await self._shutdown(drain=False)
                raise
            self._state = "running"

    def __aiter__(self) -> RolloutStream:
        return self

    async def __anext__(self) -> Item | RolloutGroup:
        if self._state == "new":
            await self.start()
        try:
            while True:
                entry = self._take()
                if entry is not None:
                    _, group = entry
                    self._delivery.commit([group], self._version)
                    self._notify()
                    return group if self._group_size is not None else group[0]
                if self._error is not None:
                    raise self._error
                if self._finished():
                    break
                await self._wait()
        except BaseException:
            await self._shutdown(drain=False)
            raise
        await self._shutdown(drain=False)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel in-flight rollouts on every worker, wait until they have ended, stop the workers.

        Outcomes not yet delivered are dropped (and not recorded). Idempotent.
        """
        await self._shutdown(drain=False)

    async def aclose_and_drain(self) -> list[Any]:
        """Like :meth:`aclose`, but return the finished, undelivered outcomes (once; later calls get ``[]``).

        Items have the iteration's shape; in group mode an incomplete group comes back as a shorter list.
        They count as delivered (and are recorded): stale ones (``max_staleness``) are left out.
        """
        return await self._shutdown(drain=True)

    async def __aenter__(self) -> RolloutStream:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # --- start and stop --------------------------------------------------------------------------

    async def _start(self) -> None:
        from gym_ray.config.run_config import resolve_run_config
        from gym_ray.distributed.placement import import_ray, start_quiet_ray

        ray = await asyncio.to_thread(import_ray)  # importing Ray takes a while: keep the loop serving

        if self._record_dir is not None:  # one run per folder: refused before anything starts
            self._lock = RunLock(self._record_dir, what="stream").acquire()
            if not self._resume:
                refuse_used_record_dir(self._record_dir)
        run = await resolve_run_config(self._config)
        check_stream_config(run)
        check_ports(run.topology)
        if self._health_check:  # a wrong host or port is one line now, not an outage timeout later
            await check_servers(run.topology)
        self._topology = run.topology
        self._settings = run.settings  # strict_json, server_outage_timeout_s, max_infra_retries
        if not ray.is_initialized():  # quiet, as `gym-ray run` starts it
            await start_quiet_ray(self._address)
            self._owns_ray = True
        done: set[tuple[int, int]] = set()
        if self._resume and self._record_dir is not None:
            done = await asyncio.to_thread(recorded_keys, self._record_dir)
        if self._record_dir is not None:
            shard, identity = f"stream-{self.run_id[:12]}", self._topology.identity_digest()
            await asyncio.to_thread(
                self._delivery.open_writer, self._record_dir, shard, self.run_id, identity
            )
        base, extra = divmod(self._max_in_flight, self._num_workers)
        self._slots = [_Slot(i, base + (1 if i < extra else 0)) for i in range(self._num_workers)]
        logger.info(
            "stream %s: %d workers, max_in_flight=%d (per worker %s), buffer_size=%s, group_size=%s, "
            "timeout_s=%s, record_dir=%s; actors num_cpus=0 max_concurrency=%d",
            self.run_id,
            self._num_workers,
            self._max_in_flight,
            [slot.quota for slot in self._slots],
            self._buffer_size,
            self._group_size,
            self._timeout_s,
            self._record_dir,
            STREAM_WORKER_MAX_CONCURRENCY,
        )
        for slot in self._slots:  # creating an actor may export its class first: off the loop
            await asyncio.to_thread(self._launch, slot)
        await asyncio.gather(*(slot.handle.pid.remote() for slot in self._slots))
        self._meter.begin()
        self._state = "running"
        self._spawn(self._read_source(done))
        for slot in self._slots:
            self._spawn(self._feed(slot))
            self._pullers.add(self._spawn(self._pull(slot)))

    def _launch(self, slot: _Slot) -> None:
        import ray

        worker: Any = ray.remote(StreamWorker).options(
            num_cpus=0, max_concurrency=STREAM_WORKER_MAX_CONCURRENCY
        )
        slot.handle = worker.remote(
            f"w{slot.index}.{slot.incarnation}",
            self._topology,
            max_in_flight=slot.quota,
            inbox_size=slot.quota,
            request_timeout_s=self._timeout_s,
            connect_timeout_s=self._connect_timeout_s,
            retry_requests=self._retry_requests,
            policy_version=self._version,
            paused=self._paused,
            server_outage_timeout_s=self._settings.server_outage_timeout_s,
            max_infra_retries=self._settings.max_infra_retries,
        )
        slot.run_ref = slot.handle.run.remote()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._guard(coro))
        self._tasks.add(task)
        return task

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except Exception as exc:
            if self._error is None:
                self._error = _worker_error(exc)
            self._notify()

    def _notify(self) -> None:
        self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _shutdown(self, *, drain: bool) -> list[Any]:
        import ray

        if self._state == "closed" or self._state == "closing":
            return []
        self._state = "closing"
        self._notify()
        pullers, others = list(self._pullers), [t for t in self._tasks if t not in self._pullers]
        self._tasks.clear()
        self._pullers.clear()
        # Feeders and the reader only move rows; pullers carry outcomes, so a drain lets each finish the
        # pull it has in flight (the worker's close() wakes it) instead of dropping what it popped.
        for task in others if drain else [*others, *pullers]:
            task.cancel()
        if others or pullers:
            await asyncio.wait([*others, *pullers])  # a draining puller ends after its pull (<= PULL_WAIT_S)
        drained: list[RolloutGroup] = []
        live = [slot for slot in self._slots if slot.handle is not None]
        try:
            # Bounded: a worker that does not close in time is killed below (the backstop).
            closing = [asyncio.ensure_future(slot.handle.close.remote(drain)) for slot in live]
            if closing:
                _, late = await asyncio.wait(closing, timeout=CLOSE_GRACE_S)
                for call in late:
                    call.cancel()
            results = await asyncio.gather(*closing, return_exceptions=True)
            if drain:
                for slot, result in zip(live, results, strict=True):
                    if isinstance(result, list):
                        self._accept(slot, result)
                drained = self._delivery.drain(self._version)
                self._delivery.commit(drained, self._version)
            await asyncio.gather(*(slot.run_ref for slot in live), return_exceptions=True)
        finally:
            self._state = "closed"
            self._meter.resume()
            for slot in live:
                ray.kill(slot.handle, no_restart=True)
                slot.handle = None
            self._delivery.clear()
            self._delivery.close_writer()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if self._owns_ray:
                self._owns_ray = False
                await asyncio.to_thread(ray.shutdown)
        return drained if self._group_size is not None else [group[0] for group in drained]

    # --- input -----------------------------------------------------------------------------------

    async def _read_source(self, done: set[tuple[int, int]]) -> None:
        bound = self._max_in_flight + self._num_workers * SUBMIT_BATCH
        width = self._delivery.width
        next_task = 0
        seq_base = 0
        async for raw in aiter_rows(self._rows):
            while not self._may_open_group() and self._state == "running":
                await self._wait()
            own = raw.get(keys.TASK_INDEX) if isinstance(raw, Mapping) else None
            task = own if type(own) is int else next_task
            next_task = max(next_task, task + 1)
            position = self._read + self._skipped
            if isinstance(raw, Mapping):  # JSON cannot carry nan / inf, whatever strict_json says
                problem = non_finite_problem(raw)
                if problem is not None:
                    raise InputError(
                        f"stream input row {position // width}: {problem}", row=position // width
                    )
            rows = stamp_rows(
                raw,
                position=position // width,
                task=task,
                run_id=self.run_id,
                group_size=self._group_size,
                topology=self._topology,
            )
            keys_of = [(r[keys.TASK_INDEX], r[keys.ROLLOUT_INDEX]) for r in rows]
            if done and all(k in done for k in keys_of):
                self._skipped += width
                continue
            self._delivery.opened(seq_base // width)
            for offset, row in enumerate(rows):
                while len(self._queue) >= bound and self._state == "running":
                    await self._wait()
                self._queue.append((seq_base + offset, row))
                self._read += 1
                self._notify()
            seq_base += width
        self._source_done = True
        self._notify()

    def _may_open_group(self) -> bool:
        """The reader may read the next input row: under the group budget and the run-ahead window.

        The window (``_run_ahead``, set by ``next_batch`` from ``max_staleness``) bounds the rollouts read
        and not yet delivered; what was delivered since the policy version last moved is taken from it
        (the trainer holds that batch and has not yet moved the version), but never below what a waiting
        ``next_batch`` holds and still lacks, so a trainer taking several batches per version, or whose
        filters drop groups, never waits forever.
        """
        delivery = self._delivery
        if self._group_budget is not None and len(delivery.running) >= self._group_budget:
            return False
        if self._run_ahead is None:
            return True
        taken = delivery.delivered - self._delivered_at_version
        allowed = max(self._run_ahead - taken, self._held + self._wanted)
        return delivery.open + delivery.buffered + self._held + delivery.width <= allowed

    def _buffer_cap(self) -> int:
        """Finished rollouts the buffer may hold: ``buffer_size`` when given, else ``max_in_flight`` or the
        run-ahead window, whichever is larger (a window's rollouts all fit, finished, while a step runs)."""
        if self._buffer_size is not None:
            return self._buffer_size
        return max(self._max_in_flight, self._run_ahead or 0)

    # --- workers ---------------------------------------------------------------------------------

    async def _feed(self, slot: _Slot) -> None:
        """Move queued rows to the slot's worker; ends when the worker dies (the puller restarts it)."""
        import ray

        handle = slot.handle
        while slot.handle is handle:
            while not self._queue:
                await self._wait()
            if slot.handle is not handle:
                return
            batch: list[SeqRow] = []
            while self._queue and len(batch) < min(SUBMIT_BATCH, slot.quota):
                batch.append(self._queue.popleft())
            self._notify()
            for seq, row in batch:
                slot.assigned[seq] = row
            try:
                await handle.submit.remote(batch)
            except ray.exceptions.RayActorError:
                return

    async def _pull(self, slot: _Slot) -> None:
        import ray

        while self._state == "running":
            # Long-poll without a reservation, then reserve only what the worker has: a puller never
            # holds buffer room while it waits, so no worker starves another one.
            try:
                available = await slot.handle.ready.remote(PULL_WAIT_S)
                if not available:
                    continue
                room = min(self._buffer_cap() - self._delivery.buffered - self._reserved, available)
                if room <= 0:
                    await self._wait()
                    continue
                self._reserved += room
                try:
                    items = await slot.handle.pull.remote(room, 0.0)
                finally:
                    self._reserved -= room
            except ray.exceptions.RayActorError as exc:
                if self._state != "running":
                    return
                await self._replace(slot, exc)
                continue
            self._accept(slot, items)

    async def _replace(self, slot: _Slot, exc: BaseException) -> None:
        """The slot's worker died: re-queue its rows in seq order, start a replacement (budget allowing)."""
        import ray

        self._lost += 1
        ray.kill(slot.handle, no_restart=True)
        requeue = sorted(slot.assigned.items())
        slot.assigned.clear()
        self._queue.extendleft(reversed(requeue))
        self._requeued += len(requeue)
        logger.warning(
            "stream %s: worker w%d.%d died (%s); re-queued %d rows",
            self.run_id,
            slot.index,
            slot.incarnation,
            type(exc).__name__,
            len(requeue),
        )
        if self._restarts_left <= 0:
            raise NoProgressError(
                f"stream {self.run_id}: worker w{slot.index} died and the restart budget "
                "(max_worker_restarts) is spent; raise max_worker_restarts or check the Ray cluster"
            ) from exc
        self._restarts_left -= 1
        slot.incarnation += 1
        self._launch(slot)
        await slot.handle.pid.remote()
        self._spawn(self._feed(slot))
        self._notify()

    def _accept(self, slot: _Slot, items: list[Finished]) -> None:
        """Hand pulled outcomes to the delivery side; stale ones go back to the head of the queue."""
        requeue: list[SeqRow] = []
        for seq, outcome, version in items:
            row = slot.assigned.pop(seq, None)
            if row is None:
                continue  # cancelled, or not this worker's any more
            requeue.extend(self._delivery.accept(seq, row, outcome, version, self._version))
        requeue.sort(key=lambda pair: pair[0])
        self._queue.extendleft(reversed(requeue))
        self._notify()
