"""``gym-ray bench SCENARIO``: run one benchmark scenario and print its figures as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

SCENARIOS = ("dispatch", "record", "ray", "tracing")


def bench_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gym-ray bench``."""
    parser.add_argument("scenario", choices=SCENARIOS, help="which benchmark to run")
    parser.add_argument("-n", type=int, default=20000, help="rollouts (dispatch, record, tracing)")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight")


def bench_main(args: argparse.Namespace) -> int:
    """Run the chosen scenario; prints its figures as JSON. Returns 0."""
    result: dict[str, Any]
    if args.scenario == "dispatch":
        from gym_ray.bench.dispatch import run_dispatch_bench

        result = run_dispatch_bench(args.n, args.concurrency)
    elif args.scenario == "record":
        from gym_ray.bench.record import run_record_bench

        result = run_record_bench(args.n, args.concurrency)
    elif args.scenario == "ray":
        from gym_ray.bench.ray_bench import main as ray_main

        return ray_main([])
    else:
        from gym_ray.bench.tracing_bench import run_tracing_bench  # type: ignore[import-not-found,unused-ignore]

        result = run_tracing_bench(args.n, args.concurrency)
    print(json.dumps(result, indent=2))
    return 0
