"""``gym-ray bench SCENARIO``: run one benchmark scenario and print its figures as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gym_ray.errors import UsageError

SCENARIOS = (
    "dispatch",
    "record",
    "ray",
    "tracing",
    "memory",
    "latency",
    "merge",
    "tail",
    "collect-memory",
    "plan-memory",
    "ray-vs-local",
    "chaos",
    "pipeline",
    "store",
)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: give comma-separated row counts >= 1, e.g. 100000,1000000"
        )
    return sizes


def _count(text: str) -> int:
    """An argument that counts something: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value


def bench_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gym-ray bench``."""
    parser.add_argument("scenario", choices=SCENARIOS, help="which benchmark to run")
    parser.add_argument(
        "-n",
        type=_count,
        default=None,
        help="rollouts (dispatch, record, tracing, latency, store: 20000; merge, tail: 1000000)",
    )
    parser.add_argument(
        "--rows", type=_count, default=20000, help="pipeline: generated input rows (default 20000)"
    )
    parser.add_argument("--shards", type=_count, default=64, help="merge, tail (>= 2): shard files merged")
    parser.add_argument("--concurrency", type=_count, default=256, help="requests in flight")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=(100_000, 1_000_000),
        help="memory: comma-separated row counts, one fresh process each (default 100000,1000000); "
        "ray-vs-local: two sizes (default 2000,20000)",
    )
    parser.add_argument(
        "--latency-ms", type=float, default=500.0, help="latency: the server's delay per /run"
    )
    parser.add_argument(
        "--workers", type=_count, default=2, help="ray-vs-local, store: worker actors (default 2)"
    )
    parser.add_argument(
        "--scenarios",
        default=None,
        help="chaos: comma-separated scenarios (default all: outage, outage-timeout, busy-folder, secret, "
        "quarantine, kill-resume)",
    )
    parser.add_argument(
        "--outage-s",
        type=float,
        default=20.0,
        help="chaos: seconds the outage scenario keeps the server down",
    )


def bench_main(args: argparse.Namespace) -> int:
    """Run the chosen scenario; prints its figures as JSON. Returns 0 (``chaos``: 1 when a scenario
    failed).

    First measures what memory never used before costs on this machine (:mod:`gym_ray.bench.machine`): it
    goes into the figures as ``"machine"`` and, when high, a warning goes to stderr.
    """
    from gym_ray.bench.machine import fresh_memory_note, machine_figures

    if args.scenario == "tail" and args.shards < 2:
        raise UsageError(
            f"--shards {args.shards}: the tail bench needs 2 or more (all but the last go ahead)"
        )
    machine = machine_figures()
    cost = machine["fresh_memory_us_per_page"]
    note = None if cost is None else fresh_memory_note(cost)
    if note is not None:
        print(note, file=sys.stderr)
    result: dict[str, Any]
    if args.scenario == "chaos":
        from gym_ray.bench.chaos import CHAOS_SCENARIOS, run_chaos_bench

        names = CHAOS_SCENARIOS if args.scenarios is None else tuple(args.scenarios.split(","))
        result = run_chaos_bench(names, rows=2000 if args.n is None else args.n, outage_s=args.outage_s)
        print(json.dumps({**result, "machine": machine}, indent=2))
        return 0 if result["passed"] else 1
    if args.n is None and args.scenario not in ("merge", "tail"):
        args.n = 20000
    if args.scenario == "dispatch":
        from gym_ray.bench.dispatch import run_dispatch_bench

        result = run_dispatch_bench(args.n, args.concurrency)
    elif args.scenario == "record":
        from gym_ray.bench.record import run_record_bench

        result = run_record_bench(args.n, args.concurrency)
    elif args.scenario == "ray":
        from gym_ray.bench.ray_bench import main as ray_main

        return ray_main([])
    elif args.scenario == "memory":
        from gym_ray.bench.memory import run_memory_bench

        result = run_memory_bench(args.sizes, args.concurrency)
    elif args.scenario in ("collect-memory", "plan-memory"):
        from gym_ray.bench.collect_memory import run_collect_memory_bench

        stage = "plan" if args.scenario == "plan-memory" else "collect"
        result = run_collect_memory_bench(args.sizes, args.concurrency, stage=stage)
    elif args.scenario == "ray-vs-local":
        from gym_ray.bench.ray_vs_local import run_ray_vs_local_bench

        sizes = args.sizes if args.sizes != (100_000, 1_000_000) else (2000, 20000)
        result = run_ray_vs_local_bench(sizes, workers=args.workers)
    elif args.scenario == "pipeline":
        from gym_ray.bench.pipeline import run_pipeline_bench

        result = run_pipeline_bench(args.rows, args.concurrency)
    elif args.scenario == "merge":
        from gym_ray.bench.merge_bench import run_merge_bench

        result = run_merge_bench(args.n if args.n is not None else 1_000_000, args.shards)
    elif args.scenario == "tail":
        from gym_ray.bench.tail_bench import run_tail_bench

        result = run_tail_bench(args.n if args.n is not None else 1_000_000, args.shards)
    elif args.scenario == "store":
        from gym_ray.bench.store_bench import run_store_bench

        result = run_store_bench(args.n, workers=args.workers)
    elif args.scenario == "latency":
        from gym_ray.bench.latency import run_latency_bench

        result = run_latency_bench(args.latency_ms, args.concurrency, args.n)
    else:
        from gym_ray.bench.tracing_bench import run_tracing_bench  # type: ignore[import-not-found,unused-ignore]

        result = run_tracing_bench(args.n, args.concurrency)
    print(json.dumps({**result, "machine": machine}, indent=2))
    return 0
