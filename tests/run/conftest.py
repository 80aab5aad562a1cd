"""Fixtures of the single-process run tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gym_ray.servers import Deployment, serve_config


@pytest.fixture
async def deployment() -> AsyncIterator[Deployment]:
    """One calculator agent behind one environment server, answering at once, on 127.0.0.1 (a test module
    may define its own ``deployment``, as ``test_collect.py`` does)."""
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
