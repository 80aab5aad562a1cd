"""``gym-ray bench chaos`` on its quickest scenarios, small: the command runs real child runs against real
reference servers and prints one table row per scenario, then the figures as JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gym_ray.bench.chaos import run_chaos_bench
from gym_ray.errors import UsageError

pytestmark = pytest.mark.timeout(300)

ZEROS = {"lost": 0, "missing": 0, "duplicates": 0, "corrupt": 0, "failure_records": 0}


def test_bench_chaos_prints_the_figures_of_its_quick_scenarios() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gym_ray.cli",
            "bench",
            "chaos",
            "-n",
            "60",
            "--scenarios",
            "busy-folder,quarantine,secret",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    print(done.stdout[: done.stdout.index("{")])
    assert done.returncode == 0, done.stderr
    table, figures_json = done.stdout[: done.stdout.index("{")], done.stdout[done.stdout.index("{") :]
    lines = table.splitlines()
    assert lines[0].split() == [
        "scenario", "exit", "lost", "missing", "dups", "corrupt", "wasted", "failures", "recover_s", "result"
    ]  # fmt: skip
    assert re.fullmatch(r"busy-folder +0,2 +0 +0 +0 +0 +\d+ +0 +- +pass", lines[1].rstrip())
    assert lines[2] == "  /run executed twice: 0; second run refused"
    assert re.fullmatch(r"quarantine +0,0 +0 +0 +0 +0 +0 +0 +\d+\.\d\d +pass", lines[3].rstrip())
    assert lines[4] == "  quarantined 2 lines, rerun 1 rollout(s)"
    assert re.fullmatch(r"secret +0 +0 +0 +0 +0 +0 +0 +- +pass", lines[5].rstrip())
    assert re.fullmatch(r"  secret hits: 0 in the head's reply, \d+ files, output", lines[6])
    figures = json.loads(figures_json)
    assert figures["passed"] is True
    by_name = {f["scenario"]: f for f in figures["scenarios"]}
    assert list(by_name) == ["busy-folder", "quarantine", "secret"]
    assert {k: by_name["busy-folder"][k] for k in ZEROS} == ZEROS
    assert by_name["busy-folder"]["exit_statuses"] == [0, 2]
    assert {k: by_name["quarantine"][k] for k in ZEROS} == ZEROS
    assert (by_name["quarantine"]["exit_statuses"], by_name["quarantine"]["wasted_requests"]) == ([0, 0], 0)
    assert (by_name["secret"]["exit_statuses"], by_name["secret"]["wasted_requests"]) == ([0], 0)


@pytest.mark.parametrize(
    ("scenarios", "rows", "message"),
    [
        pytest.param(("outage", "typo"), 100, r"unknown scenario\(s\) \['typo'\]", id="unknown"),
        pytest.param(("outage",), 10, r"-n 10 is too small; pass -n 40 or more", id="too-few-rows"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    scenarios: tuple[str, ...], rows: int, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        run_chaos_bench(scenarios, rows=rows)
