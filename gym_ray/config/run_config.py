"""A run's config parsed once: settings, topology and tracing as one immutable, picklable object.

The edge (the CLI, :func:`gym_ray.collect` / :func:`gym_ray.acollect`, :func:`gym_ray.acollect_local`,
:func:`gym_ray.stream`) calls :func:`resolve_run_config` once; everything below it, Ray actors included,
receives the :class:`RunConfig` and never reads the raw config dict again.

Order of resolution: YAML file(s) or a dict, then ``key=value`` overrides, then keyword settings; the run
settings and the ``tracing:`` block are checked first (no network needed, so a typo fails at once), then a
config that names only ``head_server`` is completed from the head's ``/global_config_dict_yaml`` (the run's
own keys win over the head's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gym_ray.config.settings import RunSettings, load_config
from gym_ray.config.topology import Topology
from gym_ray.config.tracing import TracingSettings
from gym_ray.dispatch.head import fetch_global_config
from gym_ray.errors import UsageError

__all__ = ["ConfigSource", "RunConfig", "merge_run_config", "resolve_run_config"]

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
    overrides = list(overrides)
    if isinstance(config, Mapping):
        if overrides:
            raise UsageError(
                "overrides apply to YAML config files; for a config dict pass settings as keyword "
                "arguments (e.g. output_dir='runs/r1')"
            )
        cfg: dict[str, Any] = json.loads(json.dumps(config))
    else:
        paths = [config] if isinstance(config, str | os.PathLike) else list(config)
        cfg = load_config(paths, overrides)
    for key, value in (settings or {}).items():
        cfg[key] = value
    return cfg


async def resolve_run_config(
    config: ConfigSource | RunConfig,
    *,
    overrides: Iterable[str] = (),
    settings: Mapping[str, Any] | None = None,
    client_timeout_s: float = 30.0,
) -> RunConfig:
    """Build a run's :class:`RunConfig`, fetching the head's config when the run names only a head.

    Args:
        config: A config dict, YAML path(s), or an already built :class:`RunConfig` (then ``settings`` are
            applied to it and nothing is fetched).
        overrides: ``key=value`` overrides (YAML paths only).
        settings: Run settings that win over the config.
        client_timeout_s: Seconds to wait for the head server.

    Raises:
        ConfigError: Bad config (before any network call when the run settings are at fault).
        ServerConnectionError / ServerHTTPError: The head server named by the config cannot be read.
    """
    if isinstance(config, RunConfig):
        return config.with_settings(**settings) if settings else config
    cfg = merge_run_config(config, overrides=overrides, settings=settings)
    RunSettings.from_config(cfg)
    TracingSettings.from_config(cfg)
    local = Topology.from_config(cfg)
    if local.instances or local.head_url is None:
        return RunConfig.from_dict(cfg)
    remote = await fetch_global_config(local.head_url, timeout_s=client_timeout_s)
    return RunConfig.from_dict({**remote, **cfg})
