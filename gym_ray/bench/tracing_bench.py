"""Benchmark: collector CPU per rollout with tracing off versus on.

Same set-up as :mod:`gym_ray.bench.dispatch`: the instant reference server runs in a separate process
(``serve_bench_server``), so ``time.process_time()`` here measures only the collector. Each mode runs
:func:`gym_ray.dispatch.engine.dispatch` over the same rows with the same client limits:

- ``off``: no tracer (the default; the hot path tests ``tracer is None`` and nothing else);
- ``on``: preset ``default`` inside a job span: a root span per rollout linked to the job span, an HTTP
  client span, ``traceparent`` on every ``/run``; spans go through a ``SimpleSpanProcessor`` to an
  exporter that counts and drops them (export cost of a real backend is not included).

Modes alternate for ``rounds`` rounds after a warm-up; the minimum CPU per rollout of each mode is
reported. Run: ``python -m gym_ray.bench.tracing_bench [n] [concurrency] [rounds]``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gym_ray.bench.dispatch import bench_rows, serve_bench_server
from gym_ray.config.topology import Topology
from gym_ray.dispatch.client import ServerClient
from gym_ray.dispatch.engine import dispatch
from gym_ray.observe.tracing import Tracer, TracingSettings, job_span, setup_tracing

_WARMUP_ROWS = 500


class CountingExporter(SpanExporter):
    """Counts exported spans and drops them (proves spans were made without holding them in memory)."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.count += len(spans)
        return SpanExportResult.SUCCESS


async def _loop(topology: Topology, n: int, concurrency: int, tracer: Tracer | None) -> int:
    done = 0
    async with ServerClient(topology, max_connections=concurrency) as client:
        with job_span(tracer, run_id="tracing-bench"):
            completions = dispatch(
                bench_rows(n), client, topology, max_resident_tasks=concurrency, tracer=tracer
            )
            try:
                async for _row, _outcome in completions:
                    done += 1
            finally:
                await completions.aclose()
    return done


async def _measure(config: dict[str, Any], n: int, concurrency: int, rounds: int) -> dict[str, Any]:
    topology = Topology.from_config(config)
    exporter = CountingExporter()
    tracer = setup_tracing(TracingSettings(enabled=True, exporter="none"), span_exporter=exporter)
    modes: dict[str, Tracer | None] = {"off": None, "on": tracer}
    for mode_tracer in modes.values():
        await _loop(topology, _WARMUP_ROWS, concurrency, mode_tracer)
    best: dict[str, float] = {}
    for _ in range(max(1, rounds)):
        for name, mode_tracer in modes.items():
            exported_before = exporter.count
            cpu0 = time.process_time()
            count = await _loop(topology, n, concurrency, mode_tracer)
            cpu_us = (time.process_time() - cpu0) / n * 1e6
            if count != n:
                raise RuntimeError(f"tracing bench mode {name!r} finished {count} of {n} rollouts")
            if mode_tracer is not None and exporter.count - exported_before < 2 * n:
                raise RuntimeError(
                    f"tracing bench: expected >= {2 * n} spans, got {exporter.count - exported_before}"
                )
            best[name] = min(best.get(name, cpu_us), cpu_us)
    if tracer is not None:
        tracer.provider.shutdown()
    return {
        "n": n,
        "concurrency": concurrency,
        "rounds": rounds,
        "off_cpu_us_per_rollout": best["off"],
        "on_cpu_us_per_rollout": best["on"],
        "overhead_cpu_us_per_rollout": best["on"] - best["off"],
    }


def run_tracing_bench(n: int = 5000, concurrency: int = 256, rounds: int = 3) -> dict[str, Any]:
    """Collector CPU per rollout with tracing off and on against the instant reference server.

    Args:
        n: Rollouts per measured loop.
        concurrency: ``max_resident_tasks`` and the connector limit.
        rounds: Alternating rounds per mode; the minimum is reported.

    Returns:
        ``{"n", "concurrency", "rounds", "off_cpu_us_per_rollout", "on_cpu_us_per_rollout",
        "overhead_cpu_us_per_rollout"}``; also printed.
    """
    with serve_bench_server() as config:
        result = asyncio.run(_measure(config, n, concurrency, rounds))
    print(
        f"tracing bench: n={n} concurrency={concurrency} "
        f"off={result['off_cpu_us_per_rollout']:.0f} us/rollout "
        f"on={result['on_cpu_us_per_rollout']:.0f} us/rollout "
        f"overhead={result['overhead_cpu_us_per_rollout']:.0f} us/rollout"
    )
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    run_tracing_bench(*args)
