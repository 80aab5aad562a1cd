"""The ``gym-ray`` command line: run | submit | serve | status | aggregate | demo | bench.

Each sub-command lives in the module that owns its concept; this file only parses arguments and maps
gym_ray's errors to one clear line on stderr and an exit status (never a traceback for bad input).

Exit statuses (:data:`EXIT_STATUSES`, also in README.md and ``gym-ray run --help``)::

    0    every planned rollout has a result (or failed rows within max_failed_fraction)
    1    any other error (a server, the run folder, a dead driver/coordinator actor, ...)
    2    bad input, config or arguments, or another run holds the folder: nothing was dispatched
    3    the run ended with failed or pending rollouts; rerun the same command to resume
    4    an environment server stayed down past server_outage_timeout_s; rerun once it is back
    130  interrupted by Ctrl-C (SIGINT); resumable when the run folder holds a plan
    143  stopped by SIGTERM; the same as 130
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from gym_ray._streams import unix_streams
from gym_ray.errors import (
    GymRayError,
    IncompleteRunError,
    RunLockError,
    RunRejectedError,
    RunTerminated,
    ServerOutageError,
    UsageError,
)

#: Exception class -> exit status of the ``gym-ray`` command. The first class of an error's MRO found here
#: decides, so a subclass gets its own status by adding one line (most specific classes need no order).
EXIT_STATUSES: dict[type[BaseException], int] = {
    UsageError: 2,  # bad input / config / arguments, refused before anything was dispatched
    IncompleteRunError: 3,  # the run ended with failed or pending rollouts; resumable
    RunRejectedError: 3,  # a strict run left unfinished work; resumable, no score published
    ServerOutageError: 4,  # a server stayed down past server_outage_timeout_s; resumable once it is back
    RunLockError: 2,  # another run holds the folder: refused before anything was planned or sent
    GymRayError: 1,  # any other gym_ray error
    OSError: 1,  # the file system or the network, outside gym_ray's checks
    RunTerminated: 143,  # SIGTERM: stopped like Ctrl-C
    KeyboardInterrupt: 130,  # Ctrl-C
}

EXIT_STATUS_HELP = """exit status:
  0    every planned rollout has a result (or failed rows within max_failed_fraction)
  1    any other error (a server, the run folder, a dead driver or coordinator actor, ...)
  2    bad input, config or arguments, or another run holds the folder: nothing was dispatched
  3    the run ended with failed or pending rollouts; rerun the same command to resume
  4    an environment server stayed down past server_outage_timeout_s; rerun once it is back
  130  interrupted by Ctrl-C; 143 stopped by SIGTERM (resumable once the run folder holds a plan)"""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def exit_status(exc: BaseException) -> int | None:
    """The exit status :data:`EXIT_STATUSES` gives ``exc``, or None when no class of it is listed."""
    for cls in type(exc).__mro__:
        if cls in EXIT_STATUSES:
            return EXIT_STATUSES[cls]
    return None


def _unwrap(exc: BaseException) -> BaseException:
    """The error a Ray task raised, not Ray's wrapper (whose text is the remote traceback)."""
    seen = 0
    while isinstance(getattr(exc, "cause", None), BaseException) and seen < 8:
        exc = exc.cause  # type: ignore[attr-defined]
        seen += 1
    return exc


def error_line(command: str, exc: BaseException) -> str:
    """The message ``gym-ray COMMAND`` prints for ``exc`` (ANSI colour codes removed)."""
    if isinstance(exc, KeyboardInterrupt):
        how = "stopped by SIGTERM" if isinstance(exc, RunTerminated) else "interrupted by Ctrl-C"
        hint = getattr(exc, "resume_hint", None)
        return f"gym-ray {command}: {how}" + (f"; {hint}" if hint else "")
    if isinstance(exc, UsageError):
        text = f"gym-ray {command}: error: {exc}"
    elif isinstance(exc, OSError) and not isinstance(exc, GymRayError):
        where = f": '{exc.filename}'" if exc.filename else ""
        text = f"gym-ray {command}: {type(exc).__name__}: {exc.strerror or exc}{where}"
    else:
        text = f"gym-ray {command}: {type(exc).__name__}: {exc}"
    hint = getattr(exc, "resume_hint", None)  # whether a rerun continues (a run folder that failed)
    return _ANSI.sub("", text + (f"; {hint}" if hint else ""))


class WarningLines(logging.Handler):
    """Shows gym_ray's warnings on stderr as ``gym-ray COMMAND: warning: ...``, one line each.

    Without a handler Python would print them bare (and with a traceback when one is attached); the
    command line states the exception's type and message instead. Installed by :func:`main` on the
    ``gym_ray`` logger for the length of one command; a program that configures logging itself and calls
    the library directly keeps its own handlers.
    """

    def __init__(self, command: str) -> None:
        super().__init__(logging.WARNING)
        self.command = command
        self.shown: set[str] = set()

    def show_warning(
        self, message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any
    ) -> None:
        """``warnings.showwarning`` for one command: the message as one line, without Python's source
        line, and once, however many passes over the rows raise it."""
        text = str(message)
        if text not in self.shown:
            self.shown.add(text)
            self.emit(logging.makeLogRecord({"msg": text, "levelno": logging.WARNING}))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None:
                message += f" ({type(exc).__name__}: {exc})"
            sys.stderr.write(f"gym-ray {self.command}: warning: {' '.join(_ANSI.sub('', message).split())}\n")
            sys.stderr.flush()
        except Exception:  # a broken stderr must not end the run
            self.handleError(record)


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


class CommandParser(argparse.ArgumentParser):
    """argparse with a did-you-mean for a misspelt choice (a command, a bench scenario, ...) or option."""

    commands: dict[str, argparse.ArgumentParser]

    def refuse_unknown(self, command: str | None, extras: list[str]) -> None:
        """Exit 2 naming the first argument no parser took, by the command's parser, with a did-you-mean."""
        target = self.commands.get(command or "", self)
        options = [option for action in target._actions for option in action.option_strings]
        first = extras[0]
        close = difflib.get_close_matches(first.split("=", 1)[0], options, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f" (options: {', '.join(sorted(options))})"
        more = f" (and {len(extras) - 1} more after it)" if len(extras) > 1 else ""
        target.error(f"unrecognized argument {first!r}{more}{hint}")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            names = [str(choice) for choice in choices]
            close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{hint} (choose from {', '.join(names)})"
            )
        super()._check_value(action, value)


def build_parser() -> CommandParser:
    from gym_ray import __version__

    parser = CommandParser(
        prog="gym-ray",
        description="Collect rollouts from NeMo Gym-style environment servers at cluster scale on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"gym-ray {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for name, (help_text, target) in COMMANDS.items():
        suffix = "" if target else " (not built yet)"
        cmd = sub.add_parser(name, help=help_text + suffix, description=help_text + suffix)
        parser.commands[name] = cmd
        add = _ARGUMENTS.get(name)
        if add is not None:
            add(cmd)
        else:
            cmd.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gym-ray`` console script. Returns the process exit code.

    stdout and stderr are streams as a Unix tool's (:mod:`gym_ray._streams`): a reader that closes early
    (``gym-ray status RUN | head -1``) stops the printing, never the command or its exit status.
    """
    with unix_streams():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras and isinstance(getattr(args, "config", None), list):
        # `run a.yaml --no-health-check +x=1`: argparse stops the config list at the flag; the YAML files
        # and overrides after it are the command's too (flags go anywhere on the command line).
        args.config += [item for item in extras if not item.startswith("-")]
        extras = [item for item in extras if item.startswith("-")]
    if extras:
        parser.refuse_unknown(args.command, extras)
    if args.command is None:
        parser.print_help()
        return 2
    _, target = COMMANDS[args.command]
    if target is None:
        print(f"gym-ray {args.command}: not built yet in this version of gym_ray", file=sys.stderr)
        return 2
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    package_logger = logging.getLogger("gym_ray")
    warning_lines = WarningLines(args.command)
    package_logger.addHandler(warning_lines)
    try:
        with warnings.catch_warnings():  # Python warnings as warning lines too, each message once
            warnings.filterwarnings("always", category=UserWarning)
            warnings.showwarning = warning_lines.show_warning
            return int(func(args))
    except BaseException as raised:
        exc = _unwrap(raised)
        status = exit_status(exc)
        if status is None:
            raise  # a bug or SystemExit: Python reports it
        print(error_line(args.command, exc), file=sys.stderr, flush=True)
        return status
    finally:
        flush_telemetry()
        package_logger.removeHandler(warning_lines)


def flush_telemetry() -> None:
    """Export and shut down the telemetry this process recorded (spans, metric points), if any.

    Called on every exit of :func:`main`: normal, error, Ctrl-C, and a SIGTERM that unwinds ``main`` with
    an exception (a signal handler may also call it directly). A no-op, importing nothing, when tracing
    was never set up in this process. Bounded: each provider waits at most
    :data:`gym_ray.observe.tracing.DEFAULT_FLUSH_TIMEOUT_S`.
    """
    from gym_ray.observe.tracing_gate import shutdown_tracing_if_used

    shutdown_tracing_if_used()


# Sub-command registrations. Each names the module that implements it; importing is deferred until the
# command runs so that `gym-ray --help` stays fast and does not import Ray.
# (Modules add their registration line here when they land.)


def _serve_args(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind every server to")
    parser.add_argument(
        "--advertise-host", default=None, help="host written into the published config (default: --host)"
    )
    parser.add_argument(
        "--run-config",
        default=None,
        metavar="PATH",
        help="where to write the head-only run config for `gym-ray run` (default: gym-ray-run.yaml)",
    )


register("serve", "gym_ray.servers.launch:serve_main", _serve_args)


def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def _aggregate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument(
        "config",
        nargs="*",
        help="YAML config file(s), then key=value overrides (default: the servers and config the run "
        "recorded in its folder, gym_ray_run.json)",
    )
    parser.add_argument(
        "--use-new-config",
        action="store_true",
        help="aggregate against the servers the config given resolves to even where they differ from the "
        "ones the run recorded (without it such a config is refused, exit 2)",
    )


register("status", "gym_ray.record.status:status_main", _status_args)
register("aggregate", "gym_ray.record.status:aggregate_main", _aggregate_args)


def _run_args(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument(
        "--workers", type=int, default=None, help="worker actors, >= 1 (default: from config)"
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")
    parser.add_argument("--local", action="store_true", help="run in this process, without Ray")
    parser.add_argument(
        "--no-health-check",
        action="store_true",
        help="do not probe the environment servers (GET /) before the run starts",
    )
    parser.add_argument(
        "--use-new-config",
        action="store_true",
        help="resume a run folder against the servers this config resolves to where they are at other "
        "addresses than the run recorded (gym_ray_run.json); without it such a resume is refused (exit 2)",
    )
    parser.add_argument(
        "--progress",
        default="auto",
        metavar="auto|off|SECONDS",
        help="progress on stderr: a live line on a TTY, else a plain line every 30 s (auto); "
        "off; or a plain line every SECONDS",
    )
    parser.epilog = EXIT_STATUS_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


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
