"""A local run with tracing off does not import OpenTelemetry (start-up CPU of ``gym-ray run --local``).

Checked in a fresh interpreter that runs a whole ``acollect_local`` against a reference server of this
process: ``opentelemetry`` (and ``psutil``, which its SDK's resource detection imported) stays unloaded. A
run with tracing on imports it where it starts its tracer (tests/observe/test_tracing.py traces an
``acollect_local`` run).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gym_ray.servers import Deployment, serve_config

CHILD = """
import asyncio, json, sys
from gym_ray.run.collect import acollect_local
config, out = json.loads(sys.argv[1]), sys.argv[2]
rows = [{"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
         "expected_answer": str(i + 1), "agent_ref": {"name": "calc_agent"}} for i in range(3)]
result = asyncio.run(acollect_local(config, rows=rows, output_dir=out))
print(json.dumps({"succeeded": result.succeeded, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    cfg = {
        "calc_agent": {"responses_api_agents": {"example_env": {"host": "127.0.0.1", "port": 0}}},
        "calc_env": {
            "environment_servers": {
                "example_env": {
                    "host": "127.0.0.1",
                    "port": 0,
                    "latency_ms": 0,
                    "agent_server": {"type": "responses_api_agents", "name": "calc_agent"},
                }
            }
        },
    }
    async with serve_config(cfg) as served:
        yield served


async def test_a_local_run_with_tracing_off_leaves_opentelemetry_unloaded(
    tmp_path: Path, deployment: Deployment
) -> None:
    command = [sys.executable, "-c", CHILD, json.dumps(deployment.config), str(tmp_path / "out")]
    child = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout)
    assert report["succeeded"] == 3
    assert "gym_ray" in report["modules"]
    assert "opentelemetry" not in report["modules"]
    assert "psutil" not in report["modules"]
