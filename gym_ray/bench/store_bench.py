"""``gym-ray bench store``: the same run with its folder on a local disk and on S3, side by side.

A moto S3 server (``moto[server]``, a real HTTP S3 API) runs on 127.0.0.1 in a child process, its access
log in a file; the instant reference server runs in another. ``gym-ray run --workers N`` then runs twice as
a child process on the same input: into a local folder, and into ``s3://bench/run``. Figures:

- ``wall_s`` of each child (Ray's start included) and ``rollouts_per_s`` from its run summary (the
  dispatch rate, without the start);
- ``store_requests``: requests the store answered during the S3 run (the lines of moto's access log, so
  every request of every process: caller, driver, workers, coordinator), by HTTP method, and per 1,000
  rollouts;
- the S3 run's wall time over the local one.

moto keeps objects in memory and answers on loopback: a real store adds its latency to each request, which
the requests-per-rollout figure lets you price. Figures are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from gym_ray.bench.collect_memory import write_input
from gym_ray.bench.dispatch import serve_bench_server
from gym_ray.errors import UsageError

__all__ = ["run_store_bench", "start_moto"]

_BUCKET = "bench"


def start_moto(port: int, log: Path | None = None) -> subprocess.Popen[bytes]:
    """moto's S3 server on 127.0.0.1:``port`` in a child process (its access log to ``log``), answering
    once this returns.

    Raises:
        UsageError: moto is not installed.
        RuntimeError: It did not answer within 60 s.
    """
    try:
        import moto  # noqa: F401
    except ImportError as exc:
        raise UsageError("the store bench needs moto's S3 server: pip install 'moto[server]' boto3") from exc
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if log is None else log.open("wb"),
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.05)


def _requests(log: Path) -> Counter[str]:
    """Requests in moto's access log by method (werkzeug's ``"GET /path HTTP/1.1" 200 -`` lines)."""
    methods: Counter[str] = Counter()
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if ' HTTP/1.1" ' in line and '"' in line:
            methods[line.split('"', 2)[1].split(" ", 1)[0]] += 1
    return methods


def _run(command: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[3:5])} ... exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def run_store_bench(n: int = 20000, workers: int = 2) -> dict[str, Any]:
    """Run ``n`` rollouts into a local folder and into S3 (moto); figures as in the module docstring."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="gym-ray-bench-") as tmp, serve_bench_server() as config:
        folder = Path(tmp)
        log = folder / "moto.log"
        moto = start_moto(port, log)
        try:
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            env.update(
                AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                AWS_ACCESS_KEY_ID="bench",
                AWS_SECRET_ACCESS_KEY="bench",
                AWS_DEFAULT_REGION="us-east-1",
                GYM_RAY_STAGE_DIR=str(folder / "stage"),
            )
            import boto3

            client = boto3.client(
                "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                aws_secret_access_key="bench", region_name="us-east-1",
            )  # fmt: skip
            client.create_bucket(Bucket=_BUCKET)
            config_path = folder / "bench.yaml"
            config_path.write_text(yaml.safe_dump(config))
            rows = folder / "rows.jsonl"
            write_input(rows, n)
            figures: dict[str, Any] = {}
            for mode, out in (("local", str(folder / "local")), ("s3", f"s3://{_BUCKET}/run")):
                before = _requests(log)
                command = [
                    sys.executable, "-m", "gym_ray.cli", "run", str(config_path),
                    f"+input_jsonl_fpath={rows}", f"+output_dir={out}", "++max_resident_tasks=256",
                    "--workers", str(workers), "--progress", "off",
                ]  # fmt: skip
                wall = _run(command, env, folder)
                if mode == "local":
                    summary = json.loads((folder / "local" / "rollouts_summary.json").read_text())
                else:
                    body = client.get_object(Bucket=_BUCKET, Key="run/rollouts_summary.json")["Body"].read()
                    summary = json.loads(body)
                after = _requests(log)
                made = after - before
                figures[mode] = {
                    "wall_s": round(wall, 2),
                    "rollouts_per_s": round(float(summary["distributed"]["rollouts_per_s"]), 1),
                    "store_requests": sum(made.values()),
                    "store_requests_by_method": dict(sorted(made.items())),
                    "store_requests_per_1000_rollouts": round(1000 * sum(made.values()) / n, 2),
                }
            keep = os.environ.get("GYM_RAY_BENCH_STORE_LOG")
            if keep:  # every request of both runs, for a closer look
                Path(keep).write_bytes(log.read_bytes())
        finally:
            moto.terminate()
            moto.wait(timeout=30)
    return {
        "rollouts": n,
        "workers": workers,
        **figures,
        "wall_s3_over_local": round(figures["s3"]["wall_s"] / figures["local"]["wall_s"], 3),
    }
