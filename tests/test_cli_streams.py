"""Issue 30, item 5: gym-ray's output is a stream like any Unix tool's.

Real ``gym-ray`` processes write into a pipe whose reader is already gone (``| head`` that has read what it
wanted): every write then fails with ``BrokenPipeError``. ``status`` and ``aggregate`` end quietly with
exit 0 (``aggregate`` still writes its metrics file), and ``run`` keeps its outcome and its exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gym_ray.record.ledger import check_run
from gym_ray.servers import calc_config, calc_rows, start_in_thread
from gym_ray.servers.launch import ThreadedDeployment
from tests.run._cli import cli_env, write_yaml

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def servers() -> Iterator[ThreadedDeployment]:
    with start_in_thread(calc_config(seed=3, latency_ms=0, latency_jitter_ms=0)) as deployment:
        yield deployment


def _reader_gone(args: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``gym-ray ARGS`` with its stdout a pipe nobody reads any more; stderr captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "gym_ray.cli", *args],
            cwd=cwd,
            env=cli_env(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=90,
            check=False,
        )
    finally:
        os.close(write_end)


def _run_args(
    tmp_path: Path, servers: ThreadedDeployment, rows: list[dict[str, Any]], out: Path
) -> list[str]:
    config = write_yaml(tmp_path / "run.yaml", {**servers.config, "max_rollout_attempts": 1})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [
        "run",
        str(config),
        f"+input_jsonl_fpath={data}",
        f"+output_dir={out}",
        "--local",
        "--progress",
        "off",
    ]


def test_a_run_whose_reader_is_gone_completes_with_exit_0_then_status_and_aggregate_end_quietly(
    tmp_path: Path, servers: ThreadedDeployment
) -> None:
    out = tmp_path / "out"
    run = _reader_gone(_run_args(tmp_path, servers, calc_rows(4), out), tmp_path)
    assert (run.returncode, run.stderr) == (0, "")
    report = check_run(out)
    assert (report.planned, report.settled, report.ok) == (4, 4, True)
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 4

    for args in (["status", str(out)], ["status", str(out), "--json"]):
        status = _reader_gone(args, tmp_path)
        assert (status.returncode, status.stderr) == (0, ""), args

    metrics = out / "rollouts_aggregate_metrics.json"
    metrics.unlink()
    aggregate = _reader_gone(["aggregate", str(out)], tmp_path)
    assert (aggregate.returncode, aggregate.stderr) == (0, "")
    assert [entry["_ng_environment_server"] for entry in json.loads(metrics.read_text())] == ["calc_env"]


def test_a_run_with_failed_rows_keeps_exit_3_and_its_one_line_when_the_reader_is_gone(
    tmp_path: Path, servers: ThreadedDeployment
) -> None:
    rows = [{**row, "fault": "500"} if i == 1 else row for i, row in enumerate(calc_rows(4))]
    out = tmp_path / "out"
    run = _reader_gone(_run_args(tmp_path, servers, rows, out), tmp_path)
    assert run.returncode == 3
    assert run.stderr.startswith(
        f"gym-ray run: IncompleteRunError: run folder {out} is incomplete: 1 failed and 0 pending of 4 "
        "planned rollouts"
    ), run.stderr
    assert len(run.stderr.splitlines()) == 1
