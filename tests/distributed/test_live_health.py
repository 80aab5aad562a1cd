"""The distributed progress line's server health: worker samples merged per server, the line naming a down
server at once and its return once (the view fed snapshots by hand, with an injected clock)."""

from __future__ import annotations

import io

from gym_ray.dispatch.health import ServerHealthSample, health_summary, merge_health
from gym_ray.distributed.live import ProgressSnapshot, ProgressView


def _sample(
    server: str, state: str, down_s: float = 0.0, failures: int = 0, outages: int = 0
) -> ServerHealthSample:
    return ServerHealthSample(server, f"http://127.0.0.1:1/{server}", state, down_s, failures, outages, "")


def test_merge_keeps_the_worst_state_and_the_longest_time_in_it() -> None:
    merged = merge_health(
        [
            _sample("calc_env", "up", 0.0, failures=1),
            _sample("calc_env", "down", 4.0, failures=3, outages=1),
            _sample("calc_env", "down", 7.0, failures=5, outages=1),
            _sample("math_env", "paused", 2.0, failures=1),
            _sample("math_env", "up", 0.0),
        ]
    )
    assert merged["calc_env"] == _sample("calc_env", "down", 7.0, failures=9, outages=2)
    assert merged["math_env"] == _sample("math_env", "paused", 2.0, failures=1)
    assert health_summary(merged.values()) == "calc_env down 7s, math_env paused"
    assert health_summary([_sample("calc_env", "up")]) == ""


def _snapshot(done: int, health: list[ServerHealthSample]) -> ProgressSnapshot:
    return ProgressSnapshot(
        total=100,
        done=done,
        failed=0,
        by_server={"calc_env": (done, float(done))},
        health={s.server: s for s in health},
    )


def test_the_line_names_a_down_server_at_once_and_its_return_once() -> None:
    now = [0.0]
    out = io.StringIO()
    view = ProgressView(stream=out, clock=lambda: now[0], interval_s=30.0, enabled=True)
    steps: list[tuple[float, int, list[ServerHealthSample]]] = [
        (0.0, 10, [_sample("calc_env", "up")]),  # the first line
        (1.0, 20, [_sample("calc_env", "up")]),  # within interval_s: no line
        (2.0, 20, [_sample("calc_env", "down", 3.0)]),  # down: a line at once
        (3.0, 20, [_sample("calc_env", "down", 4.0)]),  # still down: no new line
        (5.0, 20, [_sample("calc_env", "up")]),  # back: a line at once, after 4 + 2 s
        (6.0, 30, [_sample("calc_env", "up")]),  # the "back" phrase goes without a line of its own
    ]
    for at, done, health in steps:
        now[0] = at
        view(_snapshot(done, health))
    view.close()
    assert out.getvalue().splitlines() == [
        "10/100 (10.0%) --/s failed 0 ETA -- | calc_env 1.00",
        "20/100 (20.0%) 5.0/s failed 0 ETA 16s | calc_env 1.00 | calc_env down 3s",
        "20/100 (20.0%) 2.0/s failed 0 ETA 40s | calc_env 1.00 | calc_env back after 6s",
        "30/100 (30.0%) 3.3/s failed 0 ETA 21s | calc_env 1.00",
    ]


def test_a_server_down_at_the_first_snapshot_is_named_on_a_line_with_that_snapshots_counts() -> None:
    # The line a health change writes at once carries the counts of the snapshot that told it: a run whose
    # server went down before the first poll printed "0/1200 ... | calc_env down" (issue 34's CI runs).
    out = io.StringIO()
    view = ProgressView(stream=out, clock=lambda: 0.0, interval_s=30.0, enabled=True)
    view(_snapshot(41, [_sample("calc_env", "down", 1.0)]))
    view.close()
    assert out.getvalue().splitlines() == [
        "41/100 (41.0%) --/s failed 0 ETA -- | calc_env 1.00 | calc_env down 1s"
    ]
