"""Issue 30, item 7: ``gym_ray.stream()`` starts its Ray as quietly as ``gym-ray run`` does.

It printed Ray's start-up lines (the SIGTERM handler warning, token authentication, "Started a local Ray
instance"). A fresh process (no Ray yet, so the stream starts and owns one) must print only its own output.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run._cli import cli_env, short_tmp

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

SCRIPT = """
import asyncio
import gym_ray
from gym_ray.servers import calc_config, calc_rows, start_in_thread

async def main():
    with start_in_thread(calc_config(seed=3, latency_ms=0)) as servers:
        async with gym_ray.stream(calc_rows(3), config=servers.config, num_workers=1) as rollouts:
            got = [pair async for pair in rollouts]
    print("rollouts:", len(got))

asyncio.run(main())
"""


def test_a_stream_that_starts_ray_prints_nothing_of_rays(tmp_path: Path) -> None:
    ray_tmp = short_tmp()  # this process's own Ray session, not the test session's
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            cwd=tmp_path,
            env=cli_env(ray_tmp),
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "rollouts: 3\n", "")
