"""Server health: infrastructure failures are not data failures.

A ``/run`` the server never answered (connection refused or reset, a timeout, 502/503/504, 429) says
nothing about the rollout; it says the server, or the way to it, is unwell. The dispatch engine reports
each such failure here and sends the row again on a budget of its own (``max_infra_retries``, apart from
``max_rollout_attempts``, which counts rollouts the server did answer with a failure).

Per server (keyed by its base URL) this object keeps:

- a streak of consecutive infrastructure failures; any answer (a success, or an error status that is not
  502/503/504/429) ends it. When the streak reaches ``down_after`` the server *looks down*: its rows are no
  longer admitted (they wait in :meth:`ServerHealth.admit`, holding no connection slot and spending no
  budget), and one probe task per server GETs ``/`` with exponential backoff until it answers; then
  admission resumes.
- a pause: a 429 or 503 with ``Retry-After`` holds back admission to that server until then (capped by
  ``max_retry_after_s``), so the run slows down instead of hammering it.
- the outage clock: when a server has looked down for ``outage_timeout_s`` (counted from the first
  failure of the streak), every row waiting for it raises :class:`~gym_ray.errors.ServerOutageError`
  naming the server. Nothing is recorded for those rows, so a rerun on the same folder resumes them.

Concurrency: one probe task per down server, owned by this object and cancelled and joined by
:meth:`ServerHealth.aclose`. Everything else runs in the callers' tasks on one event loop.

The run's health object is made current with :func:`health_scope` (a context variable, inherited by the
tasks the scope creates), so the shard runners of one process share it without new arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gym_ray import keys
from gym_ray.errors import (
    ServerConnectionError,
    ServerHTTPError,
    ServerOutageError,
    ServerResponseError,
)

if TYPE_CHECKING:
    from gym_ray.dispatch.client import ServerClient

__all__ = [
    "DOWN_STATUSES",
    "INFRA_STATUSES",
    "RUN_STOP_HINT",
    "HealthListener",
    "ServerHealth",
    "ServerHealthSample",
    "current_health",
    "health_scope",
    "health_summary",
    "is_infrastructure_failure",
    "merge_health",
]

logger = logging.getLogger("gym_ray.dispatch.health")

#: Statuses that say the server did not handle the request: retried apart from rollout attempts.
INFRA_STATUSES = keys.GATEWAY_STATUSES
#: Statuses that count towards "the server looks down" (429 is an answer from a live server).
DOWN_STATUSES = frozenset({502, 503, 504})

#: What a collection run's outage error ends with.
RUN_STOP_HINT = (
    "the run stopped with its unfinished rollouts unrecorded: bring the server back, then rerun on the same "
    "output_dir to resume"
)

_CURRENT: contextvars.ContextVar[ServerHealth | None] = contextvars.ContextVar("gym_ray_health", default=None)


def is_infrastructure_failure(exc: BaseException, *, replay: bool) -> bool:
    """True when ``exc`` is a failure of the server or the network, not of the rollout, and may be resent.

    A connection that was never established sent nothing: always resendable. A timeout, a broken
    connection or a 429/502/503/504 may have reached the server: resendable only when ``replay``
    (``retry_requests``) allows replaying a ``/run``.
    """
    if isinstance(exc, ServerConnectionError):
        return exc.kind == "connect" or replay
    if isinstance(exc, ServerHTTPError):
        return exc.status in INFRA_STATUSES and replay
    return False


@dataclass(frozen=True)
class ServerHealthSample:
    """One server's health at one instant.

    Attributes:
        server: the server's instance name (or URL when no name is known).
        url: its base URL.
        state: ``"up"``, ``"down"`` (rows held back, probing), ``"paused"`` (``Retry-After``) or
            ``"outage"`` (down past the timeout; the run stops).
        down_s: seconds since the first failure of the current streak (0 when up).
        infra_failures: infrastructure failures seen so far (each one resent, not recorded).
        outages: times the server was judged down.
        last_error: the last infrastructure error's text ("" when none).
    """

    server: str
    url: str
    state: str
    down_s: float
    infra_failures: int
    outages: int
    last_error: str


#: Order of the states from best to worst (a merge keeps the worst).
_STATE_RANK = {"up": 0, "paused": 1, "down": 2, "outage": 3}


def health_summary(samples: Iterable[ServerHealthSample]) -> str:
    """One short phrase per server that is not up, in name order; "" when all are up.

    ``"calc_env down 12s"`` (rows held back for 12 s so far), ``"calc_env outage 300s"`` (the run stops),
    ``"calc_env paused"`` (``Retry-After``). The progress lines of every kind of run end with it.
    """
    phrases = []
    for s in sorted(samples, key=lambda sample: sample.server):
        if s.state == "paused":
            phrases.append(f"{s.server} paused")
        elif s.state != "up":
            phrases.append(f"{s.server} {s.state} {s.down_s:.0f}s")
    return ", ".join(phrases)


def merge_health(samples: Iterable[ServerHealthSample]) -> dict[str, ServerHealthSample]:
    """One sample per server from the samples of several processes (each worker keeps its own health).

    A server's merged state is the worst any process reports (``outage`` > ``down`` > ``paused`` > ``up``)
    with that process's URL and last error; ``down_s`` is the longest of the processes that report that
    state; ``infra_failures`` and ``outages`` are summed.
    """
    merged: dict[str, ServerHealthSample] = {}
    for s in samples:
        have = merged.get(s.server)
        if have is None:
            merged[s.server] = s
            continue
        worst = s if _STATE_RANK.get(s.state, 0) > _STATE_RANK.get(have.state, 0) else have
        down_s = max((x.down_s for x in (s, have) if x.state == worst.state), default=0.0)
        merged[s.server] = ServerHealthSample(
            worst.server,
            worst.url,
            worst.state,
            down_s,
            have.infra_failures + s.infra_failures,
            have.outages + s.outages,
            worst.last_error,
        )
    return merged


class HealthListener(Protocol):
    """Told of every change of a :class:`ServerHealth` (e.g. the OpenTelemetry metrics of
    :mod:`gym_ray.observe.health_metrics`). Called on the health object's event loop; keep it cheap."""

    def infra_failure(self, server: str) -> None:
        """One infrastructure failure of ``server`` (resent unless its budget is spent)."""

    def down(self, server: str) -> None:
        """``server`` looks down: its rows are held back."""

    def up(self, server: str, down_s: float) -> None:
        """``server`` answers again (seen first: it is up), after ``down_s`` seconds of outage (0: first
        sight)."""

    def outage(self, server: str, down_s: float) -> None:
        """``server`` stayed down past the timeout after ``down_s`` seconds; the run stops."""


@dataclass
class _Server:
    name: str
    url: str
    back: asyncio.Event = field(default_factory=asyncio.Event)
    streak: int = 0
    first_failure_at: float | None = None
    down_since: float | None = None
    down_from: float | None = None  # first failure of the streak that made it look down
    paused_until: float = 0.0
    infra_failures: int = 0
    outages: int = 0
    last_error: str = ""
    error: ServerOutageError | None = None
    probe: asyncio.Task[None] | None = None


class ServerHealth:
    """Health of the servers one process sends to: admission gate, probes, outage timeout.

    Example:
        >>> async with ServerHealth(client, outage_timeout_s=300) as health, health_scope(health):
        ...     await run_shards(...)

    Args:
        client: the client the probes use (``GET /`` on the server's base URL).
        outage_timeout_s: how long a server may look down before :meth:`admit` raises
            :class:`~gym_ray.errors.ServerOutageError`.
        down_after: consecutive infrastructure failures after which a server looks down.
        probe_base_s: first probe delay; doubled after every failed probe up to ``probe_max_s``.
        probe_max_s: longest delay between probes.
        probe_timeout_s: request timeout of one probe.
        max_retry_after_s: cap for an honoured ``Retry-After``.
        clock: monotonic seconds (injected in tests).
        sleep: awaited for probe delays and pauses.
        listener: told of each server's first sight, every infrastructure failure, each outage and each
            return (metrics); None: nobody.
        stop_hint: the end of the outage error's message: what stopped and what to do.

    Raises:
        ValueError: a limit is not positive.
    """

    def __init__(
        self,
        client: ServerClient,
        *,
        outage_timeout_s: float = 300.0,
        down_after: int = 3,
        probe_base_s: float = 0.25,
        probe_max_s: float = 5.0,
        probe_timeout_s: float = 10.0,
        max_retry_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        listener: HealthListener | None = None,
        stop_hint: str = RUN_STOP_HINT,
    ) -> None:
        for name, value in (
            ("outage_timeout_s", outage_timeout_s),
            ("probe_base_s", probe_base_s),
            ("probe_max_s", probe_max_s),
            ("probe_timeout_s", probe_timeout_s),
            ("max_retry_after_s", max_retry_after_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        if down_after < 1:
            raise ValueError(f"down_after={down_after!r} must be >= 1")
        self._client = client
        self._outage_timeout_s = outage_timeout_s
        self._down_after = down_after
        self._probe_base_s = probe_base_s
        self._probe_max_s = probe_max_s
        self._probe_timeout_s = probe_timeout_s
        self._max_retry_after_s = max_retry_after_s
        self._clock = clock
        self._sleep = sleep
        self._servers: dict[str, _Server] = {}
        self._watchers: list[Callable[[], None]] = []
        self._listener = listener
        self._stop_hint = stop_hint
        self._closed = False

    @property
    def outage_timeout_s(self) -> float:
        """Seconds a server may look down before the run stops."""
        return self._outage_timeout_s

    async def __aenter__(self) -> ServerHealth:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel and join every probe task. Idempotent; rows still waiting in :meth:`admit` are the
        callers' to cancel."""
        self._closed = True
        probes = [s.probe for s in self._servers.values() if s.probe is not None and not s.probe.done()]
        for probe in probes:
            probe.cancel()
        if probes:
            await asyncio.wait(probes)

    # --- what the dispatch engine calls ---------------------------------------------------------------
    async def admit(self, url: str, server: str | None = None) -> None:
        """Return when a row for ``url`` may be sent: at once while the server is up.

        Waits while the server looks down (until a probe finds it back) or is paused by ``Retry-After``.

        Raises:
            ServerOutageError: the server has looked down for ``outage_timeout_s``.
        """
        st = self._state(url, server)
        while True:
            if st.error is not None:
                raise st.error
            if st.down_since is not None:
                await st.back.wait()
                continue
            wait_s = st.paused_until - self._clock()
            if wait_s > 0:
                await self._sleep(wait_s)
                continue
            return

    def answered(self, url: str) -> None:
        """The server at ``url`` answered (any reply that is not an infrastructure failure)."""
        st = self._servers.get(url)
        if st is None or (st.streak == 0 and st.down_since is None):
            return
        st.streak = 0
        st.first_failure_at = None
        if st.down_since is not None and st.error is None:
            self._mark_up(st)

    def failed(self, url: str, server: str | None, exc: BaseException) -> None:
        """Count one infrastructure failure of ``url``; may pause or mark the server down."""
        st = self._state(url, server)
        now = self._clock()
        st.infra_failures += 1
        st.last_error = str(exc)
        if self._listener is not None:
            self._listener.infra_failure(st.name)
        if isinstance(exc, ServerHTTPError) and exc.retry_after_s is not None and exc.status in (429, 503):
            st.paused_until = max(st.paused_until, now + min(exc.retry_after_s, self._max_retry_after_s))
        if isinstance(exc, ServerHTTPError) and exc.status not in DOWN_STATUSES:
            return  # 429: a live server asking us to slow down
        st.streak += 1
        if st.first_failure_at is None:
            st.first_failure_at = now
        if st.streak >= self._down_after and st.down_since is None and st.error is None and not self._closed:
            self._mark_down(st, now)

    async def answers_probe(self, url: str) -> bool:
        """One probe of ``url`` now (``GET /``, the probe timeout): does the server still answer?

        The engine asks it after a ``/run`` timed out: a server that answers is alive and the timeout is
        that rollout's; one that does not is counted as an infrastructure failure.
        """
        return await self._is_up(url)

    # --- visibility ---------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, ServerHealthSample]:
        """Every server seen so far, by name."""
        now = self._clock()
        out: dict[str, ServerHealthSample] = {}
        for st in self._servers.values():
            if st.error is not None:
                state = "outage"
            elif st.down_since is not None:
                state = "down"
            elif st.paused_until > now:
                state = "paused"
            else:
                state = "up"
            down_s = 0.0 if st.first_failure_at is None or state == "up" else now - st.first_failure_at
            out[st.name] = ServerHealthSample(
                st.name, st.url, state, down_s, st.infra_failures, st.outages, st.last_error
            )
        return out

    def summary(self) -> str:
        """One short phrase per server that is not up (``"calc_env down 12s"``); "" when all are up
        (see :func:`health_summary`)."""
        return health_summary(self.snapshot().values())

    def any_down(self) -> bool:
        """True while some server looks down (its rows are held back)."""
        return any(st.down_since is not None and st.error is None for st in self._servers.values())

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` when a server looks down, after every probe (a sign of life of the run while
        a server is down) and when it is back.

        Returns:
            A function that removes the callback.
        """
        self._watchers.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._watchers.remove(callback)

        return remove

    # --- internals ----------------------------------------------------------------------------------
    def _state(self, url: str, server: str | None) -> _Server:
        st = self._servers.get(url)
        if st is None:
            st = self._servers[url] = _Server(server or url, url)
            st.back.set()
            if self._listener is not None:
                self._listener.up(st.name, 0.0)
        return st

    def _mark_down(self, st: _Server, now: float) -> None:
        st.down_since = now
        st.down_from = now if st.first_failure_at is None else st.first_failure_at
        st.outages += 1
        st.back.clear()
        if self._listener is not None:
            self._listener.down(st.name)
        logger.warning(
            "environment server %r (%s) looks down after %d failed attempts in a row (%s); its rows wait "
            "while a probe checks %s/ (the run stops after %g s of outage)",
            st.name,
            st.url,
            st.streak,
            st.last_error,
            st.url,
            self._outage_timeout_s,
        )
        if st.probe is None or st.probe.done():  # a probe still running keeps serving this outage
            st.probe = asyncio.get_running_loop().create_task(self._probe(st))
        self._notify()

    def _mark_up(self, st: _Server) -> None:
        now = self._clock()
        down_s = 0.0 if st.down_since is None else now - st.down_since
        if self._listener is not None:
            self._listener.up(st.name, 0.0 if st.down_from is None else now - st.down_from)
        st.down_since = None
        st.down_from = None
        st.streak = 0
        st.first_failure_at = None
        st.back.set()
        logger.warning(
            "environment server %r (%s) is back after %.1f s; admission resumes", st.name, st.url, down_s
        )
        self._notify()

    def _notify(self) -> None:
        for callback in list(self._watchers):
            callback()

    async def _probe(self, st: _Server) -> None:
        delay = self._probe_base_s
        while st.down_since is not None:
            started = st.first_failure_at if st.first_failure_at is not None else st.down_since
            remaining = self._outage_timeout_s - (self._clock() - started)
            if remaining <= 0:
                down_s = self._clock() - started
                st.error = ServerOutageError(
                    f"environment server {st.name!r} ({st.url}) has not answered for {down_s:.0f} s "
                    f"(server_outage_timeout_s={self._outage_timeout_s:g}; last error: {st.last_error}); "
                    + self._stop_hint,
                    url=st.url,
                    server=st.name,
                    down_s=down_s,
                )
                logger.info("%s", st.error)  # raised to the caller, which reports it once
                if self._listener is not None:
                    self._listener.outage(st.name, down_s)
                st.back.set()
                self._notify()
                return
            await self._sleep(min(delay, remaining))
            if st.down_since is None:
                return  # a row in flight got an answer meanwhile
            if await self._is_up(st.url):
                self._mark_up(st)
                return
            self._notify()
            delay = min(delay * 2.0, self._probe_max_s)

    async def _is_up(self, url: str) -> bool:
        try:
            await self._client.get_json(url, "/", retry_requests=False, timeout_s=self._probe_timeout_s)
        except ServerHTTPError as exc:
            return exc.status not in DOWN_STATUSES
        except ServerResponseError:
            return True  # it answered, just not with JSON
        except ServerConnectionError:
            return False
        except Exception as exc:  # the probe must outlive any surprise; the outage clock still runs
            logger.warning("probing %s/ failed: %s: %s", url, type(exc).__name__, exc)
            return False
        return True


def current_health() -> ServerHealth | None:
    """The health object made current by the innermost :func:`health_scope`, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def health_scope(health: ServerHealth) -> Iterator[ServerHealth]:
    """Make ``health`` current for this block and for every task created inside it."""
    token = _CURRENT.set(health)
    try:
        yield health
    finally:
        _CURRENT.reset(token)
