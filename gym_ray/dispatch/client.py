"""HTTP client for the head server and the environment servers (aiohttp).

Concurrency promises:

* One :class:`ServerClient` holds one ``aiohttp.ClientSession`` *per running event loop*, created lazily on
  the first request made from that loop. Every limit is explicit and logged once per session: connector
  ``limit=max_connections`` (``limit_per_host=0``), ``keepalive_timeout``, ``ClientTimeout`` (total, connect,
  sock_connect) and TCP keepalive (``SO_KEEPALIVE`` + idle/interval/probes, set by a socket factory).
* At most ``max_connections`` requests per loop are on the wire at once. The client acquires its own
  semaphore of that size before it calls the session, so aiohttp's connector never queues; the wait for the
  semaphore is what :meth:`ServerClient.load_sample` reports as ``waiting`` (together with requests sleeping
  in a retry backoff), and holding it is ``running``. The semaphore wait does not count against the request
  timeout.
* Retries: a failure to *establish* a connection (nothing was sent) is retried up to ``connect_retries``
  times. A request whose body may have reached the server (dropped connection, payload error, timeout,
  502/503/504/429) is replayed only when ``retry_requests`` is true, at most ``max_request_retries`` times:
  a replayed ``/run`` is a replayed rollout, which is why it is an explicit choice. Other statuses (4xx,
  500, ...) are never retried. ``CancelledError`` always propagates untouched.
* ``aclose()`` closes the sessions and refuses any later use (``RuntimeError``); it closes the current
  loop's session directly and sessions of loops still running in other threads through those loops. A
  session whose loop has already stopped cannot be closed any more (aiohttp needs its loop); it is logged.

Accepted trade-offs: the load counters of one loop are exact; :meth:`ServerClient.load_sample` called from
another thread reads them without a lock (a sample, not a transaction).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import aiohttp
import aiohttp.connector
from yarl import URL

from gym_ray import _json as fast_json
from gym_ray import keys
from gym_ray.dispatch._http import BODY_EXCERPT_CHARS as BODY_EXCERPT_CHARS
from gym_ray.dispatch._http import (
    CONNECT_ERRORS,
    Backoff,
    connection_error,
    excerpt_of,
    json_headers,
    open_body,
    parse_retry_after,
    positive,
    save_reply,
)
from gym_ray.errors import (
    ConfigError,
    InputError,
    ServerHTTPError,
    ServerResponseError,
)

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology

__all__ = [
    "ClientState",
    "LoadSample",
    "ServerClient",
    "TopologyLike",
]

logger = logging.getLogger("gym_ray.dispatch.client")

_RETRY_AFTER_STATUSES = frozenset({429, 503})
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # never NaN / Infinity on the wire
_URL_CACHE_MAX = 4096
# aiohttp warns when enable_cleanup_closed is set on a Python that no longer needs it.
_CLEANUP_CLOSED = bool(getattr(aiohttp.connector, "NEEDS_CLEANUP_CLOSED", False))


class TopologyLike(Protocol):
    """What :class:`ServerClient` needs from a :class:`gym_ray.config.topology.Topology`."""

    @property
    def instances(self) -> Mapping[str, Any]:
        """Server instances by name."""
        ...

    def url_of(self, instance: str) -> str:
        """``"http://host:port"`` of an instance; ``ConfigError`` when there is none."""
        ...


class ClientState(enum.Enum):
    """Lifetime of a :class:`ServerClient` (as httpx's ``ClientState``)."""

    UNOPENED = 1  #: built, no request sent yet
    OPENED = 2  #: in use (a request was sent or ``async with`` entered)
    CLOSED = 3  #: ``aclose()`` was called; every later use raises ``RuntimeError``


@dataclass(frozen=True)
class LoadSample:
    """Requests of one client at one instant.

    Attributes:
        waiting: requests waiting for a connection slot or sleeping in a retry backoff.
        running: requests holding a slot: sent (or connecting) and not yet answered.
        per_server: ``server -> (waiting, running)`` for every server this client has talked to; keys are
            the ``server`` arguments (instance names or URLs) as given.
    """

    waiting: int
    running: int
    per_server: Mapping[str, tuple[int, int]]


@dataclass(slots=True)
class _Load:
    waiting: int = 0
    running: int = 0


@dataclass(slots=True)
class _LoopState:
    loop: asyncio.AbstractEventLoop
    session: aiohttp.ClientSession
    slots: asyncio.Semaphore
    loads: dict[str, _Load]


class ServerClient:
    """Client of the servers of one topology: JSON over HTTP with explicit limits and a retry policy.

    Example:
        >>> async with ServerClient(topology, max_connections=64) as client:
        ...     result = await client.post_json("math_env", "/run", row)

    Args:
        topology: resolves instance names to URLs; None when only absolute URLs are used.
        max_connections: requests on the wire at once, per event loop (also the connector ``limit``).
        connect_timeout_s: limit for establishing one connection.
        request_timeout_s: limit for one attempt, connection included; None means no limit (explicit).
        connect_retries: retries after a failed connection establishment (nothing was sent).
        retry_requests: default for replaying a request whose body may have been received.
        max_request_retries: replays at most, per call, when replaying is allowed.
        backoff_base_s: first backoff; doubled per retry, with jitter in [50 %, 100 %].
        max_backoff_s: cap for a backoff and for an honoured ``Retry-After``.
        keepalive_timeout_s: how long an idle pooled connection is kept (below the servers' 30 s).
        tcp_keepalive_idle_s: TCP keepalive idle time before the first probe.
        tcp_keepalive_interval_s: TCP keepalive interval between probes.
        tcp_keepalive_probes: TCP keepalive probes before the connection is declared dead.
        sleep: awaited for every backoff (inject to observe retries in tests).
        clock: wall clock in seconds since the epoch, used for HTTP-date ``Retry-After`` values.
        rng: jitter source; a fresh ``random.Random()`` when None.

    Raises:
        ConfigError: a limit is not a positive number.
    """

    def __init__(
        self,
        topology: Topology | TopologyLike | None = None,
        *,
        max_connections: int = 256,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float | None = 900.0,
        connect_retries: int = 3,
        retry_requests: bool = True,
        max_request_retries: int = 2,
        backoff_base_s: float = 0.5,
        max_backoff_s: float = 30.0,
        keepalive_timeout_s: float = 15.0,
        tcp_keepalive_idle_s: int = 60,
        tcp_keepalive_interval_s: int = 10,
        tcp_keepalive_probes: int = 3,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ConfigError(
                f"max_connections={max_connections!r} is invalid: pass an int >= 1", key="max_connections"
            )
        for name, count in (
            ("connect_retries", connect_retries),
            ("max_request_retries", max_request_retries),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ConfigError(f"{name}={count!r} is invalid: pass an int >= 0", key=name)
        positive("connect_timeout_s", connect_timeout_s)
        positive("request_timeout_s", request_timeout_s, allow_none=True)
        positive("backoff_base_s", backoff_base_s)
        positive("max_backoff_s", max_backoff_s)
        positive("keepalive_timeout_s", keepalive_timeout_s)
        self._topology = topology
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._connect_retries = connect_retries
        self._retry_requests = retry_requests
        self._max_request_retries = max_request_retries
        self._keepalive_timeout_s = keepalive_timeout_s
        self._tcp_keepalive = (tcp_keepalive_idle_s, tcp_keepalive_interval_s, tcp_keepalive_probes)
        self.sleep = sleep  #: awaited for every backoff (the engine's resends too)
        self._clock = clock
        #: the backoff of the client's retries (the dispatch engine's resends use it too)
        self.backoff = Backoff(backoff_base_s, max_backoff_s, rng if rng is not None else random.Random())
        self._timeout = self._make_timeout(request_timeout_s)
        self._state = ClientState.UNOPENED
        self._loops: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._last: _LoopState | None = None
        self._bases: dict[str, str] = {}
        self._urls: dict[str, URL] = {}

    # --- lifetime ---------------------------------------------------------------------------------
    @property
    def state(self) -> ClientState:
        """The client's lifetime state."""
        return self._state

    async def __aenter__(self) -> ServerClient:
        if self._state is ClientState.CLOSED:
            raise RuntimeError("Cannot reopen a ServerClient once it has been closed; build a new one.")
        if self._state is ClientState.OPENED:
            raise RuntimeError("Cannot open a ServerClient more than once (it is already in use).")
        self._state = ClientState.OPENED
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every session and refuse later use. Idempotent; never leaves the client usable.

        The current loop's session is closed here; a session of a loop running in another thread is closed
        through that loop (up to 10 s); a session whose loop no longer runs is logged and dropped.
        """
        self._state = ClientState.CLOSED
        states = list(self._loops.values())
        self._loops.clear()
        self._last = None
        current = asyncio.get_running_loop()
        for st in states:
            try:
                if st.loop is current:
                    await st.session.close()
                elif st.loop.is_running() and not st.loop.is_closed():
                    future = asyncio.run_coroutine_threadsafe(st.session.close(), st.loop)
                    await asyncio.wait_for(asyncio.wrap_future(future), timeout=10.0)
                else:
                    logger.warning(
                        "cannot close the session of event loop %#x: that loop no longer "
                        "runs; call aclose() from the loop that used the client before it ends",
                        id(st.loop),
                    )
            except Exception:
                logger.warning("closing a session failed", exc_info=True)

    @property
    def open_sessions(self) -> int:
        """Number of sessions (one per event loop that used this client) not yet closed."""
        return len(self._loops)

    def _make_timeout(self, total_s: float | None) -> aiohttp.ClientTimeout:
        ct = self._connect_timeout_s
        return aiohttp.ClientTimeout(total=total_s, connect=ct, sock_connect=ct)

    def _socket_factory(self, addr_info: Any) -> socket.socket:
        family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle, interval, probes = self._tcp_keepalive
        for opt_name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", probes)):
            opt = getattr(socket, opt_name, None)
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        return sock

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        last = self._last
        if last is not None and last.loop is loop:
            return last
        if self._state is ClientState.CLOSED:
            raise RuntimeError("Cannot send a request, as the ServerClient has been closed.")
        st = self._loops.get(loop)
        if st is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_timeout_s,
                enable_cleanup_closed=_CLEANUP_CLOSED,
                socket_factory=self._socket_factory,
            )
            session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar()
            )
            st = _LoopState(loop, session, asyncio.Semaphore(self._max_connections), {})
            self._loops[loop] = st
            idle, interval, probes = self._tcp_keepalive
            limits = {
                "max_connections": self._max_connections,
                "connector_limit": self._max_connections,
                "limit_per_host": 0,
                "keepalive_timeout_s": self._keepalive_timeout_s,
                "request_timeout_s": self._request_timeout_s,
                "connect_timeout_s": self._connect_timeout_s,
                "connect_retries": self._connect_retries,
                "retry_requests": self._retry_requests,
                "max_request_retries": self._max_request_retries,
                "max_backoff_s": self.backoff.max_s,
                "tcp_keepalive": f"idle={idle}s,interval={interval}s,probes={probes}",
                "enable_cleanup_closed": _CLEANUP_CLOSED,
            }
            logger.info(
                "new session for event loop %#x: %s",
                id(loop),
                " ".join(f"{k}={v}" for k, v in limits.items()),
            )
        self._state = ClientState.OPENED
        self._last = st
        return st

    # --- requests ---------------------------------------------------------------------------------
    def base_url(self, server: str) -> str:
        """``"http://host:port"`` for an instance name, or the absolute URL itself (no trailing slash).

        Raises:
            ConfigError: ``server`` is neither an absolute http(s) URL nor an instance of the topology.
        """
        base = self._bases.get(server)
        if base is None:
            if server.startswith(("http://", "https://")):
                base = server.rstrip("/")
            elif self._topology is None:
                raise ConfigError(
                    f"server {server!r} is not an absolute http:// URL and this ServerClient has no "
                    "topology to resolve instance names; pass topology= or a URL",
                    key=server,
                )
            else:
                base = self._topology.url_of(server).rstrip("/")
            self._bases[server] = base
        return base

    async def post_json(
        self,
        server: str,
        path: str,
        body: Any,
        *,
        retry_requests: bool | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        prior_attempts: int = 0,
    ) -> Any:
        """POST ``body`` as JSON to ``server`` + ``path`` and return the parsed JSON reply (any JSON type).

        Args:
            server: an instance name of the topology or an absolute URL (``"http://127.0.0.1:8000"``).
            path: the path, starting with ``/`` (``"/run"``).
            body: a JSON-serialisable value.
            retry_requests: overrides the client default for replaying a request that may have been received.
            headers: extra headers; ``Content-Type: application/json`` is always sent.
            timeout_s: overrides ``request_timeout_s`` for this call (None: the client default).
            prior_attempts: requests the caller already sent for the same purpose (a caller that runs its
                own retry ladder, as the dispatch engine does for ``/run``); error messages count them.

        Returns:
            The reply body parsed with ``json.loads``; checking its shape is the caller's job.

        Raises:
            ServerConnectionError: no connection, a broken connection or a timeout, after the retries.
            ServerHTTPError: an error status (``status``, ``body_excerpt``, ``retry_after_s``).
            ServerResponseError: a 2xx reply that is not JSON, or a malformed HTTP reply.
            InputError: ``body`` is not JSON-serialisable.
            ConfigError: ``server`` cannot be resolved or the URL is invalid.
            RuntimeError: the client was closed.
        """
        try:
            data = _ENCODER.encode(body).encode()
        except (TypeError, ValueError) as exc:
            raise InputError(
                f"the request body for {server}{path} is not JSON-serialisable ({exc}); pass plain "
                "dicts/lists/str/int/float/bool/None"
            ) from exc
        return await self._request(
            "POST",
            server,
            path,
            data,
            json_headers(headers),
            retry_requests,
            timeout_s,
            prior_attempts=prior_attempts,
        )

    async def post_json_file(
        self,
        server: str,
        path: str,
        body_path: str | os.PathLike[str],
        *,
        retry_requests: bool | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        reply_path: str | os.PathLike[str] | None = None,
    ) -> Any:
        """POST the bytes of the file ``body_path`` as the JSON body; otherwise exactly :meth:`post_json`.

        For bodies too large to hold in memory (``/aggregate_metrics`` over a whole run). The file is
        streamed with ``Content-Length`` (an ordinary body, not chunked) and reopened for every attempt, so
        a replayed request resends the whole file. Its bytes are sent as they are: they must be JSON and
        must not change until the call returns. ``retry_requests``, ``headers`` and ``timeout_s`` are
        those of :meth:`post_json`.

        With ``reply_path``, a 2xx reply body is not read into memory: it is written to that file (created
        or truncated) in chunks of 64 KiB as it arrives, unchecked (parsing it is the caller's job, e.g.
        with ``gym_ray.finalize.json_stream``), and the call returns ``None``. Every attempt rewrites the
        file from its start. Error statuses behave as without ``reply_path`` (their small body is read
        for the excerpt; the file is not written).

        Returns:
            The parsed reply, or ``None`` when ``reply_path`` is given.

        Raises:
            InputError: ``body_path`` cannot be opened for reading.
            RecordError: ``reply_path`` cannot be written.
            ServerConnectionError, ServerHTTPError, ServerResponseError, ConfigError, RuntimeError:
                as :meth:`post_json`.
        """
        body = Path(body_path)
        return await self._request(
            "POST",
            server,
            path,
            body,
            json_headers(headers),
            retry_requests,
            timeout_s,
            reply_path=None if reply_path is None else Path(reply_path),
        )

    async def get_json(
        self,
        server: str,
        path: str,
        *,
        retry_requests: bool | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """GET ``server`` + ``path`` and return the parsed JSON reply. Same contract as :meth:`post_json`."""
        return await self._request("GET", server, path, None, headers, retry_requests, timeout_s)

    def load_sample(self) -> LoadSample:
        """Requests waiting and running right now, summed over every server and event loop of this client."""
        per_server: dict[str, tuple[int, int]] = {}
        for st in list(self._loops.values()):
            for server, load in list(st.loads.items()):
                w, r = per_server.get(server, (0, 0))
                per_server[server] = (w + load.waiting, r + load.running)
        waiting = sum(w for w, _ in per_server.values())
        running = sum(r for _, r in per_server.values())
        return LoadSample(waiting=waiting, running=running, per_server=per_server)

    def _url(self, server: str, path: str) -> tuple[str, URL]:
        text = self.base_url(server) + path
        url = self._urls.get(text)
        if url is None:
            if not path.startswith("/"):
                raise ConfigError(f"path {path!r} for {server!r} must start with '/'", key=path)
            try:
                url = URL(text)
            except ValueError as exc:
                raise ConfigError(f"{text!r} is not a valid URL ({exc})", key=server) from exc
            if len(self._urls) >= _URL_CACHE_MAX:
                self._urls.clear()
            self._urls[text] = url
        return text, url

    @property
    def max_request_retries(self) -> int:
        """Replays of one request whose body may have reached the server, when replaying is allowed."""
        return self._max_request_retries

    async def _request(
        self,
        method: str,
        server: str,
        path: str,
        data: bytes | Path | None,
        headers: Mapping[str, str] | None,
        retry_requests: bool | None,
        timeout_s: float | None,
        *,
        reply_path: Path | None = None,
        prior_attempts: int = 0,
    ) -> Any:
        st = self._loop_state()
        text, url = self._url(server, path)
        load = st.loads.get(server)
        if load is None:
            load = st.loads[server] = _Load()
        replay = self._retry_requests if retry_requests is None else retry_requests
        if timeout_s is None:
            timeout = self._timeout
        else:
            positive("timeout_s", timeout_s)
            timeout = self._make_timeout(timeout_s)
        session, slots = st.session, st.slots
        connect_failures = request_retries = 0
        while True:
            failure: BaseException | None = None
            kind = ""
            status = 0
            payload = b""
            retry_after_raw: str | None = None
            load.waiting += 1
            try:
                await slots.acquire()
            finally:
                load.waiting -= 1
            load.running += 1
            body_file: BinaryIO | None = None
            sent: bytes | BinaryIO | None
            try:
                if isinstance(data, Path):
                    sent = body_file = open_body(data, text)
                else:
                    sent = data
                async with session.request(method, url, data=sent, headers=headers, timeout=timeout) as resp:
                    status = resp.status
                    if reply_path is not None and 200 <= status < 300:
                        await save_reply(resp, reply_path, text)
                    else:
                        payload = await resp.read()
                    if status >= 400:
                        retry_after_raw = resp.headers.get("Retry-After")
            except CONNECT_ERRORS as exc:
                failure, kind = exc, "connect"
            except aiohttp.InvalidUrlClientError as exc:
                raise ConfigError(f"{text!r} is not a valid http URL ({exc})", key=server) from exc
            except aiohttp.ClientResponseError as exc:
                raise ServerResponseError(
                    f"{method} {text} got a malformed HTTP reply ({type(exc).__name__}: {exc}); is it a "
                    "NeMo Gym-style server?",
                    url=text,
                    status=exc.status or None,
                ) from exc
            except TimeoutError as exc:
                failure, kind = exc, "timeout"
            except aiohttp.ClientError as exc:
                failure, kind = exc, "broken"
            finally:
                if body_file is not None:
                    body_file.close()
                load.running -= 1
                slots.release()

            if failure is None and 200 <= status < 300:
                if reply_path is not None:
                    return None
                try:
                    return fast_json.loads(payload)
                except ValueError as exc:
                    raise ServerResponseError(
                        f"{method} {text} answered HTTP {status} with a body that is not JSON ({exc}): "
                        f"{excerpt_of(payload)[:200]!r}",
                        url=text,
                        status=status,
                        body_excerpt=excerpt_of(payload),
                    ) from exc

            attempts = prior_attempts + connect_failures + request_retries + 1
            if failure is None:
                retry_after_s = parse_retry_after(retry_after_raw, self._clock())
                if not (
                    replay and status in keys.GATEWAY_STATUSES and request_retries < self._max_request_retries
                ):
                    excerpt = excerpt_of(payload)
                    raise ServerHTTPError(
                        f"{method} {text} answered HTTP {status} after {attempts} attempt(s): "
                        f"{excerpt[:200]!r}",
                        url=text,
                        status=status,
                        body_excerpt=excerpt,
                        retry_after_s=retry_after_s,
                    )
                wait_hint = retry_after_s if status in _RETRY_AFTER_STATUSES else None
                delay = self.backoff.delay(request_retries, wait_hint)
                request_retries += 1
            elif kind == "connect":
                if connect_failures >= self._connect_retries:
                    raise connection_error(kind, text, attempts, failure, timeout.total) from failure
                delay = self.backoff.delay(connect_failures, None)
                connect_failures += 1
            else:
                if not (replay and request_retries < self._max_request_retries):
                    raise connection_error(kind, text, attempts, failure, timeout.total) from failure
                delay = self.backoff.delay(request_retries, None)
                request_retries += 1
            logger.info(
                "retrying %s %s in %.3f s after %s",
                method,
                text,
                delay,
                f"HTTP {status}" if failure is None else f"{type(failure).__name__}: {failure}",
            )
            load.waiting += 1
            try:
                await self.sleep(delay)
            finally:
                load.waiting -= 1
