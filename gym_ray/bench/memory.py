"""Benchmark: peak memory of ``run_examples`` does not grow with the number of input rows.

For each size, a *fresh* spawned child process streams a generator of rows (never a list) through
:meth:`RolloutCollectionHelper.run_examples` with bounded admission (``max_resident_tasks``), consumes
every completion, and reports its own peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``)
and its throughput. The instant reference environment server runs in yet another process
(:func:`gym_ray.bench.dispatch.serve_bench_server`), so the child's RSS is the collector's alone.

Bounded admission means the peak should be the same for 100k and 1M rows: the figures reported are the
ratio of the largest to the smallest size's peak (target: within 10 %) and the absolute peak (target:
under 250 MB).

Run: ``python -m gym_ray.bench.memory [size ...]`` or ``gym-ray bench memory --sizes 100000,1000000``.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from gym_ray.bench.child import peak_summary, run_in_child
from gym_ray.bench.dispatch import run_examples_loop, serve_bench_server
from gym_ray.errors import UsageError

#: ru_maxrss is in KiB on Linux.
_KIB_PER_MB = 1024.0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / _KIB_PER_MB


def _child(conn: Connection, config: dict[str, Any], n: int, max_resident_tasks: int) -> None:
    """Body of one measurement process: import, note the baseline peak, run, report."""
    import gym_ray.dispatch.helper  # noqa: F401  # imported before the baseline so it counts as baseline

    baseline_mb = _peak_rss_mb()
    started, cpu_started = time.perf_counter(), time.process_time()
    done = asyncio.run(run_examples_loop(config, n, max_resident_tasks))
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    conn.send(
        {
            "rows": n,
            "completed": done,
            "baseline_rss_mb": baseline_mb,
            "peak_rss_mb": _peak_rss_mb(),
            "wall_s": wall_s,
            "rollouts_per_s": done / wall_s if wall_s > 0 else 0.0,
            "cpu_us_per_rollout": cpu_s / done * 1e6 if done else 0.0,
        }
    )
    conn.close()


def _measure_one(config: dict[str, Any], n: int, max_resident_tasks: int) -> dict[str, Any]:
    result = run_in_child(_child, (config, n, max_resident_tasks), what=f"memory bench child for {n} rows")
    if result["completed"] != n:
        raise RuntimeError(f"memory bench child finished {result['completed']} of {n} rollouts")
    return result


def run_memory_bench(
    sizes: Sequence[int] = (100_000, 1_000_000), max_resident_tasks: int = 256
) -> dict[str, Any]:
    """Measure the collector's peak RSS for several input sizes, each in a fresh process.

    Args:
        sizes: Row counts, each streamed from a generator through ``run_examples`` in its own child.
        max_resident_tasks: Bounded admission (also the connector ``limit``).

    Returns:
        ``{"max_resident_tasks", "runs": [{"rows", "completed", "baseline_rss_mb", "peak_rss_mb", "wall_s",
        "rollouts_per_s", "cpu_us_per_rollout"}, ...], "peak_ratio", "max_peak_rss_mb"}`` where
        ``peak_ratio`` is the largest size's peak over the smallest size's peak; also printed.

    Raises:
        UsageError: ``sizes`` is empty or holds a count < 1.
        RuntimeError: the server did not start, or a child failed or lost rollouts.
    """
    if not sizes or min(sizes) < 1:
        raise UsageError(f"sizes={list(sizes)!r}: give one or more row counts, each >= 1")
    runs: list[dict[str, Any]] = []
    with serve_bench_server() as config:
        for n in sizes:
            run = _measure_one(config, n, max_resident_tasks)
            runs.append(run)
            print(
                f"memory bench: rows={n} peak_rss={run['peak_rss_mb']:.1f} MB "
                f"(baseline {run['baseline_rss_mb']:.1f} MB) {run['rollouts_per_s']:.0f} rollouts/s "
                f"{run['cpu_us_per_rollout']:.0f} us CPU/rollout",
                flush=True,
            )
    return peak_summary("memory bench", runs, max_resident_tasks=max_resident_tasks)


if __name__ == "__main__":
    chosen = [int(a) for a in sys.argv[1:]] or [100_000, 1_000_000]
    run_memory_bench(chosen)
