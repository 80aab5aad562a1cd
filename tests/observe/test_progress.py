"""The progress display: exact lines with an injected clock, rate limiting, ETA, a real local run."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray import keys
from gym_ray.errors import UsageError
from gym_ray.observe.progress import ProgressCounter, ProgressDisplay, format_duration
from gym_ray.run.collect import acollect_local
from gym_ray.servers import Deployment, calc_config, serve_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_render_is_exact() -> None:
    clock = FakeClock()
    display = ProgressDisplay(5000, stream=io.StringIO(), clock=clock, enabled=True)
    clock.now += 3.978
    display.update(done=1234, failed=3, by_server={"arith_env": (84, 70.56), "arith_env_hard": (100, 69.0)})
    assert (
        display.render() == "1234/5000 (24.7%) 310.2/s failed 3 ETA 12s | arith_env 0.84 arith_env_hard 0.69"
    )


@pytest.mark.parametrize(
    ("done", "elapsed_s", "by_server", "expected"),
    [
        pytest.param(0, 0.0, {}, "0/100 (0.0%) --/s failed 0 ETA --", id="nothing-done-no-time"),
        pytest.param(0, 3.0, {}, "0/100 (0.0%) 0.0/s failed 0 ETA --", id="nothing-done"),
        pytest.param(10, 5.0, {}, "10/100 (10.0%) 2.0/s failed 0 ETA 45s", id="seconds"),
        pytest.param(1, 5.0, {}, "1/100 (1.0%) 0.2/s failed 0 ETA 8m15s", id="minutes"),
        pytest.param(1, 100.0, {}, "1/100 (1.0%) 0.0/s failed 0 ETA 2h45m", id="hours"),
        pytest.param(
            100,
            4.0,
            {"b": (0, 0.0), "a": (2, 1.0)},
            "100/100 (100.0%) 25.0/s failed 0 ETA 0s | a 0.50 b -",
            id="done-sorted-servers",
        ),
    ],
)
def test_eta_and_server_means(
    done: int, elapsed_s: float, by_server: dict[str, tuple[int, float]], expected: str
) -> None:
    clock = FakeClock()
    display = ProgressDisplay(100, stream=io.StringIO(), clock=clock, enabled=False)
    clock.now += elapsed_s
    display.update(done=done, failed=0, by_server=by_server)
    assert display.render() == expected


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 59.4, 60, 3599, 3600, 7260)] == [
        "0s",
        "59s",
        "1m00s",
        "59m59s",
        "1h00m",
        "2h01m",
    ]


def test_lines_are_rate_limited_and_close_writes_the_final_line() -> None:
    clock = FakeClock()
    stream = io.StringIO()
    display = ProgressDisplay(4, stream=stream, clock=clock, interval_s=1.0, enabled=True)
    clock.now += 1.0
    display.update(done=1, failed=0, by_server={})  # first update renders
    clock.now += 0.5
    display.update(done=2, failed=1, by_server={})  # within the interval: no line
    clock.now += 0.5
    display.update(done=3, failed=1, by_server={})  # interval passed
    clock.now += 0.25
    display.update(done=4, failed=1, by_server={})  # within the interval: no line, close shows it
    display.close()
    display.close()  # idempotent
    display.update(done=4, failed=2, by_server={})  # after close: nothing
    assert stream.getvalue() == (
        "1/4 (25.0%) 1.0/s failed 0 ETA 3s\n"
        "3/4 (75.0%) 1.5/s failed 1 ETA 1s\n"
        "4/4 (100.0%) 1.8/s failed 1 ETA 0s\n"  # 4 in 2.25 s
    )


def test_close_never_repeats_the_last_line() -> None:
    """Issue 30: a short run printed its final line twice; close() writes nothing new when the last line
    already shows the final counts (a later clock changes only the rate)."""
    clock = FakeClock()
    stream = io.StringIO()
    display = ProgressDisplay(4, stream=stream, clock=clock, interval_s=0.0, enabled=True)
    clock.now += 2.0
    display.update(done=4, failed=1, by_server={"a": (3, 3.0)})
    clock.now += 5.0
    display.close()
    assert stream.getvalue() == "4/4 (100.0%) 2.0/s failed 1 ETA 0s | a 1.00\n"


def test_tty_rewrites_in_place() -> None:
    clock = FakeClock()
    stream = TtyStringIO()
    display = ProgressDisplay(20, stream=stream, clock=clock, interval_s=0.0)
    assert display.enabled  # auto: the stream is a TTY
    clock.now += 1.0
    display.update(done=10, failed=0, by_server={})
    clock.now += 1.0
    display.update(done=2, failed=0, by_server={})
    display.close()
    assert stream.getvalue() == (
        "\r10/20 (50.0%) 10.0/s failed 0 ETA 1s"
        "\r2/20 (10.0%) 1.0/s failed 0 ETA 18s "  # padded over the longer line
        "\n"  # close: the line already shows the final counts, so it is only ended
    )


def test_disabled_by_default_off_a_tty() -> None:
    stream = io.StringIO()
    display = ProgressDisplay(3, stream=stream)
    display.update(done=1, failed=0, by_server={})
    display.close()
    assert (display.enabled, stream.getvalue()) == (False, "")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        pytest.param({"total": -1}, "total=-1", id="negative-total"),
        pytest.param({"total": 1, "interval_s": -0.5}, "interval_s=-0.5", id="negative-interval"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UsageError, match=re.escape(fragment)):
        ProgressDisplay(**kwargs)


def test_counter_counts_successes_by_server_and_failures() -> None:
    clock = FakeClock()
    display = ProgressDisplay(5, stream=io.StringIO(), clock=clock, enabled=False)
    counter = ProgressCounter(display)
    counter({}, {keys.ENVIRONMENT_SERVER: "a", keys.REWARD: 1.0})
    counter({}, {keys.ENVIRONMENT_SERVER: "a", keys.REWARD: 0})
    counter({keys.ENVIRONMENT_SERVER: "b"}, {keys.REWARD: True})  # row stamp; a bool is not a reward
    counter({}, {keys.FAILURE_CLASS: "agent_run_error", keys.ENVIRONMENT_SERVER: "a"})
    assert (counter.done, counter.failed, counter.by_server) == (4, 1, {"a": (2, 1.0), "b": (1, 0.0)})
    clock.now += 2.0
    assert display.render() == "4/5 (80.0%) 2.0/s failed 1 ETA 0s | a 0.50 b 0.00"


def _config() -> dict[str, Any]:
    return calc_config(seed=3, latency_ms=0)


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    async with serve_config(_config()) as dep:
        yield dep


async def test_local_collection_ends_with_the_final_line(deployment: Deployment, tmp_path: Path) -> None:
    rows = [
        {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "expected_answer": str(i + 1),
            "difficulty": 0.0,
            "agent_ref": {"name": "calc_agent"},
            **({"fault": "500"} if i == 4 else {}),
        }
        for i in range(10)
    ]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        result = await acollect_local(
            deployment.config,
            rows=rows,
            output_dir=str(tmp_path / "run"),
            num_repeats=2,
            shard_size=6,
            route_failures_to_sidecar=True,
            max_rollout_attempts=1,
            progress=True,
        )
    assert (result.succeeded, result.failed) == (18, 2)
    lines = stderr.getvalue().splitlines()
    assert re.fullmatch(r"20/20 \(100\.0%\) \d+\.\d/s failed 2 ETA 0s \| calc_env 1\.00", lines[-1]), lines
    # a second run on the same folder has nothing left: its display expects 0 rollouts
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        await acollect_local(
            deployment.config,
            rows=rows,
            output_dir=str(tmp_path / "run"),
            num_repeats=2,
            shard_size=6,
            route_failures_to_sidecar=True,
            max_rollout_attempts=1,
            progress=True,
        )
    assert stderr.getvalue() == "0/0 (100.0%) 0.0/s failed 0 ETA 0s\n"


def test_a_batch_log_gets_a_plain_line_per_interval_with_failures_by_class() -> None:
    """Off a TTY (Slurm, kubectl logs): full lines, one per 30 s, failure classes after the count."""
    clock = FakeClock()
    stream = io.StringIO()
    display = ProgressDisplay(100, stream=stream, clock=clock, interval_s=30.0, enabled=True)
    clock.now += 10.0
    display.update(done=10, failed=0, by_server={})
    clock.now += 20.0  # 30 s after the start, 20 s after the first line: too soon
    display.update(done=30, failed=2, by_server={}, failed_by_class={"agent_request_failed": 2})
    clock.now += 10.0
    display.update(
        done=40, failed=3, by_server={}, failed_by_class={"timeout_exceeded": 1, "agent_request_failed": 2}
    )
    assert stream.getvalue() == (
        "10/100 (10.0%) 1.0/s failed 0 ETA 1m30s\n"
        "40/100 (40.0%) 1.0/s failed 3 (agent_request_failed=2, timeout_exceeded=1) ETA 1m00s\n"
    )
