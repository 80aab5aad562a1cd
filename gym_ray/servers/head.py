"""The head server: publishes a deployment's global config and its server instances.

Routes: ``GET /global_config_dict_yaml`` (a JSON *string* whose text is the YAML of the config, the
NeMo Gym wire quirk; secret-looking values are redacted unless the request presents the head's token as
``Authorization: Bearer <token>``, see :mod:`gym_ray.servers.redaction`), ``GET /server_instances`` (a
list of ``{name, server_type, implementation, host, port, url, pid, process_name, start_time}``),
``GET /``, ``/livez`` (always ok) and ``/readyz``,
``/healthz``, ``/health`` (503 ``{"status": "starting"}`` until ``mark_ready()``).

Concurrency: mutated (``set_config``, ``mark_ready``) on the loop that serves it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from aiohttp import web

from gym_ray import keys
from gym_ray.servers import _web
from gym_ray.servers.redaction import DEFAULT_SECRET_PATTERNS, bearer_matches, redact


def config_yaml(config: Mapping[str, Any]) -> str:
    """The YAML text of ``config`` (key order kept) that ``/global_config_dict_yaml`` JSON-encodes."""
    return yaml.safe_dump(_plain(config), sort_keys=False, allow_unicode=True)


def server_instances(
    config: Mapping[str, Any], *, pid: int | None = None, start_time: float | None = None
) -> list[dict[str, Any]]:
    """One display dict per server instance of ``config`` (a top-level key with one server-type block)."""
    out: list[dict[str, Any]] = []
    started = time.time() if start_time is None else start_time
    for name, value in config.items():
        if not isinstance(value, Mapping) or len(value) != 1:
            continue
        ((server_type, inner),) = value.items()
        if server_type not in keys.SERVER_TYPES or not isinstance(inner, Mapping) or len(inner) != 1:
            continue
        ((implementation, fields),) = inner.items()
        if not isinstance(fields, Mapping):
            continue
        host, port = fields.get("host"), fields.get("port")
        out.append(
            {
                "process_name": name,
                "name": name,
                "server_type": server_type,
                "implementation": implementation,
                "host": host,
                "port": port,
                "url": f"http://{host}:{port}" if host is not None and port is not None else None,
                "pid": os.getpid() if pid is None else pid,
                "start_time": started,
            }
        )
    return out


class HeadServer:
    """Serves one config. Not ready until ``mark_ready()``.

    Args:
        config: the config to publish (``set_config`` replaces it).
        token: the token a client presents (``Authorization: Bearer <token>``) to see secret values;
            None: secret values are always redacted.
        secret_patterns: key patterns whose values are secret (see :mod:`gym_ray.servers.redaction`).
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        token: str | None = None,
        secret_patterns: Iterable[str] = DEFAULT_SECRET_PATTERNS,
    ) -> None:
        self.token = token
        self._patterns = tuple(secret_patterns)
        self._config: dict[str, Any] = dict(config or {})
        self._yaml = config_yaml(self._config)
        self._public_yaml = config_yaml(redact(self._config, self._patterns))
        self._ready = False
        self._start_time = time.time()

    @property
    def ready(self) -> bool:
        """True once ``mark_ready()`` was called."""
        return self._ready

    def set_config(self, config: Mapping[str, Any]) -> None:
        """Publish ``config`` (the YAML text is rendered once, here)."""
        self._config = dict(config)
        self._yaml = config_yaml(self._config)
        self._public_yaml = config_yaml(redact(self._config, self._patterns))

    def mark_ready(self) -> None:
        """Make ``/readyz`` answer 200."""
        self._ready = True

    def make_app(self) -> web.Application:
        """A fresh aiohttp application serving this head."""
        app = web.Application()
        _web.add_health_routes(app, is_ready=lambda: self._ready)
        app.router.add_get("/global_config_dict_yaml", self._handle_config)
        app.router.add_get("/server_instances", self._handle_instances)
        return app

    async def _handle_config(self, request: web.Request) -> web.Response:
        if bearer_matches(request.headers.get("Authorization"), self.token):
            return web.json_response(self._yaml)
        return web.json_response(self._public_yaml)

    async def _handle_instances(self, request: web.Request) -> web.Response:
        return web.json_response(server_instances(self._config, start_time=self._start_time))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
