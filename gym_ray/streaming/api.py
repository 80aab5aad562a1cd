"""``gym_ray.stream(rows, ...)``: open a :class:`~gym_ray.streaming.stream.RolloutStream` (the public entry).

Every option is documented on :func:`stream`; the stream itself, its workers and controls live in the
other modules of :mod:`gym_ray.streaming`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from typing import Any

from gym_ray.streaming.delivery import StaleCallback
from gym_ray.streaming.filters import GroupFilter
from gym_ray.streaming.stream import RolloutStream

__all__ = ["stream"]


def stream(
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
    retry_requests: bool = True,
    policy_version: int = 0,
    max_staleness: int | None = None,
    on_stale: StaleCallback | None = None,
    group_filter: GroupFilter | Sequence[GroupFilter] | None = None,
    max_groups_in_flight: int | None = None,
    health_check: bool = True,
    max_rollout_attempts: int = 1,
    one_version_groups: bool = False,
) -> RolloutStream:
    """Stream rollouts of ``rows`` from Ray worker actors, in completion order, with backpressure.

    Example::

        async with gym_ray.stream(rows, config=cfg, group_size=4, max_staleness=1,
                                  group_filter=gym_ray.drop_uniform_reward) as rollouts:
            for step in range(steps):
                batch = await rollouts.next_batch(8, oversample=1.25)   # 8 RolloutGroups
                train_on(batch)
                await rollouts.pause()                                  # weight sync
                await rollouts.set_policy_version(step + 1)
                await rollouts.resume()

    Args:
        rows: Input rows: a list, a sync iterator, or an async iterator (e.g. a :class:`RowFeed`) fed while
            the stream runs. Rows are copied and stamped with ``_ng_task_index`` (their own int, else a
            counter in input order), ``_ng_rollout_index`` and ``_ng_run_id``.
        config: The running config (dict, or YAML path); a head-only config is completed from the head.
            Run settings of ``gym-ray run`` (``num_repeats``, ``output_dir``, ...) and a ``tracing:`` block
            are refused, not ignored: the stream's own options below do their jobs.
        num_workers: Worker actors (``num_cpus=0`` each).
        group_size: Run each input row this many times and yield the task's rollouts together, as a
            :class:`~gym_ray.streaming.groups.RolloutGroup` ordered by rollout index, once all are done.
        max_in_flight: Rows admitted and not yet pulled, over all workers (split evenly; >= num_workers).
        buffer_size: Outcomes finished and not yet taken by the consumer (default ``max_in_flight``, or the
            run-ahead window when that is larger).
        timeout_s: Timeout of each ``/run`` request. A ``/run`` that times out on a server that still
            answers ``GET /`` is sent at most 3 times (once with ``retry_requests=False``), then delivered
            as a failure record stating its requests: about ``timeout_s`` x 3 + 1.5 s after it was first
            sent. A server that stops answering is an outage (its rows wait; see ``max_infra_retries``).
        record_dir: Record every delivered outcome in this run folder (shard ``stream-<run id>``).
        resume: Skip rows ``record_dir`` already holds as done (same input order as the recorded run).
        address: Ray cluster to join when Ray is not initialized (default ``RAY_ADDRESS``, else local).
        max_worker_restarts: Replacement workers allowed (default ``2 * num_workers``).
        retry_requests: Replay a ``/run`` the server may have received (a timeout, a dropped connection,
            429/502/503/504); False sends each ``/run`` once, except a connection that was never made.
        policy_version: The policy version at the start (see :meth:`RolloutStream.set_policy_version`).
        max_staleness: Deliver no rollout whose version is more than this many versions behind the version
            current at delivery; its row runs again under the current version (None: no bound). It also
            sizes the run-ahead window from the first ``next_batch(n)`` on: at most ``(max_staleness + 1)
            x n x group_size`` rollouts (``n`` times ``oversample``) are read and not yet delivered, less the
            batch the trainer holds until it moves the policy version, so generation never runs more than
            ``max_staleness`` batches ahead of training (0: nothing runs during a step), yet it keeps
            running while a step does (``stats().run_ahead``).
        on_stale: ``(row, outcome) -> None``, called with each stale rollout before its row runs again.
        group_filter: ``(group) -> bool`` (or a list of them; needs ``group_size``): a complete group is
            delivered only when every filter returns True, e.g. :func:`gym_ray.drop_uniform_reward`.
        max_groups_in_flight: Input rows (groups) read and not yet complete at most (None: bounded by
            ``max_in_flight`` only); ``next_batch(oversample=...)`` sets it too.
        health_check: Before Ray starts, probe every environment server of the config (``GET /``) and
            raise at once when one is unreachable or answers 5xx (False: rows to a server that is down
            wait for it, up to 300 s, then the stream raises ``ServerOutageError``).
        max_rollout_attempts: Data retries: a rollout the server answered with a failure (not terminal)
            runs again, with the next ``_ng_attempt_index``, until it succeeds or has run this many times;
            only then is its failure record delivered (default 1: delivered at once). Retries are counted
            in ``stats().retried``; pair it with :func:`gym_ray.drop_failed` to never deliver a group
            holding a failure.
        one_version_groups: Every delivered group ran under one policy version (GRPO's advantage assumes
            one policy per group): when a group completes with mixed versions (a member aborted by
            ``pause("abort")`` re-ran under the new version, or a member went stale), the members older
            than the newest run again under the current version; their discarded results count in
            ``stats().stale``. Off by default: turn it on for group-relative methods with aborts.

    Returns:
        The stream; nothing starts until ``async with``, :meth:`RolloutStream.start` or the first item.

    Raises:
        UsageError: A bad option (raised here), or a non-dict row (raised by iteration).
        ConfigError: The config is bad or sets a run setting (raised on start, before Ray starts).
        ServerConnectionError / ServerHTTPError: ``health_check`` found a server down (on start, before
            Ray starts).
        ValidationError: Rows disagree with the running config (raised by iteration).
    """
    return RolloutStream(
        rows,
        config=config,
        num_workers=num_workers,
        group_size=group_size,
        max_in_flight=max_in_flight,
        buffer_size=buffer_size,
        timeout_s=timeout_s,
        record_dir=record_dir,
        resume=resume,
        address=address,
        max_worker_restarts=max_worker_restarts,
        retry_requests=retry_requests,
        policy_version=policy_version,
        max_staleness=max_staleness,
        on_stale=on_stale,
        group_filter=group_filter,
        max_groups_in_flight=max_groups_in_flight,
        health_check=health_check,
        max_rollout_attempts=max_rollout_attempts,
        one_version_groups=one_version_groups,
    )
