"""Running ``gym-ray`` as a user does: a subprocess, with this worktree's code, and its own Ray temp dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def cli_env(ray_tmp: Path | None = None) -> dict[str, str]:
    """The environment of a ``gym-ray`` subprocess: this repo first on the path, no inherited Ray address.

    ``ray_tmp`` becomes ``RAY_TMPDIR``: a Ray started by the subprocess puts its session folder under it
    (and only there), so a test can tell whether *this* process started Ray while other Ray instances run
    on the machine.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    if ray_tmp is not None:
        env["RAY_TMPDIR"] = str(ray_tmp)
    return env


def short_tmp() -> Path:
    """A fresh folder with a short path (Ray's unix socket paths must stay under 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="gr14-", dir="/tmp"))


def ray_sessions(ray_tmp: Path) -> list[str]:
    """Ray session folders under ``ray_tmp`` (empty: no Ray was started with it as RAY_TMPDIR)."""
    root = ray_tmp / "ray"
    return sorted(p.name for p in root.glob("session_*")) if root.exists() else []


def ray_log_stems(ray_tmp: Path) -> set[str]:
    """The log file stems of every Ray session under ``ray_tmp`` (``gcs_server``, ``raylet``, ...)."""
    return {p.name.split(".")[0] for p in (ray_tmp / "ray").glob("session_*/logs/*.*")}


def gym_ray(
    args: Sequence[str], *, cwd: Path, ray_tmp: Path | None = None, timeout_s: float = 240.0
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gym_ray.cli ARGS`` to completion; stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "gym_ray.cli", *args],
        cwd=cwd,
        env=cli_env(ray_tmp),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def first_line(text: str) -> str:
    """The first line of a captured stream ("" when empty)."""
    return text.splitlines()[0] if text else ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_yaml(path: Path, cfg: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(cfg), sort_keys=False))
    return path


def write_rows(path: Path, count: int) -> Path:
    """``count`` distinct arithmetic rows for the bundled ``arith_agent`` (routed to ``arith_env``)."""
    lines = []
    for i in range(count):
        row = {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "expected_answer": str(i + 1),
            "agent_ref": {"name": "arith_agent"},
        }
        lines.append(json.dumps(row))
    path.write_text("".join(line + "\n" for line in lines))
    return path


def dead_config(path: Path) -> Path:
    """The demo topology with every server on a port nothing listens on (no head server)."""
    from gym_ray.servers import load_bundled_config

    cfg = load_bundled_config("demo")
    cfg.pop("head_server")
    port = free_port()
    for block in cfg.values():
        for impls in block.values():
            for fields in impls.values():
                fields["port"] = port
    return write_yaml(path, cfg)
