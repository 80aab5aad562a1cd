"""Shared fixtures. One local Ray instance serves the whole session (a Ray start costs seconds)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """A small local Ray (2 CPUs, no dashboard) shared by every test that needs Ray."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(
            address="local",  # never join a cluster another process started on this machine
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture
def slow_servers() -> Iterator[Any]:
    """The demo servers on 127.0.0.1 in a thread; ``arith_env`` answers each /run after 300 ms, so a run
    lasts long enough to stop, kill or watch."""
    from gym_ray.servers import load_bundled_config
    from gym_ray.servers.launch import start_in_thread

    cfg = load_bundled_config("demo")
    env = cfg["arith_env"]["environment_servers"]["example_env"]
    env["latency_ms"], env["latency_jitter_ms"] = 300, 0
    with start_in_thread(cfg) as servers:
        yield servers
