"""The process-tree sampler of ``gym-ray bench ray-vs-local``: whose CPU each process's is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gym_ray.bench.ray_vs_local import ROLES, measure_tree, process_role

_RAY = "/usr/lib/python3.11/site-packages/ray"


def test_each_process_of_a_ray_run_gets_its_role() -> None:
    seen = {
        "ray::RolloutWorker": "workers",
        "ray::RolloutWorker.run": "workers",
        "ray::RunCoordinator.finalize": "coordinator",
        "ray::RunCoordinator": "coordinator",
        "ray::RunDriver.next_shard": "driver",
        "ray::RunDriver": "driver",
        "ray::DashboardAgent": "ray",
        "ray::RuntimeEnvAgent": "ray",
        "ray::IDLE": "ray",
        f"{_RAY}/core/src/ray/gcs/gcs_server": "ray",
        f"{_RAY}/core/src/ray/raylet/raylet": "ray",
    }
    for first, role in seen.items():
        assert process_role([first, "--flag"], is_root=False) == role, first
    # before an actor renames its process, and the agents under their script names
    for script in (
        "_private/workers/default_worker.py",
        "dashboard/agent.py",
        "_private/runtime_env/agent/main.py",
    ):
        assert process_role(["/usr/bin/python", "-u", f"{_RAY}/{script}"], is_root=False) == "ray"
    # the merge's sorting pool and planning's byte-range process
    assert (
        process_role(["/usr/bin/python", "-B", "-c", "from multiprocessing..."], is_root=False) == "helpers"
    )
    assert process_role(["/usr/bin/python", "main.py"], is_root=False) == "helpers"
    assert process_role(["/usr/bin/python", "-m", "gym_ray.cli", "run"], is_root=True) == "caller"
    assert process_role([], is_root=False) == "helpers"


def test_the_tree_cpu_is_split_by_role_and_sums_to_the_whole(tmp_path: Path) -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass\n"
    (tmp_path / "burn.py").write_text(burn)
    # the caller starts a child that calls itself a worker actor (as Ray's setproctitle does), and a helper
    caller = (
        "import subprocess, sys\n"
        f"named = 'exec -a ray::RolloutWorker.run {sys.executable} burn.py'\n"
        "worker = subprocess.Popen(['bash', '-c', named])\n"
        f"helper = subprocess.Popen([{sys.executable!r}, 'burn.py'])\n"
        "worker.wait(); helper.wait()\n"
    )
    figures = measure_tree([sys.executable, "-c", caller], env=dict(os.environ), cwd=tmp_path)
    split = figures["cpu_by_role_s"]
    assert tuple(split) == ROLES
    # each burns 0.8 s; the last sample before a process exits may be up to one interval (0.2 s) short
    assert split["workers"] >= 0.5
    assert split["helpers"] >= 0.5
    assert split["driver"] == split["coordinator"] == split["ray"] == 0
    assert split["caller"] > 0
    assert abs(sum(split.values()) - figures["cpu_s"]) < 0.01
