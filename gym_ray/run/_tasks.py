"""Small helpers for structured concurrency."""

from __future__ import annotations

import asyncio


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
