"""OpenTelemetry metrics of server health (``gym_ray.server.*``) for a run with one real outage: the
environment server is stopped mid-run and restarted once the metrics show it down."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from gym_ray.config.tracing import TracingSettings
from gym_ray.observe.health_metrics import HEALTH_METRICS
from gym_ray.observe.tracing import Tracer, setup_tracing, shutdown_tracing
from gym_ray.run.collect import acollect_local
from gym_ray.servers import calc_config, calc_rows, serve_config

pytestmark = pytest.mark.timeout(120)


_rows = calc_rows


def _points(tracer: Tracer) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    assert tracer.metrics is not None
    collected = tracer.metrics.collect()
    return {name: collected.get(name, []) for name in HEALTH_METRICS}


async def test_one_outage_gives_one_outage_three_infra_failures_and_up_again(tmp_path: Path) -> None:
    tracing = {
        "enabled": True,
        "exporter": "memory",
        "metrics_enabled": True,
        "service_name": f"health-metrics-{tmp_path.name}",  # a tracer of its own (cached per settings)
    }
    async with serve_config(calc_config(seed=3, latency_ms=5, latency_jitter_ms=0)) as dep:
        config = {**dep.config, "tracing": tracing}
        tracer = setup_tracing(TracingSettings.from_config(config))  # the run's own (same settings)
        assert tracer is not None
        try:
            run = asyncio.create_task(
                acollect_local(
                    config,
                    rows=_rows(120),
                    output_dir=str(tmp_path / "run"),
                    shard_size=200,  # one shard: one lane, one row task
                    max_resident_tasks=1,  # one request at a time: the failures before "down" are exact
                    server_outage_timeout_s=60.0,
                )
            )
            try:
                deadline = time.monotonic() + 60
                while dep.stats("calc_env").requests < 30:
                    assert time.monotonic() < deadline, "timed out waiting for 30 requests"
                    await asyncio.sleep(0.02)
                await dep.stop_server("calc_env")
                while _points(tracer)["gym_ray.server.up"] != [({"server": "calc_env"}, 0)]:
                    assert time.monotonic() < deadline, "timed out waiting for gym_ray.server.up = 0"
                    await asyncio.sleep(0.02)
                seen_down = time.monotonic()
                during = _points(tracer)
                await dep.restart_server("calc_env")
                restarted = time.monotonic()
                result = await run
            finally:
                run.cancel()
            after = _points(tracer)
        finally:
            shutdown_tracing(tracer)
    print(f"[health metrics] during={during} after={after}")
    attrs = {"server": "calc_env"}
    assert during["gym_ray.server.outages"] == [(attrs, 1)]
    assert during["gym_ray.server.infra_failures"] == [(attrs, 3)]  # down_after = 3 failures in a row
    assert during["gym_ray.server.down_s"] == []  # added when the outage ends
    assert after["gym_ray.server.up"] == [(attrs, 1)]
    assert after["gym_ray.server.outages"] == [(attrs, 1)]
    assert after["gym_ray.server.infra_failures"] == [(attrs, 3)]
    [(down_attrs, down_s)] = after["gym_ray.server.down_s"]
    assert down_attrs == attrs
    assert down_s >= restarted - seen_down  # it was down at least from our sight of it to the restart
    assert (result.succeeded, result.failed) == (120, 0)
