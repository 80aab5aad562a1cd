"""``stream_sync(rows, ...)``: :func:`gym_ray.stream` for plain Python loops, outside an event loop.

A :class:`SyncRolloutStream` runs a :class:`~gym_ray.streaming.stream.RolloutStream` on a private event loop
in a thread of its own (started by the first call), so the stream keeps pulling finished rollouts into its
buffer while the caller's code runs: a training step that lasts seconds finds, when it ends, what finished
meanwhile, up to the stream's bounds (``max_in_flight``, the buffer, the run-ahead window; see
:func:`gym_ray.stream`). Each method hands its call to that loop and waits for the answer. All the stream's
delivery and closing promises hold; closing also stops the thread.

The input rows, group filters and ``on_stale`` run on the stream's thread. Ctrl-C (or any exception) while
a call waits cancels that call on the stream's loop and waits until it has ended before it propagates, as
cancelling the same call of :class:`RolloutStream` does (an interrupted ``next_batch`` leaves the stream
open with its groups buffered; an interrupted iteration closes the stream).

Concurrency: one calling thread at a time; not for use from inside a running event loop (a notebook cell).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar

from gym_ray.errors import UsageError
from gym_ray.streaming.api import stream
from gym_ray.streaming.groups import Item, RolloutGroup
from gym_ray.streaming.stream import RolloutStream, StreamStats

__all__ = ["SyncRolloutStream", "stream_sync"]

T = TypeVar("T")


class SyncRolloutStream:
    """A :class:`RolloutStream` for plain Python loops: ``for item in stream_sync(...)``.

    Runs the stream on a private event loop in a thread of its own, so rollouts keep arriving while the
    caller computes (see the module docstring). Close it (``with`` or :meth:`close`) to stop the workers
    and the thread.
    """

    def __init__(self, inner: RolloutStream) -> None:
        self._inner = inner
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[Item | RolloutGroup]:
        return self

    def _serve(self, ready: threading.Event) -> None:
        """The stream's thread: its loop runs until :meth:`close` (leftover tasks are then cancelled and
        the loop closed by ``asyncio.Runner``)."""

        async def until_closed() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()

        with asyncio.Runner() as runner:
            runner.run(until_closed())

    def _loop_started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            ready = threading.Event()
            name = f"gym-ray-stream-{self._inner.run_id[:8]}"
            self._thread = threading.Thread(target=self._serve, args=(ready,), name=name, daemon=True)
            self._thread.start()
            ready.wait()
        assert self._loop is not None
        return self._loop

    def _call(self, call: Coroutine[Any, Any, T]) -> T:
        """Run ``call`` on the stream's loop and return its result; when the wait is interrupted (Ctrl-C),
        cancel the call, wait until it has ended, and re-raise."""
        ended = threading.Event()

        async def tracked() -> T:
            try:
                return await call
            finally:
                ended.set()

        future = asyncio.run_coroutine_threadsafe(tracked(), self._loop_started())
        try:
            ended.wait()
        except BaseException:
            future.cancel()
            ended.wait()
            raise
        return future.result()

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            call.close()
            raise UsageError("this stream is closed")
        return self._call(call)

    def _read(self, read: Callable[[], T]) -> T:
        """A reading of the stream's state, taken on its loop while it runs."""
        if self._closed or self._loop is None:
            return read()

        async def now() -> T:
            return read()

        return self._call(now())

    def __next__(self) -> Item | RolloutGroup:
        if self._closed:
            raise StopIteration
        try:
            return self._call(self._inner.__anext__())
        except StopAsyncIteration:
            self.close()
            raise StopIteration from None
        except BaseException:
            self.close()
            raise

    def stats(self) -> StreamStats:
        """See :meth:`RolloutStream.stats`."""
        return self._read(self._inner.stats)

    @property
    def policy_version(self) -> int:
        """See :attr:`RolloutStream.policy_version`."""
        return self._read(lambda: self._inner.policy_version)

    def start(self) -> None:
        """See :meth:`RolloutStream.start` (the first call that needs the workers starts them anyway)."""
        self._run(self._inner.start())

    def worker_pids(self) -> list[int]:
        """See :meth:`RolloutStream.worker_pids`."""
        return self._run(self._inner.worker_pids())

    def worker_stats(self) -> list[Any]:
        """See :meth:`RolloutStream.worker_stats`."""
        return self._run(self._inner.worker_stats())

    def set_policy_version(self, version: int) -> None:
        """See :meth:`RolloutStream.set_policy_version`."""
        self._run(self._inner.set_policy_version(version))

    def pause(self, mode: Literal["drain", "abort"] = "drain", *, timeout_s: float | None = None) -> int:
        """See :meth:`RolloutStream.pause`."""
        return self._run(self._inner.pause(mode, timeout_s=timeout_s))

    def resume(self) -> None:
        """See :meth:`RolloutStream.resume`."""
        self._run(self._inner.resume())

    def next_batch(
        self,
        n_groups: int,
        *,
        timeout_s: float | None = None,
        oversample: float | None = None,
        carry_over: bool = True,
    ) -> list[Any]:
        """See :meth:`RolloutStream.next_batch`; an error closes the stream, Ctrl-C does not (the groups the
        call had taken stay buffered for the next one)."""
        try:
            return self._run(
                self._inner.next_batch(
                    n_groups, timeout_s=timeout_s, oversample=oversample, carry_over=carry_over
                )
            )
        except (UsageError, KeyboardInterrupt):
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """See :meth:`RolloutStream.aclose`; also closes the private loop. Idempotent."""
        self.close_and_drain()

    def close_and_drain(self) -> list[Any]:
        """See :meth:`RolloutStream.aclose_and_drain`; also closes the private loop. Idempotent."""
        if self._closed:
            return []
        try:
            return self._call(self._inner.aclose_and_drain())
        finally:
            self._closed = True
            self._stop_thread()

    def _stop_thread(self) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and thread is not None:
            loop.call_soon_threadsafe(stop.set)
            thread.join()

    def __enter__(self) -> SyncRolloutStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def stream_sync(rows: Iterable[Mapping[str, Any]], **options: Any) -> SyncRolloutStream:
    """:func:`stream` for plain loops (same options). Not for a running event loop: use ``stream`` there.

    Raises:
        UsageError: Called from a running event loop (a notebook cell): use ``async for`` over ``stream``.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return SyncRolloutStream(stream(rows, **options))
    raise UsageError(
        "stream_sync() was called from a running event loop (a notebook cell?); "
        "use `async for item in gym_ray.stream(...)` there"
    )
