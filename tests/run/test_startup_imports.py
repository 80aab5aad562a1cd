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
from pathlib import Path

from gym_ray.servers import Deployment

CHILD = """
import asyncio, json, sys
from gym_ray.run.collect import acollect_local
config, out = json.loads(sys.argv[1]), sys.argv[2]
rows = [{"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
         "expected_answer": str(i + 1), "agent_ref": {"name": "calc_agent"}} for i in range(3)]
result = asyncio.run(acollect_local(config, rows=rows, output_dir=out))
print(json.dumps({"succeeded": result.succeeded, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


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
