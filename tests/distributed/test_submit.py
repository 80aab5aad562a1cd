"""``gym-ray submit``: a run submitted as a Ray job to a local Ray started with its job server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gym_ray import keys
from gym_ray.distributed.submit import build_submission
from gym_ray.errors import ConfigError
from gym_ray.record.ledger import check_run
from gym_ray.servers import bundled_dataset_path, load_bundled_config, start_in_thread

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
import ray
from ray.cluster_utils import Cluster
dashboard, agent = int(sys.argv[1]), int(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dashboard,
    "dashboard_agent_listen_port": agent, "object_store_memory": 100 * 1024 * 1024})
print("ready", flush=True)
sys.stdin.read()
cluster.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def job_server() -> Iterator[str]:
    """A one-node Ray with its dashboard (the Jobs API), in its own process and its own RAY_TMPDIR.

    ``ray.cluster_utils.Cluster`` rather than ``ray.init``: it takes the agent's port, so this head does
    not collide with another Ray's agent on the default port, and it shuts down only its own processes.
    """
    port, agent_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="grjob-", dir="/tmp") as ray_tmp:
        # Loopback only, so the test cluster runs without Ray's token authentication (a real cluster
        # with it needs RAY_AUTH_MODE=token and the token in the submitting shell, as `ray job submit`).
        env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(port), str(agent_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "ready"
            yield f"http://127.0.0.1:{port}"
        finally:
            assert holder.stdin is not None
            assert holder.stdout is not None
            holder.stdin.close()
            holder.wait(timeout=60)
            holder.stdout.close()


def test_the_submission_ships_the_configs_and_the_package(tmp_path: Path) -> None:
    config = tmp_path / "cfg" / "run.yaml"
    config.parent.mkdir()
    config.write_text("head_server: {host: 127.0.0.1, port: 1}\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    submission = build_submission([str(config)], ["+output_dir=/shared/r1"], workers=3, staging=staging)
    assert submission["entrypoint"] == "python -m gym_ray.cli run run.yaml +output_dir=/shared/r1 --workers 3"
    assert submission["runtime_env"]["working_dir"] == str(staging)
    assert submission["runtime_env"]["py_modules"] == [str(REPO / "gym_ray")]
    assert (staging / "run.yaml").read_text() == config.read_text()
    with pytest.raises(ConfigError, match=r"two config files are named 'run\.yaml'"):
        build_submission([str(config), str(config)], [], workers=None, staging=staging)


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_a_submitted_run_succeeds_on_the_cluster(job_server: str, tmp_path: Path) -> None:
    lines = bundled_dataset_path().read_text(encoding="utf-8").splitlines()[:30]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**json.loads(line), "n": i}) + "\n" for i, line in enumerate(lines)))
    with start_in_thread(load_bundled_config()) as servers:
        host, port = servers.head_url.removeprefix("http://").rsplit(":", 1)
        config = tmp_path / "head.yaml"
        config.write_text(yaml.safe_dump({"head_server": {"host": host, "port": int(port)}}))
        out = tmp_path / "run"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gym_ray.cli",
                "submit",
                str(config),
                f"+input_jsonl_fpath={rows}",
                f"+output_dir={out}",
                "+num_repeats=2",
                "--workers",
                "2",
                "--address",
                job_server,
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=380,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    printed = done.stdout.splitlines()
    assert printed[0].startswith("submitted job ")
    job_id = printed[0].split()[2].rstrip(":")
    assert printed[1] == f"follow its logs: ray job logs --follow --address {job_server} {job_id}"
    assert printed[-1] == f"job {job_id}: SUCCEEDED"
    summary = json.loads((out / "rollouts_summary.json").read_text())
    assert (summary["planned"], summary["succeeded"]) == (60, 60)
    assert check_run(out).ok
    first = json.loads((out / "rollouts.jsonl").read_text().splitlines()[0])
    assert (first[keys.TASK_INDEX], first[keys.ROLLOUT_INDEX]) == (0, 0)
