"""`gym-ray run` on Ray, as a subprocess: exit statuses and the one line on stderr for each way a run ends.

Real parts: the reference servers on 127.0.0.1 (in this process's thread, or `gym-ray serve` as a
subprocess), a local Ray started by the CLI, run folders in tmp_path. Waits are on files and processes
with generous deadlines, never on fixed sleeps.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from gym_ray.record.ledger import check_run
from gym_ray.servers.launch import ThreadedDeployment
from tests.run._cli import (
    cli_env,
    dead_config,
    first_line,
    gym_ray,
    ray_log_stems,
    ray_sessions,
    short_tmp,
    write_rows,
    write_yaml,
)

pytestmark = pytest.mark.timeout(1200)  # Ray starts take minutes on a loaded 2-core machine


def _wait_for(
    condition: Callable[[], bool], what: str, proc: subprocess.Popen[str], timeout_s: float = 180.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"gym-ray exited ({proc.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.1)


def _lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def _successes(out: Path) -> int:
    """Success lines in every shard file of run folder ``out``: a worker runs two shard lanes at once, so
    the first rollouts may land in more than one shard."""
    return sum(_lines(path) for path in out.glob("rollouts-[0-9]*[0-9].jsonl"))


def _slow_run_args(tmp_path: Path, servers: ThreadedDeployment, out: Path, rows: int = 60) -> list[str]:
    config = write_yaml(tmp_path / "live.yaml", {**servers.config, "max_resident_tasks": 2, "shard_size": 10})
    data = write_rows(tmp_path / "rows.jsonl", rows)
    return [
        "run",
        str(config),
        f"+input_jsonl_fpath={data}",
        f"+output_dir={out}",
        "--workers",
        "1",
        "--progress",
        "off",
    ]


def test_a_dead_server_stops_the_run_with_exit_4_naming_it_and_records_no_failure(tmp_path: Path) -> None:
    # A server that never answers is an outage, not data: its rows are held back, then the run stops
    # resumable after server_outage_timeout_s (exit 4), with nothing recorded as a failure (issue 15).
    ray_tmp = short_tmp()
    try:
        config = dead_config(tmp_path / "dead.yaml")
        rows = write_rows(tmp_path / "rows.jsonl", 3)
        out = tmp_path / "out"
        args = [
            "run",
            str(config),
            f"+input_jsonl_fpath={rows}",
            f"+output_dir={out}",
            "++server_outage_timeout_s=3",
            "--workers",
            "1",
            "--no-health-check",
            "--progress",
            "off",
        ]
        result = gym_ray(args, cwd=tmp_path, ray_tmp=ray_tmp)
        assert ray_sessions(ray_tmp) != []  # this run did start Ray (the control of the preflight tests)
        # ... a lean one: no autoscaler monitor, no log monitor and no API server (`dashboard`; each
        # writes its log when it starts), while the raylet's own dashboard agent runs.
        stems = ray_log_stems(ray_tmp)
        assert {"gcs_server", "raylet", "dashboard_agent"} <= stems, stems
        assert {"monitor", "log_monitor", "dashboard"} & stems == set(), stems
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 4, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gym-ray run: ServerOutageError: environment server 'arith_env"), lines[0]
    assert "server_outage_timeout_s=3" in lines[0]
    assert "rerun on the same output_dir to resume" in lines[0]
    assert sorted(p.name for p in out.glob("rollouts-*_failures.jsonl") if p.stat().st_size) == []


def test_warnings_of_a_local_run_are_one_prefixed_line_each(tmp_path: Path) -> None:
    # Without a handler Python prints gym_ray's warnings bare; the CLI prefixes each and keeps it to one
    # line (the error it wraps is named, never a traceback).
    config = dead_config(tmp_path / "dead.yaml")
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    args = [
        "run",
        str(config),
        f"+input_jsonl_fpath={rows}",
        f"+output_dir={tmp_path / 'out'}",
        "++server_outage_timeout_s=2",
        "--local",
        "--no-health-check",
        "--progress",
        "off",
    ]
    result = gym_ray(args, cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    warning, error = result.stderr.splitlines()
    assert re.fullmatch(
        r"gym-ray run: warning: environment server 'arith_env' \(http://127\.0\.0\.1:\d+\) looks down after "
        r"3 failed attempts in a row \(could not connect .*\); its rows wait while a probe checks "
        r"http://127\.0\.0\.1:\d+/ \(the run stops after 2 s of outage\)",
        warning,
    ), warning
    assert error.startswith("gym-ray run: ServerOutageError: environment server 'arith_env'"), error
    assert "Traceback" not in result.stderr


def test_a_local_run_prints_progress_lines_at_the_asked_interval(
    tmp_path: Path, slow_servers: ThreadedDeployment
) -> None:
    # `--progress 60` in a local run (stderr not a TTY): a plain line at the first outcome, then none for
    # 60 s, then the last one at 100% (this run lasts ~1.2 s). Local runs used to show nothing for any
    # interval above 1 s, `auto` off a TTY (30 s) included.
    out = tmp_path / "out"
    args = _slow_run_args(tmp_path, slow_servers, out, rows=8)
    args[args.index("--workers") : args.index("--workers") + 2] = ["--local"]
    args[args.index("--progress") + 1] = "60"
    result = gym_ray(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    progress = r"{}/8 \({}%\) (--|\d+\.\d)/s failed 0 ETA \S+ \| arith_env \d\.\d\d"
    assert len(lines) == 2, lines
    assert re.fullmatch(progress.format(1, "12\\.5"), lines[0]), lines
    assert re.fullmatch(progress.format(8, "100\\.0"), lines[1]), lines


def test_sigterm_stops_like_ctrl_c_exit_143_and_the_rerun_completes(
    tmp_path: Path, slow_servers: ThreadedDeployment
) -> None:
    out = tmp_path / "out"
    args = _slow_run_args(tmp_path, slow_servers, out)
    proc = _start(args, tmp_path)
    try:
        _wait_for(lambda: _successes(out) >= 2, "the first recorded rollouts", proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, stderr.splitlines()) == (
        143,
        [
            f"gym-ray run: stopped by SIGTERM; the run folder {out} is resumable: rerun the same command to "
            "run only what is missing"
        ],
    )
    assert "Traceback" not in stdout + stderr
    recorded = _successes(out)
    rerun = gym_ray(args, cwd=tmp_path, timeout_s=600)
    assert (rerun.returncode, rerun.stderr) == (0, "")
    assert (
        f"60 succeeded, 0 failed, 0 pending of 60 planned rollouts (0 failed attempts; {recorded}"
        in rerun.stdout
    )
    report = check_run(out)
    assert (report.ok, report.planned, report.settled) == (True, 60, 60)


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """A ``gym-ray`` process with ``args``, its output piped (the test kills parts of it and waits)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gym_ray.cli", *args],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _actor_pids(proc: subprocess.Popen[str], actor: str) -> list[int]:
    return [p.pid for p in _descendants(proc.pid) if f"ray::{actor}" in _cmdline(p)]


def test_the_driver_then_the_coordinator_killed_mid_run_come_back_and_the_run_ends_in_the_same_call(
    tmp_path: Path, slow_servers: ThreadedDeployment
) -> None:
    # Issue 33 item 3: Ray restarts each control actor, which takes up its journal; the workers' calls the
    # dead process left unanswered are sent again. Nothing is lost and no /run is sent twice.
    out = tmp_path / "out"
    args = _slow_run_args(tmp_path, slow_servers, out)
    proc = _start(args, tmp_path)
    try:
        done = 2
        for actor in ("RunDriver", "RunCoordinator"):
            _wait_for(lambda n=done: _successes(out) >= n, f"{done} recorded rollouts", proc)
            (victim,) = _actor_pids(proc, actor)
            psutil.Process(victim).kill()

            def back(name: str = actor, dead: int = victim) -> bool:
                return bool(_actor_pids(proc, name)) and dead not in _actor_pids(proc, name)

            _wait_for(back, f"a new {actor} process", proc)  # Ray restarted it; the run goes on
            done = _successes(out) + 4
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, stderr) == (0, ""), stderr
    assert "60 succeeded, 0 failed, 0 pending of 60 planned rollouts" in stdout
    requests = {}
    for name, block in slow_servers.config.items():
        if isinstance(block, dict) and "environment_servers" in block:
            requests.update(slow_servers.stats(name).request_counts)
    assert sorted(requests.values()) == [1] * 60  # every row's /run sent once, none twice
    report = check_run(out, request_counts=requests)
    assert (report.ok, report.planned, report.settled, report.duplicates, report.wasted_requests) == (
        True,
        60,
        60,
        0,
        0,
    )
    assert not (out / ".control").exists()


@pytest.mark.parametrize(
    ("role", "actor", "restarts"),
    [("driver", "RunDriver", 0), ("coordinator", "RunCoordinator", 0), ("driver", "RunDriver", 1)],
)
def test_a_killed_control_actor_with_no_restart_left_is_named_and_the_folder_stays_resumable(
    tmp_path: Path, slow_servers: ThreadedDeployment, role: str, actor: str, restarts: int
) -> None:
    out = tmp_path / "out"
    args = [*_slow_run_args(tmp_path, slow_servers, out), f"+control_actor_restarts={restarts}"]
    proc = _start(args, tmp_path)
    try:
        _wait_for(lambda: _successes(out) >= 2, "the first recorded rollouts", proc)
        tree = [_cmdline(p) for p in _descendants(proc.pid)]
        # A driver, a coordinator and one worker: the run's actor processes, by class (Ray's own aside).
        classes = Counter(c.split()[0].split(".")[0] for c in tree if c.startswith(_RUN_ACTORS))
        assert classes == {"ray::RunDriver": 1, "ray::RunCoordinator": 1, "ray::RolloutWorker": 1}, tree
        for kill in range(restarts + 1):  # each restart's process killed in turn
            (victim,) = _actor_pids(proc, actor)
            psutil.Process(victim).kill()
            if kill < restarts:

                def back(dead: int = victim) -> bool:
                    return bool(_actor_pids(proc, actor)) and dead not in _actor_pids(proc, actor)

                _wait_for(back, f"a new {actor} process", proc)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr
    assert len(stderr.splitlines()) == 1, stderr
    spent = f" and its {restarts} restart\\(s\\) are spent" if restarts else ""
    pattern = (
        rf"gym-ray run: ActorLostError: the run's {role} actor \({actor}\) died \(.+\){spent}; "
        rf"the run cannot go on without it; the run folder {re.escape(str(out))} is resumable: rerun the "
        "same command to run only what is missing"
    )
    assert re.fullmatch(pattern, first_line(stderr)), stderr
    assert "every worker died" not in stderr
    rerun = gym_ray(args, cwd=tmp_path, timeout_s=600)
    assert (rerun.returncode, rerun.stderr) == (0, "")
    report = check_run(out)
    assert (report.ok, report.planned, report.settled) == (True, 60, 60)


#: Process titles of gym_ray's actor classes, past and present (one RunHost held both control roles once).
_RUN_ACTORS = ("ray::RunHost", "ray::RolloutWorker", "ray::RunDriver", "ray::RunCoordinator")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""
