"""``gym-ray demo`` and ``gym-ray run``: the main job, end to end.

The demo starts the bundled reference servers on 127.0.0.1 (two environment servers of different
difficulty), runs a distributed collection of the bundled arithmetic dataset on a local Ray (several workers,
every task repeated), checks the run folder with the ledger, and prints a metrics table and the output paths.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gym_ray.collect import RunResult

#: Headline metrics shown in the table, in order, when the server reports them.
_HEADLINE = ("mean/reward", "pass@1/accuracy", "pass@1[avg-of-{k}]/accuracy", "pass@{k}/accuracy")


def format_result(result: RunResult, *, repeats: int | None = None) -> str:
    """A compact, human-readable summary of a run: counts, throughput, metrics per server, paths."""
    lines = [
        f"run {result.run_id}: {result.succeeded} succeeded, {result.failed} failed "
        f"of {result.planned} planned "
        f"({result.already_done} already on disk, {result.dispatched} dispatched)",
        f"wall {result.wall_s:.1f} s, {result.rollouts_per_s:.0f} rollouts/s, {result.num_workers} workers",
    ]
    if result.failed_by_class:
        classes = ", ".join(f"{k}={v}" for k, v in sorted(result.failed_by_class.items()))
        lines.append(f"failures by class: {classes}")
    names = [name.format(k=repeats or 1) for name in _HEADLINE]
    shown = [n for n in dict.fromkeys(names) if any(n in m for m in result.key_metrics.values())]
    if not shown:
        shown = sorted({k for m in result.key_metrics.values() for k in m})[:4]
    width = max([len("environment server"), *map(len, result.key_metrics)])
    lines.append("")
    lines.append("  ".join(["environment server".ljust(width), *(n.rjust(max(len(n), 8)) for n in shown)]))
    for server, metrics in sorted(result.key_metrics.items()):
        cells = [_cell(metrics.get(name)).rjust(max(len(name), 8)) for name in shown]
        lines.append("  ".join([server.ljust(width), *cells]))
    for server, error in sorted(result.aggregation_errors.items()):
        lines.append(f"{server}: aggregation failed: {error}")
    lines += [
        "",
        f"rollouts:  {result.rollouts_path}",
        f"failures:  {result.failures_path}",
        f"metrics:   {result.metrics_path}",
        f"summary:   {result.summary_path}",
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int | float):
        return f"{value:.3f}"
    return str(value)


def demo_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gym-ray demo``."""
    parser.add_argument("--workers", type=int, default=2, help="worker actors (default 2)")
    parser.add_argument("--repeats", type=int, default=8, help="rollouts per task (default 8)")
    parser.add_argument("--output-dir", default=None, help="run folder (default runs/demo-<time>)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of a local Ray")


def demo_main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code (0 when the ledger check is clean)."""
    from gym_ray.distributed.api import collect
    from gym_ray.ledger import check_run
    from gym_ray.servers import bundled_dataset_path, load_bundled_config
    from gym_ray.servers.launch import start_in_thread

    output_dir = args.output_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = load_bundled_config("demo")
    print("starting the reference servers on 127.0.0.1 ...", flush=True)
    servers = start_in_thread(cfg)
    try:
        for name in sorted(servers.config):
            if isinstance(servers.config[name], dict) and name != "head_server":
                print(f"  {name}: {servers.url_of(name)}")
        print(f"  head: {servers.head_url}")
        print(f"collecting into {output_dir} with {args.workers} workers on Ray ...", flush=True)
        result = collect(
            servers.config,
            address=args.address,
            num_workers=args.workers,
            input_jsonl_fpath=str(bundled_dataset_path()),
            output_dir=output_dir,
            num_repeats=args.repeats,
            fan_out={"arith_agent": ["arith_agent", "arith_agent_hard"]},
            shard_size=200,
        )
    finally:
        servers.close()
    print()
    print(format_result(result, repeats=args.repeats))
    report = check_run(Path(result.run_dir))
    print(f"ledger:    {report.as_dict()}")
    return 0 if report.ok else 1


def run_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``gym-ray run``."""
    parser.add_argument("config", nargs="+", help="YAML config file(s), then key=value overrides")
    parser.add_argument("--workers", type=int, default=None, help="worker actors (default: from config)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")
    parser.add_argument("--local", action="store_true", help="run in this process, without Ray")


def run_main(args: argparse.Namespace) -> int:
    """Run a collection from a config; returns the exit code."""
    import asyncio

    from gym_ray.collect import acollect_local
    from gym_ray.distributed.api import collect

    paths = [c for c in args.config if "=" not in c]
    overrides = [c for c in args.config if "=" in c]
    if args.local:
        result = asyncio.run(acollect_local(paths, overrides=overrides))
    else:
        result = collect(paths, overrides=overrides, address=args.address, num_workers=args.workers)
    print(format_result(result))
    return 0
