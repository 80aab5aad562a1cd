"""Rate and ETA of a run from counts observed over time: one estimator for every progress view.

:class:`RateMeter` is fed absolute counts with their times (``observe(count)``) and answers the rate over
the last ``window_s`` seconds and the ETA of what is left at that rate. The TTY progress line, the batch
progress log line (both :class:`gym_ray.observe.progress.ProgressDisplay`), the distributed live view
(:mod:`gym_ray.distributed.live`) and ``gym-ray status`` (:mod:`gym_ray.record.status`) all use it, so
they agree on what "rate" means:

    rate = (count now - count at the window's start) / (now - window's start)

where the window's start is the newest sample at least ``window_s`` old (the oldest sample while the
meter is younger than the window). The count "now" is the last observed count: counts only change when
they are observed. With fewer than two points in time the rate is unknown (None), never a division by
an arbitrarily small elapsed time: a view built after work was already done treats its first count as
the baseline, not as work done in no time.

Memory is bounded: samples closer than ``window_s / 64`` to the previous one replace it, so at most about
65 samples are kept, however often ``observe`` is called. One thread / event loop; no locking.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from gym_ray.errors import UsageError

__all__ = ["DEFAULT_RATE_WINDOW_S", "RateMeter"]

#: Seconds of history the rate is measured over by default.
DEFAULT_RATE_WINDOW_S = 30.0
_RESOLUTION_PARTS = 64


class RateMeter:
    """Counts per second over a sliding time window, and the ETA of the rest at that rate.

    Example::

        meter = RateMeter(window_s=30.0)
        meter.observe(done)            # whenever the count is known (every outcome, every poll)
        meter.rate_per_s()             # None until two points in time; then per second over the window
        meter.eta_s(total - done)      # seconds left at that rate; 0 when nothing is left

    Args:
        window_s: Seconds of history the rate is measured over (> 0).
        clock: The clock the samples are taken with (monotonic by default; ``time.time`` works for
            wall-clock samples such as file timestamps).

    Raises:
        UsageError: ``window_s`` is not a positive number.
    """

    def __init__(
        self, *, window_s: float = DEFAULT_RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if isinstance(window_s, bool) or not isinstance(window_s, int | float) or not window_s > 0:
            raise UsageError(f"RateMeter window_s={window_s!r} must be a number of seconds > 0")
        self.window_s = float(window_s)
        self._clock = clock
        self._resolution_s = self.window_s / _RESOLUTION_PARTS
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, count: int, *, at: float | None = None) -> None:
        """Record that the count stood at ``count`` at time ``at`` (default: now by the clock).

        Samples must come in time order; a sample older than the newest one is ignored.
        """
        when = self._clock() if at is None else at
        samples = self._samples
        if samples and when < samples[-1][0]:
            return
        if len(samples) >= 2 and when - samples[-2][0] < self._resolution_s:
            samples[-1] = (when, count)  # close to the previous kept sample: move the newest one
        else:
            samples.append((when, count))
        self._trim(when)

    def _trim(self, now: float) -> None:
        # Keep exactly one sample at least window_s old: the start of the window.
        samples = self._samples
        while len(samples) >= 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()

    @property
    def count(self) -> int | None:
        """The last observed count (None before any)."""
        return self._samples[-1][1] if self._samples else None

    def rate_per_s(self, *, now: float | None = None) -> float | None:
        """Counts per second over the window ending ``now`` (default: the clock), or None when unknown
        (no sample yet, or no time has passed since the first one)."""
        if not self._samples:
            return None
        end = self._clock() if now is None else now
        self._trim(end)
        start_t, start_count = self._samples[0]
        elapsed = end - start_t
        if elapsed <= 0:
            return None
        return max(0, self._samples[-1][1] - start_count) / elapsed

    def eta_s(self, remaining: int, *, now: float | None = None) -> float | None:
        """Seconds until ``remaining`` more counts at the current rate: 0 when nothing remains, None when
        the rate is unknown or zero."""
        if remaining <= 0:
            return 0.0
        rate = self.rate_per_s(now=now)
        if rate is None or rate <= 0:
            return None
        return remaining / rate
