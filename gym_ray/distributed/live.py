"""Live progress of a distributed run: absolute counts polled from the coordinator and the workers.

Counting (each outcome once): the coordinator sums the reports of *finished* shards (``succeeded``,
``failed``, ``already_done``, and successes with reward sums by environment server); each live worker's
:meth:`~gym_ray.distributed.worker.RolloutWorker.progress` holds what its *running* shards wrote and has
not reported yet (a shard's tally moves to the coordinator with its report). So
``done = coordinator + live workers`` is absolute: it includes rows settled by an earlier run of the same
folder (``already_done``, counted when their shard finishes; they carry no server breakdown).

Accepted approximations (for a display, never for results): the coordinator and the workers are read one
after the other, not atomically, and a shard's tally leaves the worker just before the coordinator counts
it, so a poll may miss a shard that is changing hands (never count it twice). When a worker dies, what its
running shards wrote disappears from the sum until a replacement finishes those shards: their report
counts those rollouts as ``already_done`` (without the server breakdown). The final snapshot, taken after
every worker returned, is exact for this run: a shard that failed (a server outage stopped it) is never
reported, and stays counted by the worker that wrote its outcomes.

Server health: each live worker also answers the health of the servers it sends to (its own
:class:`~gym_ray.dispatch.health.ServerHealth`); a snapshot merges them per server, the worst state winning
(:func:`~gym_ray.dispatch.health.merge_health`). A worker that finished or died is no longer asked, so a
server only it saw down leaves the line.

Display: :class:`ProgressView` turns the snapshots into the progress line (rate and ETA from counts over
a time window, :mod:`gym_ray.observe.rate`), ending with the servers that look down
(``| calc_env down 12s``) and, once, the return of one (``| calc_env back after 21s``). A change of which
servers are down (or back) is written at once, not at the next ``interval_s``.

Concurrency: :func:`poll_progress` is one loop owned by its caller (``run_actors`` cancels and joins it);
each poll issues one ``status`` call to the run's coordinator actor and one ``progress`` call per live worker.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from gym_ray.dispatch.health import ServerHealthSample, health_summary, merge_health
from gym_ray.observe.progress import ProgressDisplay

logger = logging.getLogger(__name__)

#: Seconds between two polls.
DEFAULT_PROGRESS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ProgressSnapshot:
    """The run's counts at one poll.

    Attributes:
        total: Rows of the run (known once the input is validated), else None.
        done: Rollouts settled so far (successes, failure records, and rows done by an earlier run).
        failed: Of those, failure records written by this run.
        by_server: Environment server -> (successes of this run, their reward sum).
        already_done: Of ``done``, the rows an earlier run of the same folder settled (counted when
            their shard finishes, so they arrive in jumps; the rate leaves them out).
        failed_by_class: Failure records by class, over the *finished* shards of this run (a running shard's
            failures count in ``failed`` only until its report arrives).
        health: Server name -> its health merged over the live workers (empty when none answered).
    """

    total: int | None
    done: int
    failed: int
    by_server: dict[str, tuple[int, float]]
    already_done: int = 0
    failed_by_class: dict[str, int] = field(default_factory=dict)
    health: dict[str, ServerHealthSample] = field(default_factory=dict)


ProgressHook = Callable[[ProgressSnapshot], None]


async def progress_snapshot(coordinator: Any, workers: Iterable[Any]) -> ProgressSnapshot:
    """One poll: the coordinator's finished-shard counts plus every reachable worker's running shards.

    Args:
        coordinator: Handle of the run's :class:`~gym_ray.distributed.coordinator.RunCoordinator` actor.
        workers: Handles of the live :class:`~gym_ray.distributed.worker.RolloutWorker` actors; a worker
            that does not answer (it died) is left out.
    """
    status = await coordinator.status.remote()
    answers = await asyncio.gather(*(w.progress.remote() for w in workers), return_exceptions=True)
    done = status.succeeded + status.failed + status.already_done
    failed = status.failed
    by_server = dict(status.by_server)
    samples: list[ServerHealthSample] = []
    for answer in answers:
        if isinstance(answer, BaseException):
            if not isinstance(answer, Exception):
                raise answer
            continue  # a dying worker: see the module docstring
        done += answer.succeeded + answer.failed
        failed += answer.failed
        by_server = _merged(by_server, answer.by_server)
        samples.extend(answer.health)
    return ProgressSnapshot(
        total=status.rows_total,
        done=done,
        failed=failed,
        by_server=by_server,
        already_done=status.already_done,
        failed_by_class=dict(status.failed_by_class),
        health=merge_health(samples),
    )


def _merged(
    left: Mapping[str, tuple[int, float]], right: Mapping[str, tuple[int, float]]
) -> dict[str, tuple[int, float]]:
    out = dict(left)
    for server, (count, reward) in right.items():
        have_count, have_reward = out.get(server, (0, 0.0))
        out[server] = (have_count + count, have_reward + reward)
    return out


async def poll_progress(
    coordinator: Any,
    workers: Callable[[], Iterable[Any]],
    on_progress: ProgressHook,
    *,
    interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
) -> None:
    """Call ``on_progress`` with a fresh snapshot every ``interval_s`` until cancelled.

    A poll that fails (an actor going away) is skipped and logged at debug level; cancellation
    propagates.

    Args:
        coordinator: Handle of the run's coordinator actor (the finished shards' counts).
        workers: Returns the live worker handles at each poll (replacements appear, dead ones go).
        on_progress: Receives each snapshot (runs in this event loop; keep it cheap).
        interval_s: Seconds between polls.
    """
    while True:
        await asyncio.sleep(interval_s)
        try:
            snapshot = await progress_snapshot(coordinator, list(workers()))
        except Exception as exc:
            logger.debug("progress: poll skipped: %s: %s", type(exc).__name__, exc)
            continue
        on_progress(snapshot)


class ProgressView:
    """The live progress line of a distributed run: snapshots in, a :class:`ProgressDisplay` line out.

    Use it as ``on_progress`` of :func:`gym_ray.distributed.api.run_actors`. The display is built at the
    first snapshot that knows the run's total (once the input is validated), with that snapshot as the
    baseline of the rate: work done before the view existed is never counted as done in no time. The
    rate (a :class:`~gym_ray.observe.rate.RateMeter` over ``window_s``) counts what this run settled
    (``done - already_done``); the ETA is the rows left (``total - done``) at that rate.

    Args:
        stream: Where the line goes.
        clock: Monotonic clock (injectable for tests).
        interval_s: Minimum seconds between two lines.
        enabled: Write at all; None means "when ``stream`` is a TTY".
    """

    def __init__(
        self,
        *,
        stream: TextIO = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 1.0,
        enabled: bool | None = True,
    ) -> None:
        self._stream = stream
        self._clock = clock
        self._interval_s = interval_s
        self._enabled = enabled
        self.display: ProgressDisplay | None = None
        # Servers down at the last snapshot: down_s then, and when that snapshot was taken.
        self._down: dict[str, tuple[float, float]] = {}
        self._shown: tuple[tuple[str, str], ...] = ()

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        """Take one snapshot (ignored until the total is known)."""
        if snapshot.total is None:
            return
        if self.display is None:
            self.display = ProgressDisplay(
                snapshot.total,
                stream=self._stream,
                clock=self._clock,
                interval_s=self._interval_s,
                enabled=self._enabled,
                baseline=None,
            )
        # servers down or back: a line at once, with this snapshot's counts; else the next regular line
        note, changed = self._health_note(snapshot.health)
        self.display.note = note
        self.display.update(
            done=snapshot.done,
            failed=snapshot.failed,
            by_server=snapshot.by_server,
            rate_count=snapshot.done - snapshot.already_done,
            failed_by_class=snapshot.failed_by_class,
            now=changed,
        )

    def _health_note(self, health: Mapping[str, ServerHealthSample]) -> tuple[str, bool]:
        """The end of the line: the servers that look down (and those just back); and whether that set
        changed since the last snapshot (the line is then written at once)."""
        now = self._clock()
        not_up = [s for s in health.values() if s.state != "up"]
        phrases = [health_summary(not_up)] if not_up else []
        back = sorted(
            name
            for name in self._down
            if name in health and health[name].state == "up"  # a server no worker sees is not "back"
        )
        for name in back:
            down_s, seen_at = self._down[name]
            phrases.append(f"{name} back after {down_s + (now - seen_at):.0f}s")
        self._down = {s.server: (s.down_s, now) for s in not_up if s.state in ("down", "outage")}
        shown = tuple(sorted((s.server, s.state) for s in not_up))
        changed = shown != self._shown or bool(back)
        self._shown = shown
        return ", ".join(phrases), changed

    def close(self) -> None:
        """Write the final line (when a display was built). Idempotent."""
        if self.display is not None:
            self.display.close()
