"""The exit status of a real `gym-ray run --local` process in each situation of README's table.

`tests/test_cli_exit.py` pins the error class -> status table; these run the command as a user does (a
subprocess, one process without Ray) against the reference servers on 127.0.0.1 and check the status the
shell sees, with the one line on stderr that explains it:

0 every rollout succeeded (or the failed rows are within ``max_failed_fraction``), 1 a server error
(``/aggregate_metrics`` answers 500), 2 bad input (a malformed line: nothing is sent), 3 rows failed and
none is pending, 4 the environment server is down past ``server_outage_timeout_s``.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_ray.servers import calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment
from tests.run._cli import free_port, gym_ray, write_yaml

pytestmark = pytest.mark.timeout(180)


def _summary(succeeded: int, failed: int) -> str:
    """The first line `gym-ray run` prints on stdout once the run ended (0 pending: the run is over)."""
    return rf"run [0-9a-f]{{12}}: {succeeded} succeeded, {failed} failed, 0 pending of 4 planned rollouts \("


@pytest.fixture
def servers() -> Iterator[ThreadedDeployment]:
    """The smallest deployment (``calc_env`` behind ``calc_agent``), answering at once."""
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        yield deployment


def _write_rows(path: Path, rows: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


def _run_args(config: Path, rows: Path, out: Path, *extra: str) -> list[str]:
    return ["run", str(config), f"+input_jsonl_fpath={rows}", f"+output_dir={out}", *extra]


def _local(args: list[str], cwd: Path) -> Any:
    return gym_ray([*args, "--local", "--progress", "off"], cwd=cwd, timeout_s=120)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _failure_lines(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in out.glob("rollouts-*_failures.jsonl"))


def test_exit_0_when_every_rollout_succeeded(tmp_path: Path, servers: ThreadedDeployment) -> None:
    config = write_yaml(tmp_path / "run.yaml", servers.config)
    rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(4))
    out = tmp_path / "out"
    result = _local(_run_args(config, rows, out), tmp_path)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert re.match(_summary(4, 0), result.stdout), result.stdout
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 4
    assert servers.stats("calc_env").requests == 4


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        pytest.param((), 3, id="failed-rows-exit-3"),
        pytest.param(("+max_failed_fraction=0.5",), 0, id="within-max_failed_fraction-exit-0"),
    ],
)
def test_exit_3_when_rows_failed_and_none_is_pending(
    tmp_path: Path, servers: ThreadedDeployment, extra: tuple[str, ...], status: int
) -> None:
    # Rows 1 and 3 make the server answer 500 on every attempt: each is a failed row after this run's
    # attempt, nothing is pending, the run ended. Incomplete: 3 (unless the failures are allowed: 0).
    rows = calc_rows(4)
    rows[1]["fault"] = rows[3]["fault"] = "500"
    config = write_yaml(tmp_path / "run.yaml", servers.config)
    data = _write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    args = _run_args(config, data, out, *extra)
    result = _local(args, tmp_path)
    assert result.returncode == status, result.stdout + result.stderr
    assert re.match(_summary(2, 2), result.stdout), result.stdout
    assert (servers.stats("calc_env").requests, servers.stats("calc_env").faults) == (4, {"status": 2})
    assert _failure_lines(out) == 2
    if status == 0:
        assert result.stderr == ""
        return
    resume = shlex.join(["gym-ray", *args, "--local", "--progress", "off"])
    assert result.stderr == (
        f"gym-ray run: IncompleteRunError: run folder {out} is incomplete: 2 failed and 0 pending of 4 "
        f"planned rollouts (2 succeeded, 2 failed attempts); 2 would run again: run `{resume}` to resume\n"
    )


def test_exit_2_for_a_malformed_line_and_nothing_is_sent(tmp_path: Path, servers: ThreadedDeployment) -> None:
    config = write_yaml(tmp_path / "run.yaml", servers.config)
    rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(3), tail='{"responses_create_params": \n')
    out = tmp_path / "out"
    result = _local(_run_args(config, rows, out), tmp_path)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == (
        f"gym-ray run: error: {rows}, line 4: malformed JSON (Expecting value at column 29): "
        "'{\"responses_create_params\":'\n"
    )
    assert servers.stats("calc_env").requests == 0
    assert not out.exists()


def test_exit_1_when_a_server_fails_the_aggregation(tmp_path: Path) -> None:
    # Every rollout succeeds, then calc_env answers /aggregate_metrics with 500: a server error (1), not an
    # incomplete run (3); the rollouts are on disk and `gym-ray aggregate` can be run again.
    cfg = calc_config(seed=3, latency_ms=0, latency_jitter_ms=0, faults={"aggregate_error_status": 500})
    with start_in_thread(cfg) as failing:
        config = write_yaml(tmp_path / "run.yaml", failing.config)
        rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(4))
        out = tmp_path / "out"
        result = _local(_run_args(config, rows, out), tmp_path)
        stats = failing.stats("calc_env")
        port = _port(failing.url_of("calc_env"))
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert result.stderr == (
        "gym-ray run: AggregationError: /aggregate_metrics failed on 1 environment server(s): calc_env: "
        f"ServerHTTPError: POST http://127.0.0.1:{port}/aggregate_metrics answered HTTP 500 after 1 "
        'attempt(s): \'{"error": "injected fault: /aggregate_metrics HTTP 500"}\'. The metrics of the '
        "other servers are saved; fix the server(s) and run `gym-ray aggregate RUN_DIR CONFIG` again\n"
    )
    assert (stats.requests, stats.aggregate_calls) == (4, 1)
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 4
    assert _failure_lines(out) == 0


def test_exit_4_when_the_environment_server_stays_down_past_the_outage_timeout(
    tmp_path: Path, servers: ThreadedDeployment
) -> None:
    # calc_env's port has nothing listening (no head server to correct it): its rows wait, and after 1 s
    # of outage the run stops, resumable, with nothing recorded for them.
    cfg: dict[str, Any] = copy.deepcopy(servers.config)
    cfg.pop("head_server")
    port = free_port()
    cfg["calc_env"]["environment_servers"]["example_env"]["port"] = port
    config = write_yaml(tmp_path / "run.yaml", cfg)
    rows = _write_rows(tmp_path / "rows.jsonl", calc_rows(4))
    out = tmp_path / "out"
    args = _run_args(config, rows, out, "++server_outage_timeout_s=1", "--no-health-check")
    result = _local(args, tmp_path)
    assert (result.returncode, result.stdout) == (4, ""), result.stderr
    warning, error = result.stderr.splitlines()
    assert warning.startswith(
        f"gym-ray run: warning: environment server 'calc_env' (http://127.0.0.1:{port}) looks down after 3 "
        "failed attempts in a row"
    ), warning
    assert error.startswith(
        f"gym-ray run: ServerOutageError: environment server 'calc_env' (http://127.0.0.1:{port})"
    ), error
    assert "server_outage_timeout_s=1" in error
    assert "rerun on the same output_dir to resume" in error
    assert _failure_lines(out) == 0
    assert not (out / "rollouts.jsonl").exists()
    assert servers.stats("calc_env").requests == 0
