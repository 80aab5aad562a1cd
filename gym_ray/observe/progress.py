"""A one-line progress display for a collection: done / total, rate, failures, ETA, per-server mean reward.

:class:`ProgressDisplay` renders from absolute counts; :class:`ProgressCounter` turns the stream of
``(row, record)`` pairs that recording produces (``run_shards``' ``on_outcome`` hook) into those counts.

Output promises: the display writes at most one line per ``interval_s`` (an in-place ``\\r`` rewrite on a
TTY, a full ``\\n``-terminated line otherwise) and one final line on :meth:`ProgressDisplay.close`, unless
the last line written already shows the final counts (a line is never repeated; on a TTY close then only
ends the line). A stream that fails (closed, full disk) ends the display, never the run.
A disabled display (the default when the stream is not a TTY) writes nothing; an update then only stores
the counts. Both classes are meant for one thread / event loop; they do no locking.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from gym_ray import keys
from gym_ray.errors import UsageError
from gym_ray.observe.rate import DEFAULT_RATE_WINDOW_S, RateMeter

__all__ = ["ProgressCounter", "ProgressDisplay", "format_duration"]

logger = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """A short human duration: ``"12s"``, ``"3m05s"``, ``"2h07m"`` (rounded to the second, then cut)."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    if isatty is None:
        return False
    try:
        return bool(isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


class ProgressDisplay:
    """Renders ``"1234/5000 (24.7%) 310.2/s failed 3 ETA 12s | arith_env 0.84 arith_env_hard 0.69"``.

    The rate is rollouts settled per second over the last ``window_s`` seconds (a
    :class:`~gym_ray.observe.rate.RateMeter`; ``--/s`` while unknown: with ``baseline=None``, until a
    second update); the ETA is the rollouts left at
    that rate (``--`` while the rate is unknown or zero); each environment server shows its mean reward
    over its successes (``-`` with none), servers in name order.

    Args:
        total: Rollouts this display expects (>= 0).
        stream: Where lines go.
        interval_s: Minimum seconds between two rendered lines (>= 0).
        clock: Monotonic clock (injectable for tests).
        enabled: Write at all; None means "when ``stream`` is a TTY".
        baseline: The count at construction (0: the display is built before any work is done). None
            when work may already be done: the first update is then the baseline of the rate.
        window_s: Seconds of history the rate is measured over.

    Raises:
        UsageError: ``total`` or ``interval_s`` is negative.
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO = sys.stderr,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool | None = None,
        baseline: int | None = 0,
        window_s: float = DEFAULT_RATE_WINDOW_S,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise UsageError(f"ProgressDisplay total={total!r} must be an int >= 0 (the rollouts expected)")
        if not interval_s >= 0:
            raise UsageError(f"ProgressDisplay interval_s={interval_s!r} must be a number of seconds >= 0")
        self.total = total
        self._stream = stream
        self._interval_s = interval_s
        self._clock = clock
        self._tty = _is_tty(stream)
        self.enabled = self._tty if enabled is None else enabled
        self.meter = RateMeter(window_s=window_s, clock=clock)
        if baseline is not None:
            self.meter.observe(baseline)
        # Without a baseline the first update is the rate's start: no rate until a second one.
        self._updates_before_rate = 0 if baseline is not None else 2
        self._updates = 0
        self._shown: tuple[Any, ...] | None = None  # the counts of the last line written
        self._last_render: float | None = None
        self._width = 0
        self._closed = False
        self.done = 0
        self.failed = 0
        self.by_server: dict[str, tuple[int, float]] = {}
        #: Appended to the line when not empty (server health: ``"calc_env down 12s"``).
        self.note = ""
        self.failed_by_class: dict[str, int] = {}

    def update(
        self,
        *,
        done: int,
        failed: int,
        by_server: Mapping[str, tuple[int, float]],
        rate_count: int | None = None,
        failed_by_class: Mapping[str, int] | None = None,
        now: bool = False,
    ) -> None:
        """Take the counts as they stand and render if ``interval_s`` has passed since the last line (or
        ``now``: a server's outage or return, shown at once with these counts).

        Args:
            done: Rollouts settled so far (successes and failures).
            failed: Of those, the failures.
            by_server: Environment server -> (successes, sum of their rewards).
            rate_count: The count the rate is measured on, when it differs from ``done`` (e.g. without
                the rows an earlier run of the same folder settled, which arrive in jumps).
            failed_by_class: Failures by class, shown after the failure count when not empty.
        """
        self.meter.observe(done if rate_count is None else rate_count)
        self._updates += 1
        self.done = done
        self.failed = failed
        self.by_server = dict(by_server)
        self.failed_by_class = dict(failed_by_class or {})
        if not self.enabled or self._closed:
            return
        at = self._clock()
        if not now and self._last_render is not None and at - self._last_render < self._interval_s:
            return
        self._last_render = at
        self._write(self.render(), final=False)

    def render(self) -> str:
        """The progress line for the counts as they stand (no line ending)."""
        now = self._clock()
        rate_known = self._updates >= self._updates_before_rate
        rate_per_s = self.meter.rate_per_s(now=now) if rate_known else None
        rate = "--" if rate_per_s is None else f"{rate_per_s:.1f}"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        remaining = self.total - self.done
        eta_s = self.meter.eta_s(remaining, now=now) if rate_known or remaining <= 0 else None
        eta = "--" if eta_s is None else format_duration(eta_s)
        classes = ", ".join(f"{k}={v}" for k, v in sorted(self.failed_by_class.items()))
        failed = f"{self.failed} ({classes})" if classes else str(self.failed)
        line = f"{self.done}/{self.total} ({percent:.1f}%) {rate}/s failed {failed} ETA {eta}"
        if self.by_server:
            means = " ".join(
                f"{name} {_mean(successes, reward_sum)}"
                for name, (successes, reward_sum) in sorted(self.by_server.items())
            )
            line = f"{line} | {means}"
        if self.note:
            line = f"{line} | {self.note}"
        return line

    def set_note(self, note: str) -> None:
        """Show ``note`` at the end of the line from now on ("" removes it) and render at once."""
        if note == self.note:
            return
        self.note = note
        if self.enabled and not self._closed:
            self._last_render = self._clock()
            self._write(self.render(), final=False)

    def close(self) -> None:
        """Write the final line (when enabled and the last line written shows other counts). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self._shown == self._counts():
            if self._tty:  # the in-place line already shows the final counts: only end it
                self._emit("\n")
            return
        self._write(self.render(), final=True)

    def _counts(self) -> tuple[Any, ...]:
        """What a line shows apart from the rate and the ETA."""
        return (
            self.done,
            self.total,
            self.failed,
            tuple(sorted(self.by_server.items())),
            tuple(sorted(self.failed_by_class.items())),
            self.note,
        )

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, line: str, *, final: bool) -> None:
        self._shown = self._counts()
        if self._tty:
            padded = line.ljust(self._width)
            self._width = len(line)
            self._emit("\r" + padded + ("\n" if final else ""))
        else:
            self._emit(line + "\n")

    def _emit(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError) as exc:  # a closed or full stream ends the display, never the run
            self.enabled = False
            logger.debug("progress: display stopped: %s: %s", type(exc).__name__, exc)


def _mean(successes: int, reward_sum: float) -> str:
    if successes <= 0 or not math.isfinite(reward_sum):
        return "-"
    return f"{reward_sum / successes:.2f}"


class ProgressCounter:
    """Counts ``(row, record)`` outcomes and feeds a :class:`ProgressDisplay` (an ``on_outcome`` hook).

    Every record counts as done. A record carrying ``_ng_failure_class`` (failures, and drained rows that
    were not dispatched) counts as failed; any other is a success of its ``_ng_environment_server`` (the
    record's, else the row's, else ``"?"``) and adds its numeric ``reward`` (none: 0) to that server's sum.

    Args:
        display: Updated after each outcome; None only counts.
    """

    def __init__(self, display: ProgressDisplay | None = None) -> None:
        self.display = display
        self.done = 0
        self.failed = 0
        self.by_server: dict[str, tuple[int, float]] = {}

    def __call__(self, row: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """Count one outcome (see the class docstring) and update the display."""
        self.done += 1
        if keys.FAILURE_CLASS in record:
            self.failed += 1
        else:
            server = record.get(keys.ENVIRONMENT_SERVER, row.get(keys.ENVIRONMENT_SERVER))
            name = server if isinstance(server, str) else "?"
            reward = record.get(keys.REWARD)
            value = float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else 0.0
            successes, reward_sum = self.by_server.get(name, (0, 0.0))
            self.by_server[name] = (successes + 1, reward_sum + value)
        if self.display is not None:
            self.display.update(done=self.done, failed=self.failed, by_server=self.by_server)
