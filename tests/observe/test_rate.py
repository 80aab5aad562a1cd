"""RateMeter (rate and ETA from counts over a time window) and the distributed progress view built on it,
with a stubbed clock: exact rates and ETAs computed by hand."""

from __future__ import annotations

import io

import pytest

from gym_ray.distributed.live import ProgressSnapshot, ProgressView
from gym_ray.errors import UsageError
from gym_ray.observe.rate import RateMeter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_is_unknown_until_time_passes_then_counts_over_the_window() -> None:
    clock = FakeClock()
    meter = RateMeter(window_s=10.0, clock=clock)
    assert (meter.rate_per_s(), meter.eta_s(5)) == (None, None)
    meter.observe(67)  # work done before the meter existed: a baseline, not a burst
    assert (meter.rate_per_s(), meter.eta_s(5)) == (None, None)
    clock.now += 2.0
    meter.observe(77)
    assert meter.rate_per_s() == 5.0  # (77 - 67) / 2
    assert meter.eta_s(100) == 20.0
    assert meter.eta_s(0) == 0.0


def test_window_forgets_old_history() -> None:
    clock = FakeClock()
    meter = RateMeter(window_s=10.0, clock=clock)
    for _ in range(10):  # 100/s for 10 s
        meter.observe(0 if meter.count is None else meter.count + 100)
        clock.now += 1.0
    meter.observe(1000)  # t = 1010
    for _ in range(10):  # then 10/s for 10 s
        clock.now += 1.0
        meter.observe(meter.count + 10)  # type: ignore[operator]
    assert clock.now == 1020.0
    # the window starts at the newest sample at least 10 s old: (1010, 1000); now (1020, 1100)
    assert meter.rate_per_s() == pytest.approx(10.0)
    assert meter.eta_s(50) == pytest.approx(5.0)


def test_a_stall_brings_the_rate_to_zero_and_the_eta_to_unknown() -> None:
    clock = FakeClock()
    meter = RateMeter(window_s=5.0, clock=clock)
    meter.observe(0)
    clock.now += 1.0
    meter.observe(10)
    assert meter.rate_per_s() == 10.0
    clock.now += 2.0  # nothing new for 2 s: 10 counts over 3 s
    assert meter.rate_per_s() == pytest.approx(10 / 3)
    clock.now += 10.0  # nothing for longer than the window
    assert meter.rate_per_s() == 0.0
    assert meter.eta_s(1) is None


def test_memory_stays_bounded_however_often_it_is_fed() -> None:
    clock = FakeClock()
    meter = RateMeter(window_s=30.0, clock=clock)
    for count in range(100_000):
        clock.now += 0.001  # 1000 observations per second for 100 s
        meter.observe(count)
    assert len(meter._samples) <= 66
    assert meter.rate_per_s() == pytest.approx(1000.0, rel=0.02)


@pytest.mark.parametrize("window_s", [0, -1.0, True])
def test_bad_window(window_s: float) -> None:
    with pytest.raises(UsageError, match="window_s"):
        RateMeter(window_s=window_s)


def _snapshot(total: int | None, done: int, *, failed: int = 0, already_done: int = 0) -> ProgressSnapshot:
    return ProgressSnapshot(total=total, done=done, failed=failed, by_server={}, already_done=already_done)


def test_distributed_view_gives_the_true_rate_and_eta() -> None:
    """The issue's case: the first snapshot with a total arrives with 67 rows already done (13.8 s run of
    400 rows): it is the baseline, so no "5718187.1/s ... ETA 0s"."""
    clock = FakeClock()
    stream = io.StringIO()
    view = ProgressView(stream=stream, clock=clock, interval_s=0.0, enabled=True)
    view(_snapshot(None, 0))  # input not validated yet: nothing shown
    clock.now += 3.0
    view(_snapshot(400, 67))
    clock.now += 1.0
    view(_snapshot(400, 96, failed=1))  # 29 in 1 s
    clock.now += 1.0
    view(_snapshot(400, 125, failed=1))  # 29 in 1 s
    view.close()
    assert stream.getvalue().splitlines() == [
        "67/400 (16.8%) --/s failed 0 ETA --",
        "96/400 (24.0%) 29.0/s failed 1 ETA 10s",  # 304 left / 29 per s = 10.5 s -> 10s
        "125/400 (31.2%) 29.0/s failed 1 ETA 9s",  # 275 / 29 = 9.48 s; close() does not repeat it
    ]


class TickingClock(FakeClock):
    """A clock that moves 1 ms at every reading, as a real one does between two calls."""

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def test_a_run_shorter_than_a_poll_prints_one_final_line_without_a_made_up_rate() -> None:
    """Issue 30: the first snapshot with a total is the final one (a 30-row run done before the first
    poll): one line, the rate unknown ("--/s"), never the same line twice with "0.0/s"."""
    clock = TickingClock()
    stream = io.StringIO()
    view = ProgressView(stream=stream, clock=clock, interval_s=1.0, enabled=True)
    view(ProgressSnapshot(total=30, done=30, failed=0, by_server={"arith_env": (30, 21.0)}))
    view.close()
    assert stream.getvalue() == "30/30 (100.0%) --/s failed 0 ETA 0s | arith_env 0.70\n"


def test_distributed_view_leaves_rows_of_an_earlier_run_out_of_the_rate() -> None:
    clock = FakeClock()
    stream = io.StringIO()
    view = ProgressView(stream=stream, clock=clock, interval_s=0.0, enabled=True)
    view(_snapshot(100, 10))
    clock.now += 2.0
    # a resumed shard finished: 30 of its rows were done by an earlier run, 10 new ones in 2 s
    view(_snapshot(100, 50, already_done=30))
    assert stream.getvalue().splitlines()[-1] == "50/100 (50.0%) 5.0/s failed 0 ETA 10s"
