"""The completion iterator: one task per row, outcomes in completion order, lazy bounded admission.

Concurrency promises:

- One asyncio task per admitted row, created by this object and joined by :meth:`aclose` /
  :meth:`aclose_and_drain` (the only other task is the optional one-shot ``prepare`` step). No task is
  fire-and-forget.
- Bounded mode (``max_resident_tasks=K``): at most K rows are *resident* (running, or finished and not
  yet claimed by a consumer). Rows are pulled from the input only when a slot is free, so memory does not
  grow with the input size; a consumer that stops pulling stops admission (backpressure). Admission starts
  when the first handed-out awaitable is awaited.
- Unbounded mode (``max_resident_tasks=None``): every row becomes a task when the iterator is first
  consumed, like :func:`asyncio.as_completed`.
- Rows start in input order. Outcomes are handed out in completion order: each awaited item claims the
  next finished row; an exception of a row is raised only in the consumer that claimed it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Iterator
from typing import Any, Generic, Literal, TypeVar

from gym_ray.errors import InternalError, UsageError

R = TypeVar("R")
T = TypeVar("T")

_END: Any = object()


class _Completion(Coroutine[Any, Any, T]):
    """A handed-out awaitable. Its coroutine is created only when it is first awaited or stepped.

    Being a real ``Coroutine`` lets callers pass it to ``asyncio.create_task`` / ``TaskGroup``; creating
    the inner coroutine lazily means an item that is never awaited leaves no "never awaited" warning.
    """

    __slots__ = ("_coro", "_owner")

    def __init__(self, owner: CompletionIterator[Any, T]) -> None:
        self._owner = owner
        self._coro: Coroutine[Any, Any, T] | None = None

    def _inner(self) -> Coroutine[Any, Any, T]:
        if self._coro is None:
            self._coro = self._owner._next_outcome()
        return self._coro

    def __await__(self) -> Generator[Any, None, T]:
        return self._inner().__await__()

    def send(self, value: Any) -> Any:
        return self._inner().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if val is None and tb is None:
            return self._inner().throw(typ)
        return self._inner().throw(typ, val, tb)  # pragma: no cover - legacy 3-argument form

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a finished task's exception as retrieved (no "never retrieved" log for abandoned outcomes)."""
    if task.done() and not task.cancelled():
        task.exception()


def _settled_copy(task: asyncio.Future[T], loop: asyncio.AbstractEventLoop) -> asyncio.Future[T]:
    fut: asyncio.Future[T] = loop.create_future()
    if task.cancelled():
        fut.cancel()
        return fut
    exc = task.exception()
    if exc is not None:
        fut.set_exception(exc)
        fut.exception()  # retrieved: an abandoned drained future logs nothing; awaiting it still raises
    else:
        fut.set_result(task.result())
    return fut


class CompletionIterator(Generic[R, T]):
    """Outcomes of ``start(row)`` for every row, in completion order.

    Use it either way (not both at once):

    - ``for item in it: outcome = await item`` (sync iteration of awaitables, like ``as_completed``);
    - ``async for outcome in it``.

    Args:
        items: Input rows; pulled lazily in bounded mode (never copied into a list).
        start: Builds the coroutine of one row (one task per row).
        max_resident_tasks: The residency bound, or None for "schedule everything at first use".
        prepare: Optional async step run once before the first row is admitted (for example fetching the
            running config); its error is raised by every consumer and nothing is admitted.
        validate_batch: Optional check/transform applied to rows in batches before they are admitted;
            must return as many rows as it got. Its error fails admission (rows already running finish).
        batch_size: Rows per ``validate_batch`` call in bounded mode (unbounded mode validates all at once).

    Raises:
        UsageError: ``max_resident_tasks`` is below 1.
    """

    def __init__(
        self,
        items: Iterable[R],
        start: Callable[[R], Coroutine[Any, Any, T]],
        *,
        max_resident_tasks: int | None = None,
        prepare: Callable[[], Awaitable[None]] | None = None,
        validate_batch: Callable[[list[R]], list[R]] | None = None,
        batch_size: int = 1024,
    ) -> None:
        if max_resident_tasks is not None and (
            isinstance(max_resident_tasks, bool) or max_resident_tasks < 1
        ):
            raise UsageError(
                f"max_resident_tasks={max_resident_tasks!r} must be an int >= 1 (or None to schedule every "
                "row up front)"
            )
        self._items: Iterator[R] = iter(items)
        self._start = start
        self._bound = max_resident_tasks
        self._prepare = prepare
        self._validate_batch = validate_batch
        self._batch_size = max(1, batch_size)
        self._lookahead: deque[R] = deque()  # raw rows pulled to hand out an item, not yet validated
        self._admissible: deque[R] = deque()  # validated rows waiting for a slot
        self._exhausted = False
        self._pulled = 0
        self._issued = 0
        self._admitted = 0
        self._running: set[asyncio.Task[T]] = set()
        self._ready: deque[asyncio.Task[T]] = deque()
        self._waiters: deque[asyncio.Future[asyncio.Task[T]]] = deque()
        self._prepare_task: asyncio.Task[None] | None = None
        self._prepared = prepare is None
        self._admit_error: BaseException | None = None
        self._closed: Literal["", "aclose", "drain"] = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._moved: set[asyncio.Task[T]] = set()  # finished tasks made claimable by aclose() early

    # --- counters --------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Rows admitted and not finished yet."""
        return len(self._running)

    @property
    def admitted(self) -> int:
        """Rows that became tasks so far."""
        return self._admitted

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` or :meth:`aclose_and_drain` was called."""
        return bool(self._closed)

    # --- input ---------------------------------------------------------------------------------------
    def _pull(self) -> Any:
        if self._exhausted:
            return _END
        try:
            row = next(self._items)
        except StopIteration:
            self._exhausted = True
            return _END
        self._pulled += 1
        return row

    def _issue(self) -> bool:
        """Reserve one more outcome for a consumer; False when every row has one (or after closure)."""
        if self._closed:
            return False
        if self._issued < self._pulled:
            self._issued += 1
            return True
        if self._bound is None:
            while (row := self._pull()) is not _END:
                self._lookahead.append(row)
            if self._prepared and self._admit_error is None:
                self._admit()
        else:
            row = self._pull()
            if row is not _END:
                self._lookahead.append(row)
        if self._issued < self._pulled:
            self._issued += 1
            return True
        return False

    def _next_admissible(self) -> Any:
        if not self._admissible:
            limit = len(self._lookahead) if self._bound is None else self._batch_size
            batch: list[R] = []
            while len(batch) < limit and self._lookahead:
                batch.append(self._lookahead.popleft())
            while len(batch) < limit and (row := self._pull()) is not _END:
                batch.append(row)
            if not batch:
                return _END
            if self._validate_batch is not None:
                checked = self._validate_batch(batch)
                if len(checked) != len(batch):
                    raise InternalError(f"row validation returned {len(checked)} rows for {len(batch)}")
                batch = checked
            self._admissible.extend(batch)
        return self._admissible.popleft()

    def _admit(self) -> None:
        """Create tasks for rows while a slot is free (consumer context, so input errors reach a consumer)."""
        if self._admit_error is not None:
            raise self._admit_error
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        bound = self._bound
        try:
            while not self._closed and (bound is None or len(self._running) + len(self._ready) < bound):
                row = self._next_admissible()
                if row is _END:
                    break
                task = loop.create_task(self._start(row))
                self._running.add(task)
                task.add_done_callback(self._on_done)
                self._admitted += 1
        except Exception as exc:
            self._admit_error = exc
            if not self._running and not self._ready:
                self._fail_waiters(exc)
            raise

    # --- completion ------------------------------------------------------------------------------------
    def _on_done(self, task: asyncio.Task[T]) -> None:
        self._running.discard(task)
        if self._closed:
            if self._closed == "aclose" and self._bound is None and task not in self._moved:
                self._ready.append(task)
            self._moved.discard(task)
            _retrieve(task)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(task)
                break
        else:
            self._ready.append(task)
        if not self._running and not self._ready and self._admit_error is not None:
            self._fail_waiters(self._admit_error)

    def _fail_waiters(self, exc: BaseException) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)

    def _cancel_waiters(self) -> None:
        while self._waiters:
            self._waiters.popleft().cancel()

    async def _ensure_prepared(self) -> None:
        if self._prepare_task is None:
            assert self._prepare is not None
            prepare = self._prepare

            async def run() -> None:
                await prepare()

            self._prepare_task = asyncio.get_running_loop().create_task(run())
        await asyncio.shield(self._prepare_task)
        self._prepared = True

    async def _next_outcome(self) -> T:
        if not self._prepared and not self._closed:
            await self._ensure_prepared()
        if self._closed:
            if self._closed == "aclose" and self._bound is None and self._ready:
                return self._ready.popleft().result()
            raise asyncio.CancelledError()
        self._admit()
        if self._ready:
            task = self._ready.popleft()
        else:
            if not self._running:  # (an admission error was raised by _admit() above)
                raise InternalError("rollout completion iterator exhausted unexpectedly")
            waiter: asyncio.Future[asyncio.Task[T]] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                task = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    claimed = waiter.result()  # our consumer was cancelled after claiming: give it back
                    if self._closed:
                        _retrieve(claimed)
                    else:
                        self._ready.appendleft(claimed)
                raise
        if not self._closed:
            try:
                self._admit()
            except Exception:
                _retrieve(task)  # the admission error wins; this outcome stays recorded as retrieved
                raise
        return task.result()

    # --- iteration -----------------------------------------------------------------------------------
    def __iter__(self) -> CompletionIterator[R, T]:
        return self

    def __next__(self) -> Coroutine[Any, Any, T]:
        if not self._issue():
            raise StopIteration
        return _Completion(self)

    def __aiter__(self) -> CompletionIterator[R, T]:
        return self

    async def __anext__(self) -> T:
        if not self._issue():
            raise StopAsyncIteration
        return await self._next_outcome()

    # --- closing -------------------------------------------------------------------------------------
    async def _join(self, tasks: Iterable[asyncio.Future[Any]]) -> None:
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending)

    def _stop(self, mode: Literal["aclose", "drain"]) -> None:
        self._closed = mode
        self._lookahead.clear()
        self._admissible.clear()
        self._cancel_waiters()
        if self._prepare_task is not None:
            self._prepare_task.cancel()

    async def aclose(self) -> None:
        """Cancel unfinished rows and wait until their tasks in this process have ended.

        Cancelling an in-flight ``/run`` closes its connection (a server with client-disconnect cancellation
        then cancels its handler; that cleanup is not awaited). After this call:

        - iteration stops; no row is admitted any more;
        - an awaitable handed out earlier may still return a completed outcome or raise its exception,
          including ``CancelledError`` for cancelled rows (unbounded mode); in bounded mode an awaitable
          first awaited after closure raises ``CancelledError`` even when an outcome was ready;
        - a consumer already waiting for an outcome gets ``CancelledError`` raised in its own task
          (its task is not cancelled; ``gather`` / ``TaskGroup`` treat the error as cancellation).

        Safe to call repeatedly, after :meth:`aclose_and_drain`, and before first use (nothing starts).
        """
        if not self._closed:
            self._stop("aclose")
            for task in self._running:
                if not task.done():
                    task.cancel()
                elif self._bound is None:  # finished, its done callback not run yet: still claimable
                    self._ready.append(task)
                    self._moved.add(task)
            for task in self._ready:
                _retrieve(task)
            if self._bound is not None:
                self._ready.clear()
        await self._join([*self._running, *([self._prepare_task] if self._prepare_task else [])])

    async def aclose_and_drain(self) -> list[asyncio.Future[T]]:
        """Stop admission, cancel unfinished rows, and hand back the finished outcomes nobody claimed.

        Before its first suspension this stops admission and snapshots finished, unclaimed outcomes; then it
        cancels and awaits the unfinished tasks (those are not returned). Each returned future is settled and
        yields the outcome or raises the row's original exception (already retrieved, so abandoning it logs
        nothing); an outcome that was already cancelled comes back as a cancelled future.

        An awaitable that had already claimed an outcome keeps it; every other issued awaitable raises
        ``CancelledError``. Outcomes are transferred once: a repeated call, or a call after :meth:`aclose`,
        returns ``[]``. Before first use nothing starts and ``[]`` is returned.
        """
        if self._closed:
            await self._join([*self._running, *([self._prepare_task] if self._prepare_task else [])])
            return []
        loop = self._loop or asyncio.get_running_loop()
        self._stop("drain")
        snapshot = list(self._ready)
        self._ready.clear()
        cancelled: list[asyncio.Task[T]] = []
        for task in self._running:
            if task.done():  # finished, its done callback not run yet: still an unclaimed outcome
                snapshot.append(task)
            else:
                task.cancel()
                cancelled.append(task)
        settled = [_settled_copy(task, loop) for task in snapshot]
        await self._join([*cancelled, *([self._prepare_task] if self._prepare_task else [])])
        return settled
