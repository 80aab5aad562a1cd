"""``stream_sync(rows, ...)``: :func:`gym_ray.stream` for plain Python loops, outside an event loop.

A :class:`SyncRolloutStream` runs a :class:`~gym_ray.streaming.stream.RolloutStream` on a private event loop
(``asyncio.Runner``) in the calling thread. The stream makes progress only while the caller waits for the
next item; its Ray workers keep running rollouts meanwhile, up to the stream's backpressure bound. All the
stream's delivery and closing promises hold; closing also closes the private loop.

Concurrency: one thread at a time; not for use from inside a running event loop (a notebook cell).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Iterator, Mapping
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

    Runs the stream on a private event loop in the calling thread; the stream makes progress while the
    caller waits for the next item (workers keep running rollouts up to the backpressure bound meanwhile).
    Close it (``with`` or :meth:`close`) to stop the workers.
    """

    def __init__(self, inner: RolloutStream) -> None:
        self._inner = inner
        self._runner = asyncio.Runner()
        self._closed = False

    def __iter__(self) -> Iterator[Item | RolloutGroup]:
        return self

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            call.close()
            raise UsageError("this stream is closed")
        return self._runner.run(call)

    def __next__(self) -> Item | RolloutGroup:
        if self._closed:
            raise StopIteration
        try:
            return self._runner.run(self._inner.__anext__())
        except StopAsyncIteration:
            self.close()
            raise StopIteration from None
        except BaseException:
            self.close()
            raise

    def stats(self) -> StreamStats:
        """See :meth:`RolloutStream.stats`."""
        return self._inner.stats()

    @property
    def policy_version(self) -> int:
        """See :attr:`RolloutStream.policy_version`."""
        return self._inner.policy_version

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
        """See :meth:`RolloutStream.next_batch`; an error closes the stream."""
        try:
            return self._run(
                self._inner.next_batch(
                    n_groups, timeout_s=timeout_s, oversample=oversample, carry_over=carry_over
                )
            )
        except UsageError:
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
        self._closed = True
        try:
            return self._runner.run(self._inner.aclose_and_drain())
        finally:
            self._runner.close()

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
