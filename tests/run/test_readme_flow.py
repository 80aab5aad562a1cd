"""README's "Collect your own data": the commands exactly as written, then what `aggregate` promises.

`gym-ray serve` runs as a subprocess (as in the first terminal); the other commands run one after the
other in a folder where the README's relative paths resolve (``gym_ray`` links to this repo's package).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gym_ray.record.ledger import check_run
from tests.run._cli import REPO, cli_env, dead_config, first_line, gym_ray

pytestmark = pytest.mark.timeout(600)


def _readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Collect your own data", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [
        shlex.split(line) for block in blocks for line in block.splitlines() if line.startswith("gym-ray ")
    ]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_readme_serve_then_run_commands_work_as_written(tmp_path: Path) -> None:
    commands = _readme_commands()
    assert [c[:2] for c in commands] == [
        ["gym-ray", "serve"],
        ["gym-ray", "run"],
        ["gym-ray", "status"],
        ["gym-ray", "aggregate"],
    ]
    (tmp_path / "gym_ray").symlink_to(REPO / "gym_ray")
    serve = subprocess.Popen(
        [sys.executable, "-m", "gym_ray.cli", *commands[0][1:]],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout is not None
        printed = []
        deadline = time.monotonic() + 120
        while not printed or not printed[-1].startswith("  gym-ray run "):
            line = serve.stdout.readline()
            assert line, f"gym-ray serve ended early: {serve.communicate()}"
            printed.append(line.rstrip("\n"))
            assert time.monotonic() < deadline, printed
        head = next(line for line in printed if line.startswith("head server: "))
        assert printed[-2:] == [
            "wrote gym-ray-run.yaml (the head server's address); collect your rows with:",
            "  gym-ray run gym-ray-run.yaml +input_jsonl_fpath=ROWS.jsonl +output_dir=runs/r1",
        ]
        port = int(head.rsplit(":", 1)[1])
        assert (
            (tmp_path / "gym-ray-run.yaml")
            .read_text()
            .endswith(f"head_server:\n  host: 127.0.0.1\n  port: {port}\n")
        )

        results = [gym_ray(command[1:], cwd=tmp_path) for command in commands[1:]]
        for command, result in zip(commands[1:], results, strict=True):
            assert result.returncode == 0, (command, result.stdout, result.stderr)
        # stderr is not a TTY here: the run prints plain progress lines (the first once the total is known,
        # the last at the end; a run done before the first poll prints one, never the same line twice),
        # nothing else; status and aggregate print nothing there.
        progress = results[0].stderr.splitlines()
        assert progress, results[0].stderr
        assert all(line != after for line, after in itertools.pairwise(progress)), progress
        assert all(re.fullmatch(r"\d+/200 \(\d+\.\d%\) .*/s failed 0 ETA .*", line) for line in progress)
        assert progress[-1].startswith("200/200 (100.0%) ")
        assert (results[1].stderr, results[2].stderr) == ("", "")
        out = tmp_path / "runs" / "mine"
        assert " 200 planned rollouts " in results[0].stdout
        assert check_run(out).ok
        assert results[2].stdout.endswith(
            f"\nwrote {Path('runs/mine') / 'rollouts_aggregate_metrics.json'}\n"
        )

        # `aggregate` takes the head-only config the run took, given explicitly too.
        explicit = gym_ray(["aggregate", "runs/mine", "gym-ray-run.yaml"], cwd=tmp_path)
        assert (explicit.returncode, explicit.stderr) == (0, "")
        metrics = out / "rollouts_aggregate_metrics.json"
        before = _digest(metrics)

        # A config naming other servers than the run recorded is refused unless told (--use-new-config);
        # told, a failed aggregate never makes the folder worse: the good metrics file stays byte for byte.
        dead = dead_config(tmp_path / "dead.yaml")
        refused = gym_ray(["aggregate", "runs/mine", str(dead)], cwd=tmp_path)
        assert refused.returncode == 2
        assert first_line(refused.stderr).startswith(
            "gym-ray aggregate: error: the config given resolves to other servers than the run in runs/mine "
            "recorded (gym_ray_run.json): head server http://127.0.0.1:"
        )
        failed = gym_ray(["aggregate", "runs/mine", str(dead), "--use-new-config"], cwd=tmp_path)
        errors = Path("runs/mine") / "rollouts_aggregate_metrics.errors.json"
        assert (failed.returncode, failed.stderr.splitlines()) == (
            1,
            [
                "gym-ray aggregate: AggregationError: /aggregate_metrics failed for arith_env; the "
                f"previous rollouts_aggregate_metrics.json is unchanged; the failed entries are in {errors}. "
                "Start the servers the config given names and rerun `gym-ray aggregate runs/mine`, or pass "
                "the config of the running ones with --use-new-config"
            ],
        )
        assert _digest(metrics) == before
        assert "aggregation_error" in (tmp_path / errors).read_text()
    finally:
        serve.terminate()
        serve.communicate(timeout=60)

    # With the servers gone, aggregate still talks to the servers the run recorded (no config file is read
    # again): they refuse the connection, one line, file intact.
    gone = gym_ray(["aggregate", "runs/mine"], cwd=tmp_path)
    assert gone.returncode == 1
    assert first_line(gone.stderr).startswith(
        "gym-ray aggregate: AggregationError: /aggregate_metrics failed for arith_env; the previous "
        "rollouts_aggregate_metrics.json is unchanged;"
    )
    assert len(gone.stderr.splitlines()) == 1
    assert _digest(metrics) == before
