"""docs/observability.md's walk-through runs as written: its two YAML files and its shell block, in a
fresh folder, with the ``file`` exporter. Two changes only: the head server's port is a free one (so that
parallel test runs do not collide) and ``gym-ray run`` joins the session's Ray (``RAY_ADDRESS``) instead
of starting its own."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import gym_ray

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

GUIDE = Path(gym_ray.__file__).parent.parent / "docs" / "observability.md"
ROWS = 200  # the bundled arithmetic dataset


def _section() -> str:
    return GUIDE.read_text(encoding="utf-8")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_readme_observe_walk_through_runs_as_written(ray_session: Any, tmp_path: Path) -> None:
    section = _section()
    port = str(_free_port())
    files = re.findall(r"```yaml\n# (\S+\.yaml)\n(.*?)```", section, flags=re.S)
    assert [name for name, _ in files] == ["observe_servers.yaml", "observe.yaml"]
    for name, body in files:
        (tmp_path / name).write_text(body.replace("11000", port), encoding="utf-8")
    (script,) = re.findall(r"<!-- observe-run: a test runs this block -->\n```bash\n(.*?)```", section, re.S)
    (tmp_path / "gym_ray").symlink_to(Path(gym_ray.__file__).parent)  # gym_ray/configs/demo.yaml, data
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    spans = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text(encoding="utf-8").splitlines()]
    assert Counter(span["name"] for span in spans) == Counter(
        {"gym_ray.job": 1, "gym_ray.rollout": ROWS, "HTTP POST": ROWS, "POST /run": ROWS}
    )
    (job,) = [s for s in spans if s["name"] == "gym_ray.job"]
    rollouts = {s["trace_id"]: s for s in spans if s["name"] == "gym_ray.rollout"}
    assert len(rollouts) == ROWS
    link = [{"trace_id": job["trace_id"], "span_id": job["span_id"]}]
    assert all(s["links"] == link for s in rollouts.values())
    assert {s["attributes"]["gym_ray.run_id"] for s in rollouts.values()} == {
        job["attributes"]["gym_ray.run_id"]
    }
    assert len({s["pid"] for s in rollouts.values()}) == 2  # two Ray workers
    clients = {s["span_id"]: s for s in spans if s["name"] == "HTTP POST"}
    for server in (s for s in spans if s["name"] == "POST /run"):
        client = clients[server["parent_span_id"]]  # the server continued the client's trace
        assert server["trace_id"] == client["trace_id"] in rollouts

    lines = proc.stdout.splitlines()
    (state,) = [line for line in lines if line.startswith("state: ")]
    assert re.fullmatch(r"state: finished .*, complete \(.*\)", state), state
    (head,) = [line for line in lines if line.startswith("run runs/observe: ")]
    assert re.fullmatch(
        rf"run runs/observe: \d+ shard\(s\), {ROWS} succeeded, 0 failed, 0 pending of {ROWS} planned "
        "rollouts",
        head,
    ), head
    assert "resume would run: 0 rollout(s) (0 with earlier failed attempts)" in lines
    assert "merged: rollouts.jsonl" in lines
