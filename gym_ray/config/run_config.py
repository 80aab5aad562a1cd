"""A run's config parsed once: settings, topology and tracing as one immutable, picklable object.

The edge (the CLI, :func:`gym_ray.collect` / :func:`gym_ray.acollect`, :func:`gym_ray.acollect_local`,
:func:`gym_ray.stream`) calls :func:`resolve_run_config` once; everything below it, Ray actors included,
receives the :class:`RunConfig` and never reads the raw config dict again.

Order of resolution: YAML file(s) or a dict, then ``key=value`` overrides, then keyword settings; the run
keys (:mod:`gym_ray.config.strict`), settings and the ``tracing:`` block are checked first (no network
needed, so a typo fails at once), then a config that names a ``head_server`` is laid over the head's
``/global_config_dict_yaml`` (the head's servers are the truth; the run's own settings win).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import OmegaConf

from gym_ray import keys
from gym_ray.config.settings import RunSettings, merge_config, resolve_config
from gym_ray.config.strict import check_run_keys, interpolation_targets
from gym_ray.config.topology import Topology
from gym_ray.config.tracing import TracingSettings
from gym_ray.dispatch.head import fetch_global_config
from gym_ray.errors import ConfigError, UsageError

__all__ = ["ConfigSource", "RunConfig", "merge_run_config", "overlay_on_head", "resolve_run_config"]

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
    """

    settings: RunSettings
    topology: Topology
    tracing: TracingSettings

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> RunConfig:
        """Parse a merged, resolved config dict (no head lookup).

        Raises:
            ConfigError: A bad run setting, tracing block or server block; the message names the key.
        """
        settings = RunSettings.from_config(cfg)
        tracing = TracingSettings.from_config(cfg)
        return cls(settings=settings, topology=Topology.from_config(cfg), tracing=tracing)

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
        merged = merge_config(paths, overrides)
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
) -> RunConfig:
    """Build a run's :class:`RunConfig`; with a ``head_server``, the running deployment's config is the truth.

    Order: the run's own config is checked first (unknown keys, NeMo Gym options gym_ray refuses, run
    settings, the ``tracing:`` block), before any network call. Then, when the config names a
    ``head_server``, its ``/global_config_dict_yaml`` is fetched: the head's server instances are the truth
    (as in NeMo Gym), local server blocks only add instances the head lacks, and a local block that
    disagrees with the head's (type, implementation or a field both define) is an error naming both. The
    run's own non-server keys win over the head's.

    Args:
        config: A config dict, YAML path(s), or an already built :class:`RunConfig` (then ``settings`` are
            applied to it and nothing is fetched).
        overrides: ``key=value`` overrides (YAML paths only).
        settings: Run settings that win over the config.
        client_timeout_s: Seconds to wait for the head server.

    Raises:
        ConfigError: Bad config (before any network call when the run's own keys are at fault), or a local
            server block that conflicts with the head's.
        ServerConnectionError / ServerHTTPError: The head server named by the config cannot be read.
    """
    if isinstance(config, RunConfig):
        return config.with_settings(**settings) if settings else config
    cfg, referenced = _merge(config, overrides=overrides, settings=settings)
    check_run_keys(cfg, referenced)
    # Parsed here, before any network call, so that a typo fails at once; kept when no head is asked.
    settings_parsed = RunSettings.from_config(cfg)
    tracing = TracingSettings.from_config(cfg)
    local = Topology.from_config(cfg)
    own = RunConfig(settings=settings_parsed, topology=local, tracing=tracing)
    if local.head_url is None:
        return own
    if local.head_url.endswith(":0"):
        # Port 0 is a config to serve (`gym-ray serve` picks the ports), not the address of a running head:
        # its own server blocks are the run's (the preflight refuses their port 0 by instance name).
        if local.instances:
            return own
        raise ConfigError(
            "config key 'head_server.port' is 0, which names no running head server; pass the head's real "
            "port (`gym-ray serve CONFIG` prints it and writes gym-ray-run.yaml with it)",
            key="head_server.port",
        )
    remote = await fetch_global_config(local.head_url, timeout_s=client_timeout_s)
    return RunConfig.from_dict(overlay_on_head(remote, cfg))


def overlay_on_head(remote: Mapping[str, Any], local: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config laid over the head's: the head's server instances win, local ones fill gaps.

    Args:
        remote: The head server's published config.
        local: The run's own config.

    Returns:
        The head's keys, then the local keys: local server blocks only for instances the head lacks, every
        other local key as given (run settings win).

    Raises:
        ConfigError: A local server block whose server type or implementation differs from the head's
            instance of the same name, or whose field (other than host/port) has another value there.
    """
    merged = dict(remote)
    for name, value in local.items():
        head_value = remote.get(name)
        if _server_block(value) is None:
            merged[name] = value
        elif head_value is None:
            merged[name] = value
        else:
            _check_agrees(name, value, head_value)
    return merged


def _server_block(value: Any) -> tuple[str, str, Mapping[str, Any]] | None:
    if not isinstance(value, Mapping):
        return None
    types = [k for k in value if k in keys.SERVER_TYPES]
    if len(types) != 1 or not isinstance(value[types[0]], Mapping) or len(value[types[0]]) != 1:
        return None
    implementation, inner = next(iter(value[types[0]].items()))
    return types[0], str(implementation), inner if isinstance(inner, Mapping) else {}


def _check_agrees(name: str, local: Any, head: Any) -> None:
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
    for field, value in mine[2].items():
        if field in ("host", "port") or field not in theirs[2]:
            continue
        if not _agrees(value, theirs[2][field]):
            path = f"{name}.{mine[0]}.{mine[1]}.{field}"
            raise ConfigError(
                f"config key '{path}' is {value!r} in the run's config but {theirs[2][field]!r} on the head "
                "server; the running deployment is the truth: drop the local value or make it agree",
                key=path,
            )


def _agrees(local: Any, head: Any) -> bool:
    """Equal, where a value the head redacted (it hides secrets from clients without its token) agrees
    with whatever the run's config holds there."""
    if head == keys.REDACTED:
        return True
    if isinstance(local, Mapping) and isinstance(head, Mapping):
        return local.keys() == head.keys() and all(_agrees(local[k], head[k]) for k in local)
    if isinstance(local, list) and isinstance(head, list):
        return len(local) == len(head) and all(_agrees(a, b) for a, b in zip(local, head, strict=True))
    return bool(local == head)
