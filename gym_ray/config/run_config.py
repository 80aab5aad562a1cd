"""A run's config parsed once: settings, topology and tracing as one immutable, picklable object.

The edge (the CLI, :func:`gym_ray.collect` / :func:`gym_ray.acollect`, :func:`gym_ray.acollect_local`,
:func:`gym_ray.stream`) calls :func:`resolve_run_config` once; everything below it, Ray actors included,
receives the :class:`RunConfig` and never reads the raw config dict again.

Order of resolution: YAML file(s) or a dict, then ``key=value`` overrides, then keyword settings; the run
keys (:mod:`gym_ray.config.strict`), settings and the ``tracing:`` block are checked first (no network
needed, so a typo fails at once), then a config that names a ``head_server`` is laid over the head's
``/global_config_dict_yaml`` (the head's servers are the truth; the run's own settings win). As in NeMo
Gym 0.7, a config that names no head server but does not address every server it needs (no server
instance at all, or one without host and port, as in the config given to ``ng_run``) asks the head at
0.7's default address (:data:`DEFAULT_HEAD_PORT` on ``default_host``, else 127.0.0.1).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gym_ray import keys
from gym_ray.config.settings import RunSettings, merge_config, resolve_config
from gym_ray.config.strict import check_run_keys, deployment_keys, interpolation_targets
from gym_ray.config.topology import Topology
from gym_ray.config.tracing import TracingSettings
from gym_ray.dispatch.head import fetch_global_config
from gym_ray.errors import ConfigError, ServerConnectionError, UsageError
from gym_ray.store import is_store_url

__all__ = [
    "DEFAULT_HEAD_HOST",
    "DEFAULT_HEAD_PORT",
    "ConfigSource",
    "RunConfig",
    "merge_run_config",
    "overlay_on_head",
    "resolve_run_config",
]

logger = logging.getLogger(__name__)

#: NeMo Gym 0.7's head server address when a config names none (``DEFAULT_HEAD_SERVER_PORT`` and the
#: ``default_host`` fallback of ``nemo_gym.global_config``).
DEFAULT_HEAD_HOST = "127.0.0.1"
DEFAULT_HEAD_PORT = 11000

#: What a caller may pass as a run's config: a dict, a YAML path, or several YAML paths merged in order.
ConfigSource = Mapping[str, Any] | str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


@dataclass(frozen=True)
class RunConfig:
    """Everything a run reads from its config, checked once.

    Attributes:
        settings: The run knobs (:class:`~gym_ray.config.settings.RunSettings`).
        topology: Servers and routing (:class:`~gym_ray.config.topology.Topology`); ``topology.raw`` is the
            resolved global config (head's config completed with the run's own keys).
        tracing: The ``tracing:`` block with the ``OTEL_*`` environment applied.
        dispatch_deadline_unix_s: The run's dispatch deadline (``time.time()`` seconds), set once when the
            run starts (:meth:`with_dispatch_deadline`) from ``dispatch_budget_s``; every shard of every
            worker stops starting rollouts at this one instant. None: no budget, or not started yet.
        store_url: The run folder's object-store URL (``s3://...``) when ``output_dir`` named one; each
            process then works on a local stage of it (:func:`gym_ray.store.mirror.localize`).
    """

    settings: RunSettings
    topology: Topology
    tracing: TracingSettings
    dispatch_deadline_unix_s: float | None = None
    store_url: str | None = None

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> RunConfig:
        """Parse a merged, resolved config dict (no head lookup).

        Raises:
            ConfigError: A bad run setting, tracing block or server block; the message names the key.
        """
        settings = RunSettings.from_config(cfg)
        tracing = TracingSettings.from_config(cfg)
        store_url = settings.output_dir if is_store_url(settings.output_dir) else None
        topology = Topology.from_config(cfg)
        return cls(settings=settings, topology=topology, tracing=tracing, store_url=store_url)

    @property
    def store_to_open(self) -> bool:
        """True when ``output_dir`` still names the object-store folder itself: the caller opens it
        (:func:`gym_ray.store.mirror.on_store`) and runs on its local copy."""
        return self.store_url is not None and self.settings.output_dir == self.store_url

    def with_share(self, max_resident_tasks: int) -> RunConfig:
        """A copy whose process admits at most ``max_resident_tasks`` rollouts (a worker's part of the
        run's ``num_samples_in_parallel``); nothing is parsed again.

        Raises:
            UsageError: ``max_resident_tasks`` < 1.
        """
        if max_resident_tasks < 1:
            raise UsageError(f"a worker's share of rollouts in flight must be >= 1, got {max_resident_tasks}")
        share = min(max_resident_tasks, self.settings.max_resident_tasks)
        return replace(self, settings=self.settings.model_copy(update={"max_resident_tasks": share}))

    def with_dispatch_deadline(self, now_unix_s: float | None = None) -> RunConfig:
        """A copy that carries the run's dispatch deadline: ``now + dispatch_budget_s``, wall-clock.

        Called once where a run starts; the copy goes to every shard and Ray actor, so the budget is the
        run's, not each shard's. Wall-clock time because actors run in other processes (and on other
        nodes: a multi-node run assumes the nodes' clocks agree, as NTP keeps them, within the margin that
        matters). Unchanged when the run has no budget or a deadline already.
        """
        budget = self.settings.dispatch_budget_s
        if budget is None or self.dispatch_deadline_unix_s is not None:
            return self
        now = time.time() if now_unix_s is None else now_unix_s
        return replace(self, dispatch_deadline_unix_s=now + budget)

    def dispatch_budget_left_s(self) -> float | None:
        """Seconds left before the run's dispatch deadline (>= 0), for one shard's dispatch.

        Without a deadline (a shard run on its own, outside a run), the whole ``dispatch_budget_s``.
        """
        if self.dispatch_deadline_unix_s is None:
            return self.settings.dispatch_budget_s
        return max(0.0, self.dispatch_deadline_unix_s - time.time())

    def with_settings(self, **changes: Any) -> RunConfig:
        """A copy with top-level ``changes`` applied to the config it was built from, checked again."""
        return RunConfig.from_dict({**self.topology.raw, **changes})


def merge_run_config(
    config: ConfigSource,
    *,
    overrides: Iterable[str] = (),
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The merged global config of a run as a plain dict: file(s) or a dict, overrides, keyword settings.

    Args:
        config: A config dict, a YAML path, or several YAML paths merged in order.
        overrides: ``key=value`` / ``+key=value`` / ``++key=value`` (YAML paths only).
        settings: Top-level run settings (``output_dir``, ``num_repeats``, ...) that win over the config.

    Returns:
        A plain dict (a copy: the caller's dict is never mutated).

    Raises:
        ConfigError: A file, override or interpolation problem (see :func:`load_config`).
        UsageError: Overrides given with a config dict.
    """
    return _merge(config, overrides=overrides, settings=settings)[0]


def _merge(
    config: ConfigSource,
    *,
    overrides: Iterable[str] = (),
    settings: Mapping[str, Any] | None = None,
    env_file: str | os.PathLike[str] | None = None,
) -> tuple[dict[str, Any], set[str]]:
    """The merged config and the top-level keys its interpolations refer to."""
    overrides = list(overrides)
    if isinstance(config, Mapping):
        if overrides:
            raise UsageError(
                "overrides apply to YAML config files; for a config dict pass settings as keyword "
                "arguments (e.g. output_dir='runs/r1')"
            )
        cfg: dict[str, Any] = json.loads(json.dumps(config))
        referenced = interpolation_targets(cfg)
    else:
        paths = [config] if isinstance(config, str | os.PathLike) else list(config)
        merged = merge_config(paths, overrides, env_file=env_file)
        referenced = interpolation_targets(OmegaConf.to_container(merged, resolve=False))
        cfg = resolve_config(merged)
    for key, value in (settings or {}).items():
        cfg[key] = value
    return cfg, referenced


async def resolve_run_config(
    config: ConfigSource | RunConfig,
    *,
    overrides: Iterable[str] = (),
    settings: Mapping[str, Any] | None = None,
    client_timeout_s: float = 30.0,
    env_file: str | os.PathLike[str] | None = None,
) -> RunConfig:
    """Build a run's :class:`RunConfig`; with a ``head_server``, the running deployment's config is the truth.

    Order: the run's own config is checked first (unknown keys, NeMo Gym options gym_ray refuses, run
    settings, the ``tracing:`` block, the run's own server blocks), before any network call; NeMo Gym
    deployment keys it sets are named in one warning. Then, when the config names a ``head_server`` (a
    missing host or port takes 0.7's default), or names none but does not address every server it needs
    (then the head is asked at 0.7's default address, :data:`DEFAULT_HEAD_HOST`:
    :data:`DEFAULT_HEAD_PORT`), its ``/global_config_dict_yaml`` is fetched: the head's server instances
    are the truth (as in NeMo Gym), local server blocks only add instances the head lacks, a local block
    that disagrees with the head's (type, implementation or a field both define, compared resolved) is an
    error naming both, and the routing keys are checked against the merged servers. The run's own
    non-server keys win over the head's.

    Args:
        config: A config dict, YAML path(s), or an already built :class:`RunConfig` (then ``settings`` are
            applied to it and nothing is fetched).
        overrides: ``key=value`` overrides (YAML paths only).
        settings: Run settings that win over the config.
        client_timeout_s: Seconds to wait for the head server.
        env_file: NeMo Gym's ``env.yaml`` (YAML paths only), merged over the ``config_paths`` files and
            under the YAML paths and overrides, as 0.7 merges it (``gym-ray run`` passes the one it finds).

    Raises:
        ConfigError: Bad config (before any network call when the run's own keys are at fault), a local
            server block that conflicts with the head's, a routing key naming no merged environment server,
            or no head server answering at the default address when the config names none.
        ServerConnectionError / ServerHTTPError: The head server named by the config cannot be read.
    """
    if isinstance(config, RunConfig):
        return config.with_settings(**settings) if settings else config
    cfg, referenced = _merge(config, overrides=overrides, settings=settings, env_file=env_file)
    check_run_keys(cfg, referenced)
    # Parsed here, before any network call, so that a typo fails at once; kept when no head is asked.
    settings_parsed = RunSettings.from_config(cfg)
    tracing = TracingSettings.from_config(cfg)
    _complete_head_address(cfg)
    by_default = False
    local = Topology.from_config(cfg, partial=True)
    if local.head_url is None and not _addresses_its_servers(local):
        cfg[keys.HEAD_SERVER] = _default_head(cfg)
        by_default = True
        local = Topology.from_config(cfg, partial=True)
    unused = deployment_keys(cfg, referenced)
    if unused:
        logger.warning(
            "NeMo Gym deployment keys, not used by collection (they configure ng_run's servers): %s",
            ", ".join(unused),
        )
    if local.head_url is None or (local.head_url.endswith(":0") and local.instances):
        # No head: the config is the whole topology. Port 0 is a config to serve (`gym-ray serve` picks
        # the ports), not the address of a running head: its own server blocks are the run's (the
        # preflight refuses their port 0 by instance name).
        return RunConfig(settings=settings_parsed, topology=Topology.from_config(cfg), tracing=tracing)
    if local.head_url.endswith(":0"):
        raise ConfigError(
            "config key 'head_server.port' is 0, which names no running head server; pass the head's real "
            "port (`gym-ray serve CONFIG` prints it and writes gym-ray-run.yaml with it)",
            key="head_server.port",
        )
    try:
        remote = await fetch_global_config(local.head_url, timeout_s=client_timeout_s)
    except ServerConnectionError as exc:
        if not by_default:
            raise
        address = local.head_url.removeprefix("http://")
        raise ConfigError(
            f"no head server answers at {address}, NeMo Gym's default head address (the config names no "
            "head_server and does not give every server's host and port); pass +head_server.host=... "
            "+head_server.port=... or a config naming the head (head_server: {host: ..., port: ...})",
            key=keys.HEAD_SERVER,
        ) from exc
    return RunConfig.from_dict(overlay_on_head(remote, cfg))


def _addresses_its_servers(topology: Topology) -> bool:
    """True when the config has server instances and every one has a host and port (no head needed)."""
    instances = topology.instances.values()
    return bool(instances) and all(i.host is not None and i.port is not None for i in instances)


def _default_head(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """NeMo Gym 0.7's head address for a config that names none: ``default_host`` (this host's IP with
    ``use_absolute_ip``), else 127.0.0.1, and port 11000."""
    return {"host": _default_host(cfg), "port": DEFAULT_HEAD_PORT}


def _default_host(cfg: Mapping[str, Any]) -> str:
    if cfg.get("use_absolute_ip"):
        return socket.gethostbyname(socket.gethostname())
    host = cfg.get("default_host")
    return host if isinstance(host, str) and host else DEFAULT_HEAD_HOST


def _complete_head_address(cfg: dict[str, Any]) -> None:
    """Fill a ``head_server`` block's missing host or port with 0.7's defaults, one key at a time (so
    ``+head_server.port=12000`` alone means 127.0.0.1:12000)."""
    head = cfg.get(keys.HEAD_SERVER)
    if not isinstance(head, Mapping):
        return
    filled = dict(head)
    if filled.get("host") is None:
        filled["host"] = _default_host(cfg)
    if filled.get("port") is None:
        filled["port"] = DEFAULT_HEAD_PORT
    cfg[keys.HEAD_SERVER] = filled


def overlay_on_head(remote: Mapping[str, Any], local: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config laid over the head's: the head's server instances win, local ones fill gaps.

    Args:
        remote: The head server's published config.
        local: The run's own config.

    Returns:
        The head's keys, then the local keys: local server blocks only for instances the head lacks, every
        other local key as given (run settings win).

    Values are compared resolved: an interpolation (``openai_base_url: ${policy_base_url}`` in the head's
    published text) is resolved against its own side's config first, and one that cannot be resolved here
    (an unset environment variable, a resolver only NeMo Gym registers) agrees with any value.

    Raises:
        ConfigError: A local server block whose server type or implementation differs from the head's
            instance of the same name, or whose field (other than host/port) has another value there.
    """
    merged = dict(remote)
    head_view: dict[str, Any] | None = None
    local_view: dict[str, Any] | None = None
    for name, value in local.items():
        head_value = remote.get(name)
        if _server_block(value) is None:
            merged[name] = value
        elif head_value is None:
            merged[name] = value
        else:
            if head_view is None or local_view is None:
                head_view, local_view = _resolved(remote), _resolved(local)
            _check_agrees(name, value, head_value, local_view.get(name), head_view.get(name))
    return merged


class _Unresolved:
    """A value whose interpolation cannot be resolved here; it agrees with any value."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return repr(self.text)


def _resolved(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every interpolation resolved against ``config`` where that can be done here."""
    try:
        node = OmegaConf.create(dict(config))
    except (OmegaConfBaseException, ValueError, TypeError):
        result: dict[str, Any] = _marked(config)  # e.g. text that is not interpolation grammar
        return result
    return {key: _read(node, key, config[key]) for key in config}


def _read(parent: DictConfig | ListConfig, key: Any, raw: Any) -> Any:
    """``parent[key]`` resolved (recursively), or :class:`_Unresolved` where resolution fails."""
    try:
        value = parent[key]
    except (OmegaConfBaseException, ValueError, KeyError, TypeError):
        return _Unresolved(str(raw))
    if isinstance(value, DictConfig):
        inner = raw if isinstance(raw, Mapping) else {}
        return {k: _read(value, k, inner.get(k)) for k in value}
    if isinstance(value, ListConfig):
        items = raw if isinstance(raw, list) and len(raw) == len(value) else [None] * len(value)
        return [_read(value, i, items[i]) for i in range(len(value))]
    return value


def _marked(value: Any) -> Any:
    """``value`` with every string holding an interpolation marked :class:`_Unresolved`."""
    if isinstance(value, Mapping):
        return {k: _marked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v) for v in value]
    if isinstance(value, str) and "${" in value:
        return _Unresolved(value)
    return value


def _server_block(value: Any) -> tuple[str, str, Mapping[str, Any]] | None:
    if not isinstance(value, Mapping):
        return None
    types = [k for k in value if k in keys.SERVER_TYPES]
    if len(types) != 1 or not isinstance(value[types[0]], Mapping) or len(value[types[0]]) != 1:
        return None
    implementation, inner = next(iter(value[types[0]].items()))
    return types[0], str(implementation), inner if isinstance(inner, Mapping) else {}


def _check_agrees(name: str, local: Any, head: Any, local_resolved: Any, head_resolved: Any) -> None:
    mine, theirs = _server_block(local), _server_block(head)
    if theirs is None or mine is None:
        raise ConfigError(
            f"config key '{name}' is a server block in the run's config but not in the head server's running "
            "config; the running deployment is the truth about servers: drop the local block or rename it",
            key=name,
        )
    if mine[:2] != theirs[:2]:
        raise ConfigError(
            f"server instance '{name}' is {mine[0]}.{mine[1]} in the run's config but "
            f"{theirs[0]}.{theirs[1]} on the head server; the running deployment is the truth: drop the "
            "local block or make it agree",
            key=name,
        )
    mine_resolved, theirs_resolved = _server_block(local_resolved), _server_block(head_resolved)
    mine_fields = mine_resolved[2] if mine_resolved is not None else mine[2]
    theirs_fields = theirs_resolved[2] if theirs_resolved is not None else theirs[2]
    for field, value in mine_fields.items():
        if field in ("host", "port") or field not in theirs_fields:
            continue
        if not _agrees(value, theirs_fields[field]):
            path = f"{name}.{mine[0]}.{mine[1]}.{field}"
            text = theirs[2].get(field)
            written = f" ({text!r} there)" if text != theirs_fields[field] else ""
            raise ConfigError(
                f"config key '{path}' is {value!r} in the run's config but {theirs_fields[field]!r} on the "
                f"head server{written}; the running deployment is the truth: drop the local value or make "
                "it agree",
                key=path,
            )


def _agrees(local: Any, head: Any) -> bool:
    """Equal, where a value the head redacted (it hides secrets from clients without its token), and a
    value that cannot be resolved here on either side, agree with anything."""
    if head == keys.REDACTED or isinstance(head, _Unresolved) or isinstance(local, _Unresolved):
        return True
    if isinstance(local, Mapping) and isinstance(head, Mapping):
        return local.keys() == head.keys() and all(_agrees(local[k], head[k]) for k in local)
    if isinstance(local, list) and isinstance(head, list):
        return len(local) == len(head) and all(_agrees(a, b) for a, b in zip(local, head, strict=True))
    return bool(local == head)
