"""R15/R16: an environment server goes down mid-run.

Down shorter than ``server_outage_timeout_s``: its rows wait (no failure record, no rollout attempt spent),
a probe finds it back, the run completes with the ledger at 0. Down longer: the run stops with
``ServerOutageError`` naming the server, records nothing for the rows it held back, and a rerun completes.
The reference servers are real (127.0.0.1); the outage is a real stop and restart on the same port.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gym_ray.bench.chaos import failure_records
from gym_ray.distributed.api import acollect
from gym_ray.errors import ServerOutageError
from gym_ray.record.ledger import check_run
from gym_ray.record.status import format_status, run_status
from gym_ray.run.collect import acollect_local
from gym_ray.servers import calc_config, calc_rows, serve_config, start_in_thread

pytestmark = pytest.mark.timeout(180)


def _config(latency_ms: int) -> dict[str, Any]:
    return calc_config(seed=3, latency_ms=latency_ms, latency_jitter_ms=0)


# The scenario helpers `gym-ray bench chaos` uses (one copy, in the package).
_rows = calc_rows
_failure_lines = failure_records


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def print_figures(name: str, **figures: Any) -> None:
    print(f"[chaos {name}] " + " ".join(f"{k}={v}" for k, v in figures.items()))


async def _outage_run(
    tmp_path: Path, outage_s: float, rows: int, capsys: pytest.CaptureFixture[str] | None = None
) -> None:
    async with serve_config(_config(latency_ms=5)) as dep:
        out = tmp_path / "run"
        run = asyncio.create_task(
            acollect_local(
                dep.config,
                rows=_rows(rows),
                output_dir=str(out),
                shard_size=100,
                max_resident_tasks=16,
                server_outage_timeout_s=120.0,
                progress=capsys is not None,
            )
        )
        try:
            await _until(lambda: dep.stats("calc_env").requests >= rows // 4, "a quarter of the rows")
            await dep.stop_server("calc_env")
            stopped = time.monotonic()
            await asyncio.sleep(outage_s)  # the length of the outage (the fault itself)
            await dep.restart_server("calc_env")
            result = await run
        finally:
            run.cancel()
        report = check_run(out)
        print_figures(
            f"R15 outage {outage_s:g}s",
            failure_records=_failure_lines(out),
            succeeded=result.succeeded,
            lost=report.lost,
            missing=report.missing,
            duplicates=report.duplicates,
            corrupt=report.corrupt_lines,
            recovered_after_s=round(time.monotonic() - stopped, 1),
            requests=dep.stats("calc_env").requests,
        )
        assert (result.planned, result.succeeded, result.failed) == (rows, rows, 0)
        assert _failure_lines(out) == 0
        assert (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)
        assert report.ok
    if capsys is not None:  # the progress lines showed the outage while it lasted, and its end
        lines = capsys.readouterr().err.splitlines()
        assert any(re.search(r" \| calc_env down \d+s$", line) for line in lines)
        assert lines[-1].startswith(f"{rows}/{rows} (100.0%)")
        assert "down" not in lines[-1]


async def test_a_short_server_outage_mid_run_costs_no_failure_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await _outage_run(tmp_path, outage_s=3.0, rows=300, capsys=capsys)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GYM_RAY_SLOW_TESTS"), reason="20 s outage; set GYM_RAY_SLOW_TESTS=1")
async def test_a_twenty_second_server_outage_mid_run_costs_no_failure_record(tmp_path: Path) -> None:
    await _outage_run(tmp_path, outage_s=20.0, rows=600)


async def test_a_server_down_past_the_timeout_stops_the_run_resumable(tmp_path: Path) -> None:
    async with serve_config(_config(latency_ms=5)) as dep:
        out = tmp_path / "run"
        settings: dict[str, Any] = {"shard_size": 50, "max_resident_tasks": 8, "server_outage_timeout_s": 2.0}
        run = asyncio.create_task(
            acollect_local(dep.config, rows=_rows(200), output_dir=str(out), **settings)
        )
        try:
            await _until(lambda: dep.stats("calc_env").requests >= 40, "40 requests")
            await dep.stop_server("calc_env")
            with pytest.raises(
                ServerOutageError, match=r"environment server 'calc_env' \(http://127\.0\.0\.1:\d+\)"
            ):
                await run
        finally:
            run.cancel()
        assert _failure_lines(out) == 0
        partial = check_run(out)
        assert (partial.lost, partial.duplicates, partial.corrupt_lines) == (0, 0, 0)
        recorded_before = 200 - partial.missing
        assert 0 < recorded_before < 200
        assert not (out / "rollouts.jsonl").exists()  # the run never finalized
        status = run_status(out)
        text = format_status(status)
        assert f"0 failed, {200 - recorded_before} pending of 200 planned rollouts" in text
        # R22: the state file says the run stopped, and why, and the lock is free
        assert (status.state, status.stopped_by, status.holder) == ("stopped", "server-outage", None)
        assert re.fullmatch(
            rf"state: stopped by a server outage at [0-9: -]+ UTC \(collect pid {os.getpid()} on host .+, "
            r"started [0-9: -]+ UTC\): environment server 'calc_env' \(http://127\.0\.0\.1:\d+\) was down "
            r"for \d+ s",
            text.splitlines()[0],
        )
        assert (status.rate_per_s, status.eta_s) == (None, None)
        assert re.search(
            r"\nstopped at [0-9: -]+ UTC: environment server 'calc_env' \(http://127\.0\.0\.1:\d+\) was "
            r"down for [0-9.]+ s \(server_outage_timeout_s\); bring it back, then rerun on this folder to "
            r"resume\n",
            text,
        )

        await dep.restart_server("calc_env")
        result = await acollect_local(dep.config, rows=_rows(200), output_dir=str(out), **settings)
        report = check_run(out)
        print_figures(
            "R16 outage past timeout",
            recorded_before=recorded_before,
            resumed=result.dispatched,
            failure_records=_failure_lines(out),
            lost=report.lost,
            missing=report.missing,
            duplicates=report.duplicates,
        )
        assert (result.succeeded, result.failed, result.dispatched) == (200, 0, 200 - recorded_before)
        assert (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)
        rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
        assert len(rollouts) == 200
        final = run_status(out)
        assert "stopped at" not in format_status(final)
        assert (final.state, final.finished_complete, final.pending) == ("finished", True, 0)


@pytest.mark.ray
async def test_a_distributed_run_stops_with_server_outage_error_and_a_rerun_completes(
    ray_session: Any, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    settings: dict[str, Any] = {"shard_size": 40, "max_resident_tasks": 8, "server_outage_timeout_s": 2.0}
    with start_in_thread(_config(latency_ms=5)) as servers:
        run = asyncio.create_task(
            acollect(servers.config, rows=_rows(200), output_dir=str(out), num_workers=1, **settings)
        )
        try:
            await _until(lambda: servers.stats("calc_env").requests >= 40, "40 requests", timeout_s=120)
            await asyncio.to_thread(servers.stop_server, "calc_env")
            with pytest.raises(
                ServerOutageError, match=r"environment server 'calc_env' \(http://127\.0\.0\.1"
            ):
                await run
        finally:
            run.cancel()
        assert _failure_lines(out) == 0
        await asyncio.to_thread(servers.restart_server, "calc_env")
        result = await acollect(
            servers.config, rows=_rows(200), output_dir=str(out), num_workers=1, **settings
        )
    report = check_run(out)
    assert (result.succeeded, result.failed) == (200, 0)
    assert (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)


_NUMBERS = r"\d+/1200 \(\d+\.\d%\) (?:--|\d+\.\d)/s failed 0 ETA \S+ \| calc_env \d\.\d\d"


@pytest.mark.ray
async def test_the_progress_line_of_a_distributed_run_names_a_down_server_and_its_return(
    ray_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    # 1,200 rows: the run goes on for seconds after the restart, so a poll sees the server back.
    settings: dict[str, Any] = {"shard_size": 100, "max_resident_tasks": 4, "server_outage_timeout_s": 120.0}
    err: list[str] = []

    def seen(text: str) -> bool:
        err.append(capsys.readouterr().err)
        return text in "".join(err)

    with start_in_thread(_config(latency_ms=20)) as servers:
        run = asyncio.create_task(
            acollect(
                servers.config,
                rows=_rows(1200),
                output_dir=str(out),
                num_workers=2,
                progress=True,
                **settings,
            )
        )
        try:
            await _until(lambda: servers.stats("calc_env").requests >= 40, "40 requests", timeout_s=120)
            await asyncio.to_thread(servers.stop_server, "calc_env")
            # The outage lasts until the driver's line has named it (the worker's health reached the driver).
            await _until(lambda: seen("| calc_env down "), "a progress line naming calc_env down")
            await asyncio.to_thread(servers.restart_server, "calc_env")
            result = await run
        finally:
            run.cancel()
    err.append(capsys.readouterr().err)
    lines = "".join(err).splitlines()
    down = [line for line in lines if re.fullmatch(rf"{_NUMBERS} \| calc_env down \d+s", line)]
    back = [line for line in lines if re.fullmatch(rf"{_NUMBERS} \| calc_env back after \d+s", line)]
    naming = [line for line in lines if line.count("calc_env") > 1]
    print_figures("R15 ray progress", down_lines=len(down), back_lines=len(back), lines=len(lines))
    assert down, lines
    assert len(back) == 1, lines  # the return is told once
    assert lines.index(back[0]) > lines.index(down[0])
    assert sorted(naming) == sorted(down + back), lines  # no other wording names the server
    assert re.fullmatch(r"1200/1200 \(100\.0%\) \d+\.\d/s failed 0 ETA 0s \| calc_env 1\.00", lines[-1])
    assert (result.succeeded, result.failed) == (1200, 0)
    assert _failure_lines(out) == 0
    report = check_run(out)
    assert (report.lost, report.missing, report.duplicates, report.corrupt_lines) == (0, 0, 0, 0)
