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
