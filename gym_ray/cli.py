"""The ``gym-ray`` command line: run | submit | serve | status | aggregate | demo | bench.

Each sub-command lives in the module that owns its concept; this file only parses arguments and maps
gym_ray's errors to one clear line on stderr and a non-zero exit code (never a traceback for bad input).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from gym_ray.errors import GymRayError, UsageError

#: command -> (help, "module:function" implementing it, or None when not built yet)
COMMANDS: dict[str, tuple[str, str | None]] = {
    "run": ("collect rollouts for a config (distributed on Ray)", None),
    "submit": ("run `gym-ray run` on a Ray cluster as a Ray job (Jobs API)", None),
    "serve": ("start the head server and every reference server a config defines", None),
    "status": ("show a run folder's progress, failures and what resume would run", None),
    "aggregate": ("merge a run folder's shards and compute aggregate metrics", None),
    "demo": ("start the reference servers and run a real collection end to end", None),
    "bench": ("run a benchmark scenario and print its figures", None),
}

_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {}


def register(name: str, target: str, add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """Declare the implementation of a sub-command (called at import of this module only)."""
    help_text, _ = COMMANDS[name]
    COMMANDS[name] = (help_text, target)
    _ARGUMENTS[name] = add_arguments


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="+", help="YAML config file(s), then key=value overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gym-ray",
        description="Collect rollouts from NeMo Gym-style environment servers at cluster scale on Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, target) in COMMANDS.items():
        suffix = "" if target else " (not built yet)"
        cmd = sub.add_parser(name, help=help_text + suffix, description=help_text + suffix)
        add = _ARGUMENTS.get(name)
        if add is not None:
            add(cmd)
        else:
            cmd.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gym-ray`` console script. Returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _, target = COMMANDS[args.command]
    if target is None:
        print(f"gym-ray {args.command}: not built yet in this version of gym_ray", file=sys.stderr)
        return 2
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args))
    except KeyboardInterrupt:
        print(f"gym-ray {args.command}: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"gym-ray {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except GymRayError as exc:
        print(f"gym-ray {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        flush_telemetry()


def flush_telemetry() -> None:
    """Export and shut down the telemetry this process recorded (spans, metric points), if any.

    Called on every exit of :func:`main`: normal, error, Ctrl-C, and a SIGTERM that unwinds ``main`` with
    an exception (a signal handler may also call it directly). A no-op, importing nothing, when tracing
    was never set up in this process. Bounded: each provider waits at most
    :data:`gym_ray.observe.tracing.DEFAULT_FLUSH_TIMEOUT_S`.
    """
    tracing = sys.modules.get("gym_ray.observe.tracing")
    if tracing is not None:
        tracing.shutdown_tracing()


# Sub-command registrations. Each names the module that implements it; importing is deferred until the
# command runs so that `gym-ray --help` stays fast and does not import Ray.
# (Modules add their registration line here when they land.)


def _serve_args(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind every server to")
    parser.add_argument(
        "--advertise-host", default=None, help="host written into the published config (default: --host)"
    )


register("serve", "gym_ray.servers.launch:serve_main", _serve_args)


def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def _aggregate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    _config_args(parser)


register("status", "gym_ray.record.status:status_main", _status_args)
register("aggregate", "gym_ray.record.status:aggregate_main", _aggregate_args)


def _run_args(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--workers", type=int, default=None, help="worker actors (default: from config)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")
    parser.add_argument("--local", action="store_true", help="run in this process, without Ray")


def _demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker actors (default 2)")
    parser.add_argument("--repeats", type=int, default=8, help="rollouts per task (default 8)")
    parser.add_argument("--output-dir", default=None, help="run folder (default runs/demo-<time>)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of a local Ray")


def _bench_args(parser: argparse.ArgumentParser) -> None:
    from gym_ray.bench.cli import bench_args

    bench_args(parser)


def _submit_args(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--address", required=True, help="the cluster's job server, e.g. http://HEAD:8265")
    parser.add_argument("--workers", type=int, default=None, help="worker actors (default: from config)")
    parser.add_argument("--no-wait", action="store_true", help="print the job id and return at once")


register("run", "gym_ray.run.demo:run_main", _run_args)
register("submit", "gym_ray.distributed.submit:submit_main", _submit_args)
register("demo", "gym_ray.run.demo:demo_main", _demo_args)
register("bench", "gym_ray.bench.cli:bench_main", _bench_args)


if __name__ == "__main__":
    sys.exit(main())
