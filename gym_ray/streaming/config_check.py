"""What a stream refuses in its config: run settings it has its own options for, or does not use.

``gym_ray.stream`` takes a running config for its servers. It reads three run settings from it as
``gym-ray run`` does (:data:`STREAM_READS`: ``strict_json``, ``server_outage_timeout_s``,
``max_infra_retries``). The others (``num_repeats``, ``output_dir``, ``request_timeout_s``, ...) each have
a :func:`gym_ray.stream` option of their own, or mean nothing for a stream: rather than ignore them, the
stream refuses a config that sets one, naming the key and what to pass instead.
"""

from __future__ import annotations

from gym_ray.config.run_config import RunConfig
from gym_ray.config.settings import RunSettings
from gym_ray.config.tracing import TracingSettings
from gym_ray.errors import ConfigError

__all__ = ["STREAM_OPTION_FOR", "STREAM_READS", "check_stream_config"]

#: Run settings a stream reads from its config, as ``gym-ray run`` does.
STREAM_READS: frozenset[str] = frozenset({"strict_json", "server_outage_timeout_s", "max_infra_retries"})

#: Run setting -> the ``gym_ray.stream`` option that does its job (settings absent here have none).
STREAM_OPTION_FOR: dict[str, str] = {
    "num_repeats": "group_size",
    "max_resident_tasks": "max_in_flight",
    "max_resident_rollout_tasks": "max_in_flight",
    "num_samples_in_parallel": "max_in_flight",
    "max_connections": "max_in_flight",
    "request_timeout_s": "timeout_s",
    "output_dir": "record_dir",
    "output_jsonl_fpath": "record_dir",
    "retry_requests": "retry_requests",
    "num_workers": "num_workers",
    "input_jsonl_fpath": "rows",
    "max_rollout_attempts": "max_rollout_attempts",
}


def check_stream_config(run: RunConfig) -> None:
    """Refuse run settings and a ``tracing:`` block in a stream's config (they would be ignored).

    Args:
        run: The stream's resolved config.

    Raises:
        ConfigError: The config sets a run setting or enables tracing; the message names every such key
            and the :func:`gym_ray.stream` option to use instead, if there is one.
    """
    defaults = RunSettings.model_validate({})
    settings = run.settings
    # max_connections is derived from max_resident_tasks when not given: only a value of its own counts.
    given = sorted(
        name
        for name in settings.model_fields_set - STREAM_READS
        if name != "max_connections" or getattr(settings, name) != getattr(defaults, name)
    )
    if given:
        hints = "; ".join(
            f"{name}: pass {STREAM_OPTION_FOR[name]}=... to gym_ray.stream"
            if name in STREAM_OPTION_FOR
            else f"{name}: a stream does not use it"
            for name in given
        )
        raise ConfigError(
            f"stream: the config sets run setting(s) {', '.join(given)}, which a stream does not read "
            f"({hints}); remove them from the config given to gym_ray.stream",
            key=given[0],
        )
    if run.tracing != TracingSettings():
        raise ConfigError(
            "stream: the config has a tracing: block, but streams do not trace or export metrics yet; "
            "remove it from the config given to gym_ray.stream",
            key="tracing",
        )
