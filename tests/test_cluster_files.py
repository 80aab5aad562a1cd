"""The cluster/ manifests parse, agree with each other, and call ``gym-ray run`` with flags it accepts."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_ray.cli import build_parser
from gym_ray.config.settings import RunSettings, load_config
from gym_ray.config.topology import Topology
from gym_ray.distributed.submit import build_submission

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
LAUNCHER = CLUSTER / "launcher" / "aws.yaml"
SBATCH = CLUSTER / "slurm" / "gym-ray.sbatch"


def _docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def _by_kind(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs(path) if d.get("kind") == kind]
    return doc


def _run_options() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices["run"]._option_string_actions)


def _parse_gym_ray(tokens: list[str]) -> argparse.Namespace:
    # `gym-ray ...` or, as in a Ray job that ships the package, `python -m gym_ray.cli ...`.
    if tokens[:3] == ["python", "-m", "gym_ray.cli"]:
        tokens = ["gym-ray", *tokens[3:]]
    assert tokens[0] == "gym-ray"
    unknown = [t for t in tokens[1:] if t.startswith("--") and t not in _run_options()]
    assert unknown == []
    return build_parser().parse_args(tokens[1:])


@pytest.mark.parametrize(
    ("path", "kinds"),
    [
        pytest.param(RAYJOB, ["PersistentVolumeClaim", "ConfigMap", "RayJob"], id="rayjob"),
        pytest.param(RAYCLUSTER, ["RayCluster"], id="raycluster"),
        pytest.param(LAUNCHER, [None], id="launcher"),
    ],
)
def test_every_yaml_parses(path: Path, kinds: list[str | None]) -> None:
    docs = _docs(path)
    assert [d.get("kind") for d in docs] == kinds


def test_no_yaml_left_unchecked() -> None:
    found = sorted(p.relative_to(CLUSTER).as_posix() for p in CLUSTER.rglob("*.y*ml"))
    assert found == ["kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "launcher/aws.yaml"]


def test_rayjob_entrypoint_uses_only_run_flags() -> None:
    entrypoint = _by_kind(RAYJOB, "RayJob")["spec"]["entrypoint"]
    args = _parse_gym_ray(shlex.split(entrypoint))
    assert (args.command, args.config, args.address, args.workers, args.local) == (
        "run",
        ["/config/run.yaml"],
        None,  # a Ray job's RAY_ADDRESS names the cluster
        8,
        False,
    )
    staging = Path(tempfile.mkdtemp())
    config = staging / "src" / "run.yaml"
    config.parent.mkdir()
    config.write_text("{}\n")
    submitted = build_submission([str(config)], [], workers=8, staging=staging)["entrypoint"]
    assert submitted == entrypoint.replace("/config/run.yaml", "run.yaml")  # what `gym-ray submit` runs


def test_rayjob_config_map_is_a_valid_run_config(tmp_path: Path) -> None:
    config_map = _by_kind(RAYJOB, "ConfigMap")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(config_map["data"]["run.yaml"])
    cfg = load_config([run_yaml])
    settings = RunSettings.from_config(cfg)
    assert (settings.input_jsonl_fpath, settings.output_dir, settings.num_repeats, settings.num_workers) == (
        "/data/tasks/math.jsonl",
        "/data/runs/math-sweep",
        8,
        8,
    )
    assert sorted(Topology.from_config(cfg).instances) == ["math_agent", "math_env"]


@pytest.mark.parametrize(
    ("path", "kind", "groups"),
    [
        pytest.param(RAYJOB, "RayJob", ("rayClusterSpec",), id="rayjob"),
        pytest.param(RAYCLUSTER, "RayCluster", (), id="raycluster"),
    ],
)
def test_every_ray_pod_mounts_the_config_and_the_shared_volume(
    path: Path, kind: str, groups: tuple[str, ...]
) -> None:
    spec = _by_kind(path, kind)["spec"]
    for key in groups:
        spec = spec[key]
    config_map = _by_kind(RAYJOB, "ConfigMap")["metadata"]["name"]
    claim = _by_kind(RAYJOB, "PersistentVolumeClaim")["metadata"]["name"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in spec["workerGroupSpecs"]
    ]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["config"]["configMap"] == {"name": config_map}
        assert volumes["data"]["persistentVolumeClaim"] == {"claimName": claim}
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {"config": "/config", "data": "/data"}


def test_launcher_installs_gym_ray_on_every_node() -> None:
    (launcher,) = _docs(LAUNCHER)
    assert launcher["provider"]["type"] == "aws"
    assert "pip install gym-ray" in launcher["setup_commands"]
    assert sorted(launcher["available_node_types"]) == ["ray.head.default", "ray.worker.default"]
    assert launcher["head_node_type"] == "ray.head.default"


def test_slurm_script_passes_bash_n() -> None:
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stderr) == (0, "")


_FAKE_TOOL = """#!/bin/bash
printf '%s\\n' "$(basename "$0") $*" >> "$FAKE_LOG"
if [[ "$(basename "$0")" == scontrol ]]; then printf 'node1\\nnode2\\nnode3\\n'; fi
if [[ "$(basename "$0")" == srun && "$*" == *hostname* ]]; then echo 10.0.0.1; fi
exit 0
"""


# A real run lasts long enough for the background worker steps to start; the stand-in waits (up to 10 s)
# until both have logged, or the script's exit trap could kill one before it writes its line.
_FAKE_GYM_RAY = """#!/bin/bash
for _ in $(seq 1 200); do
    if (( $(grep -c -- '--address=.* --block' "$FAKE_LOG") >= 2 )); then break; fi
    sleep 0.05
done
printf '%s\\n' "$(basename "$0") $*" >> "$FAKE_LOG"
exit 0
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_script_starts_head_then_workers_then_runs(tmp_path: Path) -> None:
    # Slurm and Ray daemons are not available here: stand-ins on PATH record how the script calls them.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("scontrol", "srun", "ray", "gym-ray"):
        (bin_dir / tool).write_text(_FAKE_GYM_RAY if tool == "gym-ray" else _FAKE_TOOL)
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "calls.log"
    config = tmp_path / "run.yaml"
    config.write_text("output_dir: /tmp/x\n")
    out = tmp_path / "runs" / "sweep"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_CPUS_PER_TASK": "16",
        "GYM_RAY_OUTPUT_DIR": str(out),
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(SBATCH), str(config)], env=env, capture_output=True, text=True, check=False, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert out.is_dir()
    # Background srun steps may log after later foreground calls: compare as a sorted list.
    calls = sorted(log.read_text().splitlines())
    step = "srun --nodes=1 --ntasks=1 --overlap -w"
    assert calls == sorted(
        [
            "scontrol show hostnames node[1-3]",
            f"{step} node1 hostname --ip-address",
            f"{step} node1 ray start --head --node-ip-address=10.0.0.1 --port=6379 --num-cpus=0 --block",
            "ray status --address=10.0.0.1:6379",
            "ray status --address=10.0.0.1:6379",
            f"{step} node2 ray start --address=10.0.0.1:6379 --num-cpus=16 --block",
            f"{step} node3 ray start --address=10.0.0.1:6379 --num-cpus=16 --block",
            f"gym-ray run {config} ++output_dir={out} --address 10.0.0.1:6379 --workers 2",
        ]
    )
    (run_call,) = [c for c in calls if c.startswith("gym-ray ")]
    args = _parse_gym_ray(shlex.split(run_call))
    assert (args.command, args.config, args.address, args.workers) == (
        "run",
        [str(config), f"++output_dir={out}"],
        "10.0.0.1:6379",
        2,
    )
    assert load_config([config], [f"++output_dir={out}"])["output_dir"] == str(out)
