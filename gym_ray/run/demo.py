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

from gym_ray.errors import RecordError, RunLockError, UsageError
from gym_ray.finalize.aggregate import read_metrics_summary
from gym_ray.run.result import RunResult
from gym_ray.store import is_store_url


def _headline(result: RunResult) -> dict[str, dict[str, Any]]:
    """Per server: ``mean/reward`` and, when the server reports them, pass@1 and pass@k at its repeats."""
    table: dict[str, dict[str, Any]] = {}
    entries: list[dict[str, Any]] = []
    if result.metrics_path and (is_store_url(result.metrics_path) or Path(result.metrics_path).exists()):
        entries = read_metrics_summary(result.metrics_path)
    for entry in entries:
        metrics = {**entry.get("agent_metrics", {}), **entry.get("key_metrics", {})}
        k = metrics.get("num_repeats")
        names = ["mean/reward"]
        if isinstance(k, int):
            names += [f"pass@1[avg-of-{k}]/accuracy", f"pass@{k}/accuracy", f"majority@{k}/accuracy"]
        table[entry["_ng_environment_server"]] = {n: metrics[n] for n in names if n in metrics}
    return table


def format_result(result: RunResult) -> str:
    """A compact, human-readable summary of a run: counts, throughput, metrics per server, paths."""
    lines = [
        f"run {result.run_id}: {result.succeeded} succeeded, {result.failed} failed, "
        f"{result.pending} pending of {result.planned} planned rollouts "
        f"({result.failure_attempts} failed attempts; {result.already_done} already on disk, "
        f"{result.dispatched} dispatched)",
        f"wall {result.wall_s:.1f} s, {result.rollouts_per_s:.0f} rollouts/s, "
        f"{_plural(result.num_workers, 'worker')}",
    ]
    p50, p99 = result.latency_ms.get("p50"), result.latency_ms.get("p99")
    if p50 is not None and p99 is not None:
        lines.append(f"rollout latency p50 {p50:.0f} ms, p99 {p99:.0f} ms")
    if result.failed_by_class:
        classes = ", ".join(f"{k}={v}" for k, v in sorted(result.failed_by_class.items()))
        lines.append(f"failures by class: {classes}")
    table = _headline(result)
    if table:
        shown = list(dict.fromkeys(name for metrics in table.values() for name in metrics))
        width = max([len("environment server"), *map(len, table)])
        lines.append("")
        lines.append(
            "  ".join(["environment server".ljust(width), *(n.rjust(max(len(n), 8)) for n in shown)])
        )
        for server, metrics in sorted(table.items()):
            cells = [_cell(metrics.get(name)).rjust(max(len(name), 8)) for name in shown]
            lines.append("  ".join([server.ljust(width), *cells]))
    for server, error in sorted(result.aggregation_errors.items()):
        lines.append(f"{server}: aggregation failed: {error}")
    lines += [
        "",
        f"rollouts:  {result.rollouts_path}",
        f"failures:  {result.failures_path}",
        f"metrics:   {result.metrics_path or _no_metrics(result)}",
        f"summary:   {result.summary_path}",
    ]
    return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _no_metrics(result: RunResult) -> str:
    """Why a run has no metrics file (``RunResult.metrics_path`` is None)."""
    if result.succeeded == 0:
        return "none (no rollout succeeded: nothing to aggregate)"
    return "none (aggregation is off: disable_aggregation)"


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int | float):
        return f"{value:.3f}"
    return str(value)


def demo_main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code (0 when the ledger check is clean)."""
    from gym_ray.distributed.api import collect
    from gym_ray.record.ledger import check_run
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
        print(f"collecting into {output_dir} with {_plural(args.workers, 'worker')} on Ray ...", flush=True)
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
    print(format_result(result))
    report = check_run(result.run_dir)
    print(f"ledger:    {report.describe()}")
    return 0 if report.ok else 1


def run_main(args: argparse.Namespace) -> int:
    """``gym-ray run``: check, collect, print the summary; returns the exit status (see ``gym_ray.cli``).

    Raises:
        UsageError: Bad arguments or config, refused before Ray starts (exit 2).
        IncompleteRunError: The run ended with failed or pending rollouts (exit 3); the summary is printed
            first and the error names the exact command that resumes it.
        KeyboardInterrupt / RunTerminated: Ctrl-C / SIGTERM; ``resume_hint`` tells whether a rerun continues.
        RecordError / OSError: The run folder could not be written (``ShardIOError`` on a full disk names
            the shard's file); ``resume_hint`` as for Ctrl-C.
    """
    import asyncio
    import shlex

    from gym_ray.config.nemo_env import find_env_yaml
    from gym_ray.config.run_config import resolve_run_config
    from gym_ray.run._gc import collecting_rarely
    from gym_ray.run.collect import acollect_local
    from gym_ray.run.finalize import incomplete_error
    from gym_ray.run.preflight import check_workers
    from gym_ray.run.signals import run_until_signal

    paths = [c for c in args.config if "=" not in c]
    overrides = [c for c in args.config if "=" in c]
    env_yaml = find_env_yaml()  # NeMo Gym 0.7's env.yaml: over config_paths files, under the command line
    check_workers(args.workers, name="--workers")
    if args.local:
        for flag, value in (("--workers", args.workers), ("--address", args.address)):
            if value is not None:
                raise UsageError(f"{flag} has no effect with --local (one process, no Ray); drop one of them")
    every_s = _progress_interval(args.progress)
    settings: dict[str, Any] = {"health_check": False} if args.no_health_check else {}
    if getattr(args, "use_new_config", False):
        settings["use_new_config"] = True  # resume against servers at other addresses than recorded
    run = asyncio.run(resolve_run_config(paths, overrides=overrides, settings=settings, env_file=env_yaml))
    run_dir = str(run.settings.output_dir)
    try:
        with collecting_rarely():  # fewer garbage collections while the run lasts (gym_ray.run._gc)
            if args.local:
                result = run_until_signal(
                    acollect_local(run, progress=every_s is not None, progress_every_s=every_s or 1.0)
                )
            else:
                from gym_ray.distributed.api import collect

                result = collect(
                    run,
                    address=args.address,
                    num_workers=args.workers,
                    progress=every_s is not None,
                    progress_every_s=every_s or 1.0,
                )
    except (KeyboardInterrupt, OSError, RecordError) as exc:
        # Stopped, or the run folder failed (a full disk: ShardIOError names the shard's file): say whether
        # a rerun continues. A second run refused at the folder's lock has nothing of its own to resume.
        from gym_ray.distributed.actors import resume_hint

        says_rerun = "rerun" in str(exc)  # planning's own RecordError already tells how to go on
        if run.settings.output_dir is not None and not isinstance(exc, RunLockError) and not says_rerun:
            exc.resume_hint = resume_hint(run_dir)  # type: ignore[union-attr]
        raise
    print(format_result(result))
    if not result.complete and not _incomplete_allowed(run.settings):
        raise incomplete_error(result, resume_command=shlex.join(["gym-ray", *args.argv]))
    return 0


def _incomplete_allowed(settings: Any) -> bool:
    """True when the config sets ``require_complete=false`` itself: NeMo Gym 0.7 then exits 0 with failed
    or pending rollouts (the summary counts them). Unset, gym_ray's exit status 3 stands."""
    return "require_complete" in settings.model_fields_set and not settings.require_complete


def _progress_interval(value: str) -> float | None:
    """``--progress``: None = off; auto = 1 s on a TTY, 30 s otherwise; or a number of seconds."""
    import sys

    if value == "off":
        return None
    if value == "auto":
        return 1.0 if sys.stderr.isatty() else 30.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"--progress is {value!r}; pass auto, off, or a number of seconds > 0")
    return seconds
