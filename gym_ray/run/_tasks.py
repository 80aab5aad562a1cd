"""Small helpers for structured concurrency."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error a caller should see from a task group: the first leaf that is not a cancellation.

    A ``TaskGroup`` wraps the failure of one child in an ``ExceptionGroup`` and cancels its siblings;
    callers of gym_ray want the original, typed error (``ShardLockError``, ``ValidationError``), not the
    group. When every leaf is a cancellation, the first one is returned.
    """
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, asyncio.CancelledError):
            return leaf
    return leaves[0] if leaves else group


async def in_stoppable_thread(
    fn: Callable[..., T], *args: Any, discard: Callable[[T], object] | None = None, **kwargs: Any
) -> T:
    """``fn(*args, stop=event, **kwargs)`` in a worker thread, stopped and joined if the caller is cancelled.

    A thread cannot be cancelled: ``asyncio.to_thread`` alone lets a cancelled caller (Ctrl-C, SIGTERM, a
    notebook's interrupt) go on while ``fn`` runs to its end, and the process then waits for it before it
    exits. Here a cancellation sets ``event`` (``fn`` checks it, e.g. through
    :func:`gym_ray.plan.load.until_stopped`), waits for ``fn`` to return or raise, hands a result that
    came too late to ``discard``, and re-raises the cancellation. A second cancellation stops the wait.
    """
    stop = threading.Event()
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args, stop=stop, **kwargs))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        stop.set()
        try:
            late = await job
        except Exception:  # what the stopped work raised (Stopped, ...): the cancellation is what counts
            pass
        else:
            if discard is not None:
                discard(late)
        raise
