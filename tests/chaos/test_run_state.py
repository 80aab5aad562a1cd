"""R22: the run folder tells the truth about its run, with real processes.

A real ``gym-ray run --local`` process collects from the reference servers on 127.0.0.1 (in this
process). A run is held live deterministically by a row whose ``/run`` never answers (the row field
``fault: hang``): every other row is recorded, then the run waits on that one until it is stopped. Then:

- ``gym-ray status`` (and ``--json``) says ``running`` while it runs, then ``stopped`` by SIGTERM or Ctrl-C,
  or ``killed`` after SIGKILL (the lock is free but the state file still says running), with no rate or
  ETA once it is not running, and counts that add up to the planned rows;
- a finished run (complete, or every row failed) says ``finished`` with exactly the run summary's counts
  (the issue saw "pending 100 ... ETA 0s" where the summary said "100 failed, 0 pending");
- ``gym-ray aggregate`` on the live run is refused (exit 2, naming the run's pid as a second run is
  refused) and every file of the folder, the metrics file of the earlier run first, is byte for byte as
  it was; once the run is stopped, it aggregates.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.record.status import run_status
from gym_ray.servers import calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment, write_run_config
from tests.run._cli import cli_env, gym_ray

pytestmark = pytest.mark.timeout(120)

HOST = socket.gethostname()


@pytest.fixture
def servers() -> Iterator[ThreadedDeployment]:
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        yield deployment


def _rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _hanging_rows(path: Path) -> Path:
    """Rows 0-4 answer at once; row 5's ``/run`` never answers (on every attempt)."""
    return _rows(path, [*calc_rows(5), {**calc_rows(6)[5], "fault": "hang"}])


def _run_args(tmp_path: Path, servers: ThreadedDeployment, rows: Path, *extra: str) -> list[str]:
    config = tmp_path / "gym-ray-run.yaml"
    write_run_config(str(config), servers.head_url)
    out = tmp_path / "out"
    return ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}", *extra, "--local",
            "--progress", "off"]  # fmt: skip


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gym_ray.cli", *args],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _wait_live(run: subprocess.Popen[str], servers: ThreadedDeployment, out: Path, requests: int) -> None:
    """Until the hanging row's request arrived (every other row is recorded by then) and status says
    running."""
    _until(lambda: servers.stats("calc_env").requests >= requests or run.poll() is not None, "the hang")
    assert run.poll() is None, run.communicate()
    _until(lambda: run_status(out).state == "running", "status to say running")


def _snapshot(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _summary(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "rollouts_summary.json").read_text())
    return summary


@pytest.mark.parametrize(
    ("sig", "exit_status", "stopped_by", "first_line"),
    [
        pytest.param(signal.SIGTERM, 143, "sigterm", "state: stopped by SIGTERM at ", id="sigterm"),
        pytest.param(signal.SIGINT, 130, "ctrl-c", "state: stopped by Ctrl-C at ", id="ctrl-c"),
        pytest.param(signal.SIGKILL, -9, "killed", "state: stopped: killed (", id="sigkill"),
    ],
)
def test_status_says_running_then_how_the_run_stopped(
    tmp_path: Path,
    servers: ThreadedDeployment,
    sig: signal.Signals,
    exit_status: int,
    stopped_by: str,
    first_line: str,
) -> None:
    out = tmp_path / "out"
    run = _start(_run_args(tmp_path, servers, _hanging_rows(tmp_path / "rows.jsonl")), tmp_path)
    try:
        _wait_live(run, servers, out, requests=6)
        live = gym_ray(["status", str(out), "--json"], cwd=tmp_path)
        assert live.returncode == 0, live.stderr
        shown = json.loads(live.stdout)
        assert (shown["state"], shown["stopped_by"], shown["succeeded"], shown["pending"]) == (
            "running",
            None,
            5,
            1,
        )
        assert shown["holder"].startswith(f"collect pid {run.pid} on host {HOST}, started 20")
        assert shown["state_line"] == f"state: running ({shown['holder']})"
        run.send_signal(sig)
        run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == exit_status
    status = run_status(out)
    assert (status.state, status.stopped_by, status.holder, status.finished_complete) == (
        "stopped",
        stopped_by,
        None,
        None,
    )
    # every planned row is succeeded, failed or pending; the hanging one was never answered
    counts = (status.planned, status.succeeded, status.failed, status.pending, status.resumable)
    assert counts == (6, 5, 0, 1, 1)
    assert (status.rate_per_s, status.eta_s) == (None, None)
    shown_text = gym_ray(["status", str(out)], cwd=tmp_path)
    assert shown_text.returncode == 0
    lines = shown_text.stdout.splitlines()
    assert lines[0].startswith(first_line)
    assert f"(collect pid {run.pid} on host {HOST}, started 20" in lines[0]
    assert lines[1] == f"run {out}: 1 shard(s), 5 succeeded, 0 failed, 1 pending of 6 planned rollouts"
    assert not [line for line in lines if line.startswith("rate:") or "ETA" in line]


@pytest.mark.parametrize(
    ("fault", "exit_status", "counts", "outcome"),
    [
        pytest.param(None, 0, (4, 4, 0, 0, 0), "complete", id="complete"),
        pytest.param("500", 3, (4, 0, 4, 0, 4), "incomplete", id="all-failed"),
    ],
)
def test_status_of_a_finished_run_counts_what_its_summary_counts(
    tmp_path: Path,
    servers: ThreadedDeployment,
    fault: str | None,
    exit_status: int,
    counts: tuple[int, int, int, int, int],
    outcome: str,
) -> None:
    out = tmp_path / "out"
    rows = [{**row, "fault": fault} if fault else row for row in calc_rows(4)]
    run = gym_ray(_run_args(tmp_path, servers, _rows(tmp_path / "rows.jsonl", rows)), cwd=tmp_path)
    assert run.returncode == exit_status, run.stderr
    summary = _summary(out)
    status = run_status(out)
    assert (status.state, status.stopped_by) == ("finished", None)
    assert status.finished_complete is (outcome == "complete")
    assert (status.planned, status.succeeded, status.failed, status.pending, status.failed_attempts) == (
        summary["planned"],
        summary["succeeded"],
        summary["failed"],
        summary["pending"],
        summary["failure_attempts"],
    )
    assert (summary["planned"], summary["succeeded"], summary["failed"], summary["pending"]) == counts[:4]
    assert status.resumable == summary["resumable"] == counts[4]
    assert (status.rate_per_s, status.eta_s) == (None, None)
    shown = gym_ray(["status", str(out)], cwd=tmp_path)
    lines = shown.stdout.splitlines()
    assert re.fullmatch(
        rf"state: finished at [0-9: -]+ UTC, {outcome} \(collect pid \d+ on host {re.escape(HOST)}, started "
        r"[0-9: -]+ UTC\)",
        lines[0],
    )
    planned, succeeded, failed, pending, _ = counts
    assert lines[1] == (
        f"run {out}: 1 shard(s), {succeeded} succeeded, {failed} failed, {pending} pending of {planned} "
        "planned rollouts"
    )
    assert not [line for line in lines if line.startswith("rate:") or "ETA" in line]
    shown_json = json.loads(gym_ray(["status", str(out), "--json"], cwd=tmp_path).stdout)
    assert (shown_json["state"], shown_json["finished_complete"]) == ("finished", outcome == "complete")


def test_aggregate_on_a_live_run_is_refused_and_leaves_every_file_as_it_was(
    tmp_path: Path, servers: ThreadedDeployment
) -> None:
    out = tmp_path / "out"
    rows = _hanging_rows(tmp_path / "rows.jsonl")
    # A first run gives up on the hanging row (0.5 s request timeout): it ends with a metrics file.
    first = gym_ray(
        _run_args(tmp_path, servers, rows, "+request_timeout_s=0.5", "+max_infra_retries=0"), cwd=tmp_path
    )
    assert first.returncode == 3, first.stderr
    metrics = (out / "rollouts_aggregate_metrics.json").read_bytes()
    # The resume (the default 900 s timeout) waits on the row again: a live run on the folder.
    sent = servers.stats("calc_env").requests
    run = _start(_run_args(tmp_path, servers, rows), tmp_path)
    try:
        _wait_live(run, servers, out, requests=sent + 1)
        before = _snapshot(out)
        for extra in ([], [str(tmp_path / "gym-ray-run.yaml")]):
            refused = gym_ray(["aggregate", str(out), *extra], cwd=tmp_path)
            assert refused.returncode == 2
            assert refused.stdout == ""
            assert refused.stderr.startswith(
                f"gym-ray aggregate: RunLockError: the run folder {out} is in use by another run "
                f"(collect pid {run.pid} on host {HOST}, started 20"
            )
            assert refused.stderr.endswith(
                "; wait for it to end or stop it, or pick another output_dir (the lock is released when its "
                "process exits)\n"
            )
        assert _snapshot(out) == before
        assert (out / "rollouts_aggregate_metrics.json").read_bytes() == metrics
        assert servers.stats("calc_env").aggregate_calls == 1  # the first run's, none since
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 143
    done = gym_ray(["aggregate", str(out)], cwd=tmp_path)  # stopped: the folder no longer moves
    assert done.returncode == 0, done.stderr
    assert servers.stats("calc_env").aggregate_calls == 2
    status = run_status(out)
    assert (status.state, status.stopped_by, status.aggregate_servers, status.aggregate_errors_path) == (
        "stopped",
        "sigterm",
        1,
        None,
    )
    assert not [name for name in os.listdir(out) if name.startswith(".aggregate")]
