"""The exception tree, split by who is at fault.

::

    GymRayError
    ├── UsageError (ValueError)        the caller's misuse: fix the input and try again
    │   ├── ConfigError                a config key is missing, mistyped or contradictory
    │   │   └── RoutingError           a row/agent cannot be routed to exactly one environment server
    │   ├── InputError                 a row or input file is malformed (names file+line or row)
    │   ├── ValidationError            rows disagree with the running config (unknown agent, pairing)
    │   └── ResumeError                a run folder cannot be resumed with these inputs/config
    ├── ServerError                    the outside world: an environment/head server misbehaved
    │   ├── ServerConnectionError      no connection / no answer
    │   ├── ServerHTTPError            an error status (``status``, ``body_excerpt``)
    │   ├── ServerResponseError        a 200 reply that is not what the protocol says
    │   ├── ServerOutageError          a server stayed down past server_outage_timeout_s (resumable)
    │   └── AggregationError           one or more /aggregate_metrics calls failed
    ├── RecordError                    the run folder could not be written
    │   ├── RunLockError               another run holds the run folder (names pid, host, start time)
    │   ├── ShardLockError (RuntimeError)   another writer opened the shard since this one did
    │   └── ShardIOError (OSError)     a write or fsync failed; the shard is failed, never retried
    ├── NoProgressError                nothing finished for N seconds (liveness)
    ├── RunRejectedError               a strict run left unfinished work; no score is published
    ├── IncompleteRunError             the run ended with failed or pending rollouts (require_complete)
    ├── ActorLostError                 the run's driver or coordinator actor died
    └── InternalError                  a gym_ray bug: please report it

    KeyboardInterrupt
    └── RunTerminated                  SIGTERM: the run stopped like on Ctrl-C (not a GymRayError)

Every exception here is picklable (arguments are plain data, ``__reduce__`` keeps them), so a
worker actor can raise it and the driver receives the same type.
"""

from __future__ import annotations

from typing import Any


class GymRayError(Exception):
    """Root of every error gym_ray raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes would be lost by BaseException's default pickling.
        return (_rebuild, (type(self), self.args, self.__dict__))


def validation_problems(exc: Any) -> str:
    """A pydantic ``ValidationError``'s problems on one line: ``where: message; ...``.

    ``where`` is the dotted location of each problem (``<body>`` for the value itself). Error messages quote
    this instead of ``str(exc)``, which spans several lines.
    """
    return "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or '<body>'}: {err['msg']}" for err in exc.errors()
    )


def _rebuild(cls: type[GymRayError], args: tuple[Any, ...], state: dict[str, Any]) -> GymRayError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class UsageError(GymRayError, ValueError):
    """The caller's misuse: bad config, bad rows, bad arguments."""


class ConfigError(UsageError):
    """A config key is missing, mistyped or contradictory. ``key`` names its dotted path."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class RoutingError(ConfigError):
    """A row or agent cannot be routed to exactly one environment server."""


class InputError(UsageError):
    """A row or input file is malformed. ``path``/``line`` or ``row`` locate it."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        row: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.row = row


class ValidationError(UsageError):
    """Rows disagree with the running config. ``problems`` lists every offending row/name."""

    def __init__(self, message: str, *, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class ResumeError(UsageError):
    """A run folder cannot be resumed with these inputs or this config."""


class ServerError(GymRayError):
    """An environment or head server misbehaved."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class ServerConnectionError(ServerError):
    """No connection could be made, or the connection broke before a full reply.

    ``kind`` says which: ``"connect"`` (no connection was established, nothing was sent), ``"timeout"``
    (no reply in time) or ``"broken"`` (the connection broke; the body may have been received); None when
    unknown.
    """

    def __init__(self, message: str, *, url: str | None = None, kind: str | None = None) -> None:
        super().__init__(message, url=url)
        self.kind = kind


class ServerHTTPError(ServerError):
    """The server answered an error status."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status: int,
        body_excerpt: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.body_excerpt = body_excerpt
        self.retry_after_s = retry_after_s


class ServerResponseError(ServerError):
    """A reply that is not what the protocol says (bad JSON, not an object, reserved keys)."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status: int | None = None,
        body_excerpt: str | None = None,
    ) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.body_excerpt = body_excerpt


class ServerOutageError(ServerError):
    """A server answered nothing (or only 502/503/504) for longer than ``server_outage_timeout_s``.

    The run stopped without recording the rollouts of that server's rows as failures: rerun on the same
    output folder once the server is back. ``server`` names the server, ``down_s`` how long it was down.
    """

    def __init__(
        self, message: str, *, url: str | None = None, server: str | None = None, down_s: float = 0.0
    ) -> None:
        super().__init__(message, url=url)
        self.server = server
        self.down_s = down_s


class AggregationError(ServerError):
    """One or more ``/aggregate_metrics`` calls failed. ``servers`` maps server -> error text."""

    def __init__(self, message: str, *, servers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.servers = dict(servers or {})


class RecordError(GymRayError):
    """The run folder could not be written."""


class RunLockError(RecordError):
    """Another run holds the run folder's lock. ``holder`` describes it (pid, host, start time)."""

    def __init__(self, message: str, *, path: str | None = None, holder: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.holder = holder


class ShardLockError(RecordError, RuntimeError):
    """Another writer opened the same shard since this one did; this writer may not write to it.

    ``shard`` names the shard; ``holder_pid`` / ``holder_host`` the process that opened it last (None when
    its token could not be read).
    """

    def __init__(
        self,
        message: str,
        *,
        shard: str | None = None,
        holder_pid: int | None = None,
        holder_host: str | None = None,
    ) -> None:
        super().__init__(message)
        self.shard = shard
        self.holder_pid = holder_pid
        self.holder_host = holder_host


class ShardIOError(RecordError, OSError):
    """A write or fsync on a shard failed. The shard is failed; fsync is never retried."""


class NoProgressError(GymRayError):
    """No rollout finished for ``stalled_s`` seconds while work was in flight."""


class RunRejectedError(GymRayError):
    """A strict run left unfinished work, so no score is published."""


class IncompleteRunError(GymRayError):
    """The run ended with failed or pending rollouts, beyond ``max_failed_fraction``.

    Raised by ``collect(..., require_complete=True)`` after the run folder is finalized (merged, summary
    written); a rerun on the same ``output_dir`` runs what is missing. Attributes: ``run_dir``, ``failed``
    and ``pending`` (rows), ``resumable`` (rows a rerun would dispatch).
    """

    def __init__(
        self,
        message: str,
        *,
        run_dir: str | None = None,
        failed: int = 0,
        pending: int = 0,
        resumable: int = 0,
    ) -> None:
        super().__init__(message)
        self.run_dir = run_dir
        self.failed = failed
        self.pending = pending
        self.resumable = resumable


class ActorLostError(GymRayError):
    """An actor the run cannot replace died: ``role`` is ``"driver"`` (the run's
    :class:`~gym_ray.distributed.driver.RunDriver`) or ``"coordinator"`` (its ``RunCoordinator``)."""

    def __init__(self, message: str, *, role: str, run_dir: str | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.run_dir = run_dir


class RunTerminated(KeyboardInterrupt):
    """The process got SIGTERM during a run; it stopped like on Ctrl-C (actors stopped, folder resumable).

    A ``KeyboardInterrupt`` so that code handling Ctrl-C handles it too.
    """


class InternalError(GymRayError):
    """A gym_ray bug. Please report it with the traceback."""
