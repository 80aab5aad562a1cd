"""The input side of :func:`gym_ray.stream`: a fillable row source, source adaptation and row stamping.

:class:`RowFeed` is the async row source a trainer fills while a stream runs. :func:`aiter_rows` turns any
accepted input (a list, a sync iterator, an async iterator) into one async iterator, and
:func:`stamp_rows` copies an input row into the rollout rows the stream sends to its workers.

Concurrency: a :class:`RowFeed` is read by one event loop (the stream's); ``put`` / ``close`` may be called
from that loop or from one other thread (a :func:`~gym_ray.stream_sync` caller's). It holds every row
put and not yet read, so its memory is the caller's to bound (the stream
reads rows only as fast as its backpressure allows).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

from gym_ray import keys
from gym_ray.errors import InputError, UsageError

__all__ = ["RowFeed", "aiter_rows", "stamp_rows"]

Row = dict[str, Any]


class RowFeed:
    """An async row source a trainer fills while the stream runs: ``put`` rows, ``close`` when done.

    Example::

        feed = RowFeed()
        async with gym_ray.stream(feed, config=cfg, group_size=4) as rollouts:
            feed.put_many(prompts)
            group = await anext(rollouts)
    """

    def __init__(self) -> None:
        self._rows: deque[Mapping[str, Any]] = deque()
        self._closed = False
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the reading loop, once it reads

    def _wake(self) -> None:
        """Wake the reader, from its own loop or from another thread."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            self._event.set()
        else:
            loop.call_soon_threadsafe(self._event.set)

    def put(self, row: Mapping[str, Any]) -> None:
        """Add one row.

        Raises:
            UsageError: The feed is closed.
        """
        if self._closed:
            raise UsageError("RowFeed.put after close(): the stream already knows its input has ended")
        self._rows.append(row)
        self._wake()

    def put_many(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Add rows in order."""
        for row in rows:
            self.put(row)

    def close(self) -> None:
        """End the input: the stream finishes once every row put so far is delivered."""
        self._closed = True
        self._wake()

    def __aiter__(self) -> AsyncIterator[Mapping[str, Any]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Mapping[str, Any]]:
        self._loop = asyncio.get_running_loop()
        while True:
            while self._rows:
                yield self._rows.popleft()
            if self._closed:
                return
            self._event.clear()
            await self._event.wait()


async def aiter_rows(
    rows: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
) -> AsyncIterator[Mapping[str, Any]]:
    """Yield the rows of a sync or async iterable, in order, one at a time (nothing is read ahead)."""
    if isinstance(rows, AsyncIterable):
        async for row in rows:
            yield row
    else:
        for row in rows:
            yield row


def _validated(rows: list[Row], topology: Any) -> list[Row]:
    from gym_ray.plan.validation import resolve_task_sources, stamp_environment_agent_refs, validate_rows

    rows = resolve_task_sources(stamp_environment_agent_refs(rows, topology), topology)
    validate_rows(rows, topology)
    return rows


def stamp_rows(
    raw: Any, *, position: int, task: int, run_id: str, group_size: int | None, topology: Any
) -> list[Row]:
    """The rollout rows of one input row: stamped copies, validated against the running config.

    Args:
        raw: The input row as read.
        position: Its position in the input (0-based, counting input rows), for error messages.
        task: Its task index (``_ng_task_index``).
        run_id: The run id stamped unless the row names its own (``_ng_run_id``).
        group_size: ``None`` for one copy (rollout index as given, else 0); else this many copies with
            rollout indices ``0 .. group_size - 1``.
        topology: The resolved running topology the rows are validated against.

    Returns:
        One row, or ``group_size`` rows in rollout-index order.

    Raises:
        InputError: ``raw`` is not a dict.
        ValidationError: The rows disagree with the running config.
    """
    if not isinstance(raw, Mapping):
        raise InputError(
            f"stream input row {position} is a {type(raw).__name__}, not a JSON object (dict); "
            "pass rows as dicts",
            row=position,
        )
    base: Row = {**raw, keys.TASK_INDEX: task}
    base.setdefault(keys.RUN_ID, run_id)
    if group_size is None:
        base.setdefault(keys.ROLLOUT_INDEX, 0)
        return _validated([base], topology)
    rows = [{**base, keys.ROLLOUT_INDEX: j} for j in range(group_size)]
    return _validated(rows, topology)
