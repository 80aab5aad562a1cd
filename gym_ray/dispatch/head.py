"""The head server: fetch the merged global config it publishes and build a client for its servers.

``fetch_global_config`` reads ``GET /global_config_dict_yaml``; ``setup_server_client`` returns that config
with a :class:`~gym_ray.dispatch.client.ServerClient`; :class:`HeadClientCache` keeps one client per head
server
while its config stays the same. All of this is re-exported by :mod:`gym_ray.dispatch.client`.

Concurrency: a :class:`HeadClientCache` serialises its :meth:`~HeadClientCache.get` calls with an
``asyncio.Lock`` and is used from one event loop; the client it hands out is owned by the cache and closed
when the config changes.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import aiohttp
import yaml

from gym_ray.config.topology import Topology
from gym_ray.dispatch._http import CONNECT_ERRORS, connection_error, excerpt_of
from gym_ray.dispatch.client import ServerClient
from gym_ray.errors import ServerConnectionError, ServerHTTPError, ServerResponseError, UsageError

__all__ = [
    "GLOBAL_CONFIG_PATH",
    "ClientFactory",
    "HeadAddress",
    "HeadClientCache",
    "client_from_config",
    "fetch_global_config",
    "head_url_of",
    "setup_server_client",
]

GLOBAL_CONFIG_PATH = "/global_config_dict_yaml"
_HEAD_HINT = "is `gym-ray serve` / the NeMo Gym head running?"


async def fetch_global_config(
    head_url: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Fetch the merged global config a head server publishes (``GET /global_config_dict_yaml``).

    The reply is a JSON string whose text is YAML: it is JSON-decoded, then ``yaml.safe_load``-ed.

    Args:
        head_url: ``"http://host:port"`` of the head server.
        session: an open session to use; a short-lived one is made when None.
        timeout_s: limit for the whole request. No retries.

    Returns:
        The config as a plain dict.

    Raises:
        ServerConnectionError: the head server is unreachable or does not answer in time.
        ServerHTTPError: it answered an error status.
        ServerResponseError: the reply is not a JSON string of a YAML mapping.
    """
    url = head_url.rstrip("/") + GLOBAL_CONFIG_PATH
    if session is None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as own:
            return await fetch_global_config(head_url, session=own, timeout_s=timeout_s)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            payload = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        kind = (
            "connect"
            if isinstance(exc, CONNECT_ERRORS)
            else "timeout"
            if isinstance(exc, TimeoutError)
            else ""
        )
        cause = connection_error(kind, url, 1, exc, timeout_s)
        raise ServerConnectionError(f"head server at {head_url}: {cause}; {_HEAD_HINT}", url=url) from exc
    excerpt = excerpt_of(payload)
    if status != 200:
        raise ServerHTTPError(
            f"GET {url} answered HTTP {status}: {excerpt[:200]!r}; is {head_url} a NeMo Gym head server?",
            url=url,
            status=status,
            body_excerpt=excerpt,
        )
    config: Any = None
    try:
        text = json.loads(payload)
        if not isinstance(text, str):
            problem = f"a JSON {type(text).__name__}, expected a JSON string holding YAML"
        else:
            config = yaml.safe_load(text)
            problem = f"YAML holding a {type(config).__name__}, expected the global config mapping"
    except (ValueError, yaml.YAMLError) as exc:
        what = "text that is not valid YAML" if isinstance(exc, yaml.YAMLError) else "a body that is not JSON"
        raise ServerResponseError(
            f"GET {url} answered {what}: {exc}", url=url, status=status, body_excerpt=excerpt
        ) from exc
    if not isinstance(config, dict):
        raise ServerResponseError(
            f"GET {url} answered {problem}: {excerpt[:200]!r}", url=url, status=status, body_excerpt=excerpt
        )
    return config


ClientFactory = Callable[[dict[str, Any]], ServerClient]


def client_from_config(config: dict[str, Any]) -> ServerClient:
    """Default :data:`ClientFactory`: a :class:`ServerClient` with default limits over the config's topology.

    Raises:
        ConfigError: the config is not a valid topology.
    """
    return ServerClient(Topology.from_config(config))


class HeadClientCache:
    """Keeps one :class:`ServerClient` for one head server while its config stays the same.

    Every :meth:`get` fetches the config again and compares it with the cached one; when it differs (or the
    head URL changed) a new client is built and the old one is closed, so callers must not keep a client
    across :meth:`get` calls. Use it from one event loop.

    Args:
        client_factory: builds a client from a fetched config (default :func:`client_from_config`).
    """

    def __init__(self, *, client_factory: ClientFactory | None = None) -> None:
        self._factory = client_factory or client_from_config
        self._head_url: str | None = None
        self._config: dict[str, Any] | None = None
        self._client: ServerClient | None = None
        self._lock = asyncio.Lock()

    async def get(self, head_url: str, *, timeout_s: float = 30.0) -> tuple[dict[str, Any], ServerClient]:
        """The head's current config and a client for it (the cached one when the config is unchanged).

        Raises:
            ServerConnectionError, ServerHTTPError, ServerResponseError: as :func:`fetch_global_config`.
            ConfigError: the config is not a valid topology.
        """
        async with self._lock:
            config = await fetch_global_config(head_url, timeout_s=timeout_s)
            client = self._client
            if client is not None and self._head_url == head_url and self._config == config:
                return config, client
            new_client = self._factory(config)
            self._head_url, self._config, self._client = head_url, copy.deepcopy(config), new_client
            if client is not None:
                await client.aclose()
            return config, new_client

    async def aclose(self) -> None:
        """Close the cached client, if any. The cache stays usable (the next :meth:`get` builds anew)."""
        client, self._client, self._config, self._head_url = self._client, None, None, None
        if client is not None:
            await client.aclose()


async def setup_server_client(
    head_url: str,
    *,
    cache: bool = False,
    helper_cache: HeadClientCache | None = None,
    client_factory: ClientFactory | None = None,
    timeout_s: float = 30.0,
) -> tuple[dict[str, Any], ServerClient]:
    """Fetch the head's global config and return it with a client for its servers.

    Without ``cache`` every call fetches the config and builds a new client that the caller owns (and must
    ``aclose()``). With ``cache=True`` the client is kept in ``helper_cache`` (which owns it) and rebuilt
    only when the fetched config differs from the cached one.

    Args:
        head_url: ``"http://host:port"`` of the head server.
        cache: opt in to reusing the client held by ``helper_cache``.
        helper_cache: the cache to use; required with ``cache=True``.
        client_factory: builds the client when not cached (default :func:`client_from_config`).
        timeout_s: limit for the config fetch.

    Returns:
        ``(global config dict, ServerClient)``.

    Raises:
        UsageError: ``cache=True`` without ``helper_cache``.
        ServerConnectionError, ServerHTTPError, ServerResponseError: as :func:`fetch_global_config`.
    """
    if cache:
        if helper_cache is None:
            raise UsageError(
                "setup_server_client(cache=True) needs helper_cache=HeadClientCache(); the cache owns the "
                "client and closes it when the config changes"
            )
        return await helper_cache.get(head_url, timeout_s=timeout_s)
    config = await fetch_global_config(head_url, timeout_s=timeout_s)
    return config, (client_factory or client_from_config)(config)


@runtime_checkable
class HeadAddress(Protocol):
    """Anything with ``host`` and ``port`` attributes (NeMo Gym's ``BaseServerConfig``): a head server."""

    host: str
    port: int


_ADDRESS_KEYS = frozenset({"host", "port"})


def head_url_of(value: Any) -> str | None:
    """The head URL a ``head_server_config`` names, or None when it is a whole config / Topology.

    A URL string, a ``{host, port}`` mapping (no other keys) and any object with ``host`` and ``port``
    attributes (NeMo Gym's ``BaseServerConfig``) all mean "fetch the config from this head server".
    """
    if isinstance(value, str):
        return value.rstrip("/")
    if isinstance(value, Topology):
        return None
    if isinstance(value, Mapping):
        if value and set(value) <= _ADDRESS_KEYS:
            host, port = value.get("host"), value.get("port")
            if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
                raise UsageError(
                    f"head_server_config={dict(value)!r} looks like a head address but needs both host (a "
                    "string) and port (an int), e.g. {'host': '127.0.0.1', 'port': 11000}"
                )
            return f"http://{host}:{port}"
        return None
    host, port = getattr(value, "host", None), getattr(value, "port", None)
    if isinstance(host, str) and host and isinstance(port, int) and not isinstance(port, bool):
        return f"http://{host}:{port}"
    raise UsageError(
        f"head_server_config={value!r} is a {type(value).__name__}; pass a head URL ('http://host:port'), "
        "a {host, port} mapping or an object with host and port attributes (a head server), a global "
        "config dict or a Topology"
    )
