"""Start a config's reference servers and its head server: in a task, in a thread, or from the CLI.

``serve_config(cfg)`` starts every instance whose implementation is a reference implementation
(``REFERENCE_IMPLEMENTATIONS``), binding each first (port 0 -> an ephemeral port) and writing the real
host and port into a copy of the config, then a head server publishing that copy. Instances with other
implementations are left in the config untouched (they are expected to run elsewhere).

Lifetime: everything started is stopped when the context exits, also on error or cancellation; handlers
still running get ``SHUTDOWN_TIMEOUT_S`` and are then cancelled. ``start_in_thread`` runs the same thing
on a private event loop in a daemon thread for synchronous callers (CLI demo, Ray tests); its ``close()``
joins the thread.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web

from gym_ray import keys
from gym_ray.errors import ConfigError
from gym_ray.servers import _web
from gym_ray.servers.example_env import ExampleEnvServer
from gym_ray.servers.example_resources import ExampleResourcesServer
from gym_ray.servers.head import HeadServer
from gym_ray.servers.redaction import DEFAULT_SECRET_PATTERNS, TOKEN_ENV, is_loopback
from gym_ray.servers.stats import ServerStats

#: server type -> implementation keys this package can serve.
REFERENCE_IMPLEMENTATIONS: Mapping[str, frozenset[str]] = {
    keys.ENVIRONMENT_SERVERS: frozenset({"example_env"}),
    keys.RESPONSES_API_AGENTS: frozenset({"example_env"}),
    keys.RESOURCES_SERVERS: frozenset({"example_resources"}),
}

ReferenceServer = ExampleEnvServer | ExampleResourcesServer
T = TypeVar("T")


class Deployment:
    """A running set of reference servers plus the head server (made by ``serve_config``).

    Attributes:
        config: the config copy with real hosts and ports (what the head server publishes).
        head_url: ``http://host:port`` of the head server.
        servers: instance name -> its reference server object (``.stats``, ``.policy``, ...).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.head_url = ""
        self.servers: dict[str, ReferenceServer] = {}
        self.head = HeadServer()
        self.head_token: str | None = None
        self.token_generated = False
        self._runners: list[web.AppRunner] = []
        # name -> (its runner, or None while stopped; the interface and port it listens on)
        self._sites: dict[str, tuple[web.AppRunner | None, str, int]] = {}

    def url_of(self, name: str) -> str:
        """``http://host:port`` of instance ``name`` (reference or not).

        Raises:
            ConfigError: ``name`` is not a server instance of the config.
        """
        fields = _instance_fields(self.config, name)
        if fields is None:
            raise ConfigError(
                f"{name!r} is not a server instance of this deployment; "
                f"instances: {_instance_names(self.config)}",
                key=name,
            )
        return f"http://{fields.get('host')}:{fields.get('port')}"

    def stats(self, name: str) -> ServerStats:
        """A snapshot of the request counters of reference instance ``name``."""
        return self._server(name).stats.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters of every reference instance."""
        for server in self.servers.values():
            server.stats.reset()

    def set_skill(self, name: str, skill: float) -> None:
        """Set the simulated policy's skill (0..1) of ``example_env`` instance ``name``."""
        server = self._server(name)
        if not isinstance(server, ExampleEnvServer):
            raise ConfigError(
                f"{name!r} is an {type(server).__name__}; only example_env has a policy", key=name
            )
        server.policy.skill = skill

    async def stop_server(self, name: str) -> None:
        """Stop serving reference instance ``name``: its port refuses connections until
        :meth:`restart_server`. A test tool for outages (its counters are kept).

        Raises:
            ConfigError: ``name`` is not a reference server of this deployment, or is already stopped.
        """
        self._server(name)
        runner, host, port = self._sites[name]
        if runner is None:
            raise ConfigError(f"reference server {name!r} is already stopped", key=name)
        self._runners.remove(runner)
        self._sites[name] = (None, host, port)
        await runner.cleanup()

    async def restart_server(self, name: str) -> None:
        """Serve reference instance ``name`` again on the same interface and port after :meth:`stop_server`.

        Raises:
            ConfigError: ``name`` is not a stopped reference server, or its port is taken meanwhile.
        """
        server = self._server(name)
        runner, host, port = self._sites[name]
        if runner is not None:
            raise ConfigError(f"reference server {name!r} is running; stop_server() it first", key=name)
        await self._bind(server.make_app(), host, port, what=name)

    def _server(self, name: str) -> ReferenceServer:
        try:
            return self.servers[name]
        except KeyError:
            raise ConfigError(
                f"{name!r} is not a reference server of this deployment; running: {sorted(self.servers)}",
                key=name,
            ) from None

    async def _start(self, host: str, advertise_host: str) -> None:
        planned: list[tuple[str, dict[str, Any], ReferenceServer]] = []
        for name, server_type, implementation, fields in _instances(self.config):
            if implementation not in REFERENCE_IMPLEMENTATIONS.get(server_type, frozenset()):
                continue
            server: ReferenceServer
            if implementation == "example_resources":
                server = ExampleResourcesServer(name, fields)
            else:
                server = ExampleEnvServer(name, fields, server_type=server_type)
            planned.append((name, fields, server))  # every instance validated before anything binds
        for name, fields, server in planned:
            port = await self._bind(server.make_app(), host, _port_field(fields, name), what=name)
            fields["host"], fields["port"] = advertise_host, port
            self.servers[name] = server
        head_cfg = self.config.get(keys.HEAD_SERVER)
        head_fields: dict[str, Any] = dict(head_cfg) if isinstance(head_cfg, Mapping) else {}
        head_port = await self._bind(
            self.head.make_app(), host, _port_field(head_fields, keys.HEAD_SERVER), what=keys.HEAD_SERVER
        )
        head_fields["host"], head_fields["port"] = advertise_host, head_port
        self.config[keys.HEAD_SERVER] = head_fields
        self.head_url = f"http://{advertise_host}:{head_port}"
        self.head.set_config(self.config)
        self.head.mark_ready()

    async def _bind(self, app: web.Application, host: str, port: int, *, what: str) -> int:
        runner = _web.make_runner(app)
        await runner.setup()
        self._runners.append(runner)
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ConfigError(
                f"{what}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                "free the port or use port 0",
                key=f"{what}.port",
            ) from exc
        bound = _web.bound_port(runner)
        self._sites[what] = (runner, host, bound)
        return bound

    async def _stop(self) -> None:
        runners, self._runners = self._runners, []
        for runner in reversed(runners):
            await runner.cleanup()


@asynccontextmanager
async def serve_config(
    cfg: Mapping[str, Any],
    *,
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
    token: str | None = None,
    secret_patterns: Sequence[str] | None = None,
) -> AsyncIterator[Deployment]:
    """Serve every reference instance of ``cfg`` and a head server until the context exits.

    Args:
        cfg: the global config (plain dict or OmegaConf ``DictConfig``); it is copied, never mutated.
        host: interface to bind every server to.
        advertise_host: host written into the config copy; default ``host`` (use a routable address
            when binding ``0.0.0.0``).
        token: the head server's token: a client presenting ``Authorization: Bearer <token>`` sees the
            config's secret values; others see them redacted. Binding a non-loopback ``host`` without a
            token generates one (``deployment.head_token``, ``deployment.token_generated``).
        secret_patterns: key patterns whose values are secret; default ``head_server.secret_patterns``
            of the config, else :data:`gym_ray.servers.redaction.DEFAULT_SECRET_PATTERNS`.

    Yields:
        The ``Deployment``: rewritten ``config``, ``head_url``, ``url_of``, ``stats``, ``reset_stats``,
        ``set_skill``.

    Raises:
        ConfigError: a reference instance has a bad field, or a fixed port is taken.

    Example:
        >>> async def main(cfg):
        ...     async with serve_config(cfg) as deployment:
        ...         print(deployment.head_url, deployment.url_of("arith_env"))
    """
    deployment = Deployment(plain_config(cfg))
    if secret_patterns is None:
        head_cfg = deployment.config.get(keys.HEAD_SERVER)
        listed = head_cfg.get("secret_patterns") if isinstance(head_cfg, Mapping) else None
        secret_patterns = [str(p) for p in listed] if isinstance(listed, list) else DEFAULT_SECRET_PATTERNS
    if token is None and not is_loopback(host):
        token, deployment.token_generated = secrets.token_urlsafe(32), True
    deployment.head = HeadServer(token=token, secret_patterns=secret_patterns)
    deployment.head_token = token
    try:
        await deployment._start(host, advertise_host or host)
        yield deployment
    finally:
        await deployment._stop()


class ThreadedDeployment:
    """``serve_config`` running on a private event loop in a background thread (``start_in_thread``).

    Same read API as ``Deployment``; calls are forwarded to the servers' loop. ``close()`` (or leaving a
    ``with`` block) stops the servers and joins the thread; it is idempotent.
    """

    def __init__(
        self, cfg: Mapping[str, Any], *, host: str, advertise_host: str | None, startup_timeout_s: float
    ) -> None:
        self._cfg = plain_config(cfg)
        self._host, self._advertise_host = host, advertise_host
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop_event: asyncio.Event | None = None
        self._deployment: Deployment | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._main, name="gym-ray-reference-servers", daemon=True)
        self._thread.start()
        if not self._started.wait(startup_timeout_s):
            self.close()
            raise ConfigError(f"reference servers did not start within {startup_timeout_s:g} s")
        if self._error is not None:
            self._thread.join()
            raise self._error

    @property
    def config(self) -> dict[str, Any]:
        """The rewritten config (real hosts and ports)."""
        return self._live().config

    @property
    def head_url(self) -> str:
        """``http://host:port`` of the head server."""
        return self._live().head_url

    def url_of(self, name: str) -> str:
        """See ``Deployment.url_of``."""
        return self._live().url_of(name)

    def stats(self, name: str) -> ServerStats:
        """See ``Deployment.stats`` (snapshot taken on the servers' loop)."""
        deployment = self._live()
        return self._on_loop(lambda: deployment.stats(name))

    def reset_stats(self) -> None:
        """See ``Deployment.reset_stats``."""
        self._on_loop(self._live().reset_stats)

    def set_skill(self, name: str, skill: float) -> None:
        """See ``Deployment.set_skill``."""
        deployment = self._live()
        self._on_loop(lambda: deployment.set_skill(name, skill))

    def stop_server(self, name: str) -> None:
        """See ``Deployment.stop_server`` (runs on the servers' loop)."""
        future = asyncio.run_coroutine_threadsafe(self._live().stop_server(name), self._loop)
        future.result(timeout=30.0)

    def restart_server(self, name: str) -> None:
        """See ``Deployment.restart_server`` (runs on the servers' loop)."""
        future = asyncio.run_coroutine_threadsafe(self._live().restart_server(name), self._loop)
        future.result(timeout=30.0)

    def close(self) -> None:
        """Stop the servers and join the thread."""
        if self._thread.is_alive() and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self._thread.join()

    def __enter__(self) -> ThreadedDeployment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _live(self) -> Deployment:
        if self._deployment is None or not self._thread.is_alive():
            raise ConfigError("the reference servers are closed; start them again with start_in_thread")
        return self._deployment

    def _on_loop(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=30.0)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        try:
            async with serve_config(self._cfg, host=self._host, advertise_host=self._advertise_host) as d:
                self._deployment = d
                self._started.set()
                await self._stop_event.wait()
        except Exception as exc:  # handed to the starting thread, which re-raises it
            self._error = exc
        finally:
            self._started.set()


def start_in_thread(
    cfg: Mapping[str, Any],
    *,
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
    startup_timeout_s: float = 30.0,
) -> ThreadedDeployment:
    """Start ``serve_config(cfg)`` in a background thread and return once every server listens.

    Raises:
        ConfigError: as ``serve_config``, or the servers did not start within ``startup_timeout_s``.

    Example:
        >>> with start_in_thread(cfg) as servers:
        ...     print(servers.head_url)
    """
    return ThreadedDeployment(
        cfg, host=host, advertise_host=advertise_host, startup_timeout_s=startup_timeout_s
    )


def plain_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A deep plain-dict copy of ``cfg`` (an OmegaConf ``DictConfig`` is resolved first)."""
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        container = OmegaConf.to_container(cfg, resolve=True)
        if not isinstance(container, dict):
            raise ConfigError(f"the config is a {type(container).__name__}, not a mapping")
        return {str(k): v for k, v in container.items()}
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"the config is a {type(cfg).__name__}, not a mapping")
    return copy.deepcopy(dict(cfg))


def load_config_files(paths: Sequence[str], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load and merge YAML configs plus ``key=value`` overrides (``gym_ray.config.settings.load_config``).

    Raises:
        ConfigError: a file is missing or not YAML, or an override is malformed.
    """
    from gym_ray.config.settings import load_config

    return plain_config(load_config(list(paths), list(overrides)))


def serve_main(args: argparse.Namespace) -> int:
    """``gym-ray serve CONFIG... [key=value...]``: serve until Ctrl-C or SIGTERM, then exit 0.

    The head server's token is ``$GYM_RAY_HEAD_TOKEN``; binding a non-loopback ``--host`` without it
    generates one and prints it once (secret config values are served only to requests presenting it).
    """
    items: list[str] = list(args.config)
    paths = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    if not paths:
        raise ConfigError("gym-ray serve needs at least one YAML config file")
    cfg = load_config_files(paths, overrides)
    run_config = getattr(args, "run_config", None) or RUN_CONFIG_FILE
    token = os.environ.get(TOKEN_ENV) or None
    asyncio.run(
        _serve_until_signal(
            cfg, host=args.host, advertise_host=args.advertise_host, run_config=run_config, token=token
        )
    )
    return 0


#: Where ``gym-ray serve`` writes the head-only run config (``--run-config`` changes it).
RUN_CONFIG_FILE = "gym-ray-run.yaml"


def write_run_config(path: str, head_url: str) -> None:
    """Write a head-only run config for ``gym-ray run``: the head server's host and port, nothing else.

    A run given this file reads every server and routing key from the head's published config, so it
    reaches the servers at the ports they really listen on.

    Raises:
        ConfigError: The file cannot be written.
    """
    host, _, port = head_url.removeprefix("http://").rpartition(":")
    text = (
        "# Written by `gym-ray serve`: the running head server. Pass it to `gym-ray run`; the run reads\n"
        "# every server and routing key from the head. Rewritten each time `gym-ray serve` starts.\n"
        f"head_server:\n  host: {host}\n  port: {int(port)}\n"
    )
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the run config {path!r}: {exc.strerror or exc}; pass --run-config PATH elsewhere"
        ) from exc


async def _serve_until_signal(
    cfg: dict[str, Any],
    *,
    host: str,
    advertise_host: str | None,
    run_config: str = RUN_CONFIG_FILE,
    token: str | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with serve_config(cfg, host=host, advertise_host=advertise_host, token=token) as deployment:
            for name, server in deployment.servers.items():
                print(f"{name} ({server.server_type}): {deployment.url_of(name)}", flush=True)
            print(f"head server: {deployment.head_url}", flush=True)
            if deployment.token_generated:
                # The one place the token is shown: the operator needs it to read secret values.
                print(
                    f"head server token (generated; {host} is not loopback, so secret config values are "
                    f"served only with 'Authorization: Bearer <token>'; set {TOKEN_ENV} to choose it): "
                    f"{deployment.head_token}",
                    flush=True,
                )
            write_run_config(run_config, deployment.head_url)
            print(f"wrote {run_config} (the head server's address); collect your rows with:", flush=True)
            print(
                f"  gym-ray run {run_config} +input_jsonl_fpath=ROWS.jsonl +output_dir=runs/r1",
                flush=True,
            )
            await stop.wait()
            print("stopping", flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _instances(config: Mapping[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    out: list[tuple[str, str, str, dict[str, Any]]] = []
    for name, value in config.items():
        if not isinstance(value, dict) or len(value) != 1:
            continue
        ((server_type, inner),) = value.items()
        if server_type not in keys.SERVER_TYPES or not isinstance(inner, dict) or len(inner) != 1:
            continue
        ((implementation, fields),) = inner.items()
        if fields is None:
            fields = inner[implementation] = {}
        if isinstance(fields, dict):
            out.append((name, server_type, implementation, fields))
    return out


def _instance_fields(config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for inst, _, _, fields in _instances(config):
        if inst == name:
            return fields
    return None


def _instance_names(config: Mapping[str, Any]) -> list[str]:
    return [name for name, _, _, _ in _instances(config)]


def _port_field(fields: Mapping[str, Any], where: str) -> int:
    port = fields.get("port", 0)
    if port is None:
        return 0
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"{where}.port = {port!r} is not a TCP port (0 = any free port)", key=f"{where}.port"
        )
    return port
