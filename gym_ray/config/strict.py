"""Strict run config: every top-level key is known, and every NeMo Gym 0.7 option is honoured or refused.

A run's own config (YAML files, overrides, keyword settings; not the head server's published config) may
hold only:

- a run setting (a :class:`~gym_ray.config.settings.RunSettings` field),
- a server instance block (a mapping holding a server-type key such as ``responses_api_agents``),
- a structural key (``head_server``, ``tracing``, ``config_paths``, the routing keys, ``default_host``),
- a NeMo Gym deployment key (:data:`DEPLOYMENT_KEYS`: ``uv_venv_dir``, ``results_dir``, ``policy_*``, ...),
  accepted so that the config given to ``ng_run`` runs here as it is, and named as unused,
- a key that an interpolation (``${key}``) refers to.

Anything else is refused before anything starts, with the closest known name and where settings are
documented: a typo such as ``+num_repeat=3`` must not run with one repeat. NeMo Gym 0.7 collector options
that gym_ray does not implement are refused with a message that says what to use instead
(:data:`REFUSED_OPTIONS`); options that mean nothing in one configuration (``environment_server_name``
outside ``legacy`` mode, ``agent_name`` in ``legacy`` mode) are refused too, where 0.7 ignores them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gym_ray import keys
from gym_ray.config._parse import did_you_mean
from gym_ray.config.settings import CONFIG_PATHS, RunSettings
from gym_ray.errors import ConfigError

__all__ = [
    "DEPLOYMENT_KEYS",
    "DOCS",
    "REFUSED_OPTIONS",
    "STRUCTURAL_KEYS",
    "check_run_keys",
    "deployment_keys",
    "interpolation_targets",
]

#: Where the settings are documented (named in every refusal).
DOCS = "docs/nemo-gym.md (NeMo Gym options) and gym_ray.config.settings.RunSettings (every setting)"

#: Top-level keys that are neither settings nor server instances but have a meaning.
STRUCTURAL_KEYS = frozenset(
    {
        keys.HEAD_SERVER,
        "tracing",
        CONFIG_PATHS,
        keys.ENVIRONMENT_SERVER_ROUTES,
        keys.ENVIRONMENT_ROUTING_MODE,
        keys.ENVIRONMENT_SERVER_NAME,
        keys.ALLOW_UNSUPPORTED_PAIRING,
        # NeMo Gym 0.7's default head host (default_host, else 127.0.0.1; use_absolute_ip: this host's IP).
        "default_host",
        "use_absolute_ip",
    }
)

#: Top-level keys of a NeMo Gym 0.7 deployment config (what ``ng_run`` / ``gym env start`` reads: its
#: reserved keys in ``nemo_gym.global_config``, the ``policy_*`` values model blocks interpolate, and the
#: server-process settings its servers validate from the global config). They configure the servers, their
#: venvs and ports, not rollout collection, so a run accepts them and names them in one line as unused.
DEPLOYMENT_KEYS = frozenset(
    {
        # nemo_gym.global_config.NEMO_GYM_RESERVED_TOP_LEVEL_KEYS (those without a meaning here)
        "entrypoint",
        "disallowed_ports",
        "head_server_deps",
        "python_version",
        "pip_install_verbose",
        "uv_pip_set_python",
        "skip_venv_if_present",
        "hf_token",
        "ray_head_node_address",
        "port_range_low",
        "port_range_high",
        "dry_run",
        "server_spinup_timeout_seconds",
        "model_endpoint_readiness_timeout_seconds",
        "allow_openai_version_skew",
        "uv_cache_dir",
        "uv_lock_timeout_seconds",
        "uv_venv_dir",
        "results_dir",
        "cache_dir",
        "nemo_gym_log_dir",
        "verbose",
        "json",
        "query",
        "component_name",
        "model_call_capture_dir",
        "skip_verification",
        "skip_verification_reward",
        # the model endpoint, interpolated into the policy model's block
        "policy_base_url",
        "policy_api_key",
        "policy_model_name",
        # config validation and server processes (read from the global config by ng_run and its servers)
        "error_on_almost_servers",
        "error_on_agent_without_environment_server",
        "uvicorn_timeout_worker_healthcheck",
        "uvicorn_logging_show_200_ok",
        "uvicorn_proxy_headers",
        "uvicorn_forwarded_allow_ips",
        "profiling_enabled",
        "profiling_results_dirpath",
        "global_aiohttp_connector_limit",
        "global_aiohttp_connector_limit_per_host",
        "global_aiohttp_intended_concurrency",
        "global_aiohttp_intended_concurrency_per_host",
        "global_aiohttp_client_request_debug",
        "global_aiohttp_tcp_keepalive_idle_seconds",
        "global_aiohttp_tcp_keepalive_interval_seconds",
        "global_aiohttp_tcp_keepalive_probes",
    }
)

_ZEROS = (
    "gym_ray scores only persisted successes and does not impute zero rewards; failed rollouts are listed "
    "in <stem>_failures.jsonl and missing ones are reported by `gym-ray status`; to score them as zero, run "
    "NeMo Gym's aggregation on the output"
)


def _truthy(value: Any) -> bool:
    return bool(value)


def _enabled_block(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value.get("enabled"))


#: NeMo Gym 0.7 option -> (refused when this is true of its value, what to use instead).
REFUSED_OPTIONS: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "prompt_config": (
        lambda v: v is not None,
        "gym_ray sends rows as they are; render the prompt template into responses_create_params.input "
        "when you write the input file",
    ),
    "skills": (lambda v: v is not None, "gym_ray does not load skills; stamp skills_ref on the input rows"),
    "count_failure_classes_as_zero": (_truthy, _ZEROS),
    "count_missing_rollouts_as_zero": (_truthy, _ZEROS),
    "rollout_collection_driver": (
        lambda v: v is not None,
        "NeMo Gym's ng_collect_rollouts ignores it too (serve path only); gym_ray has no pluggable driver; "
        "drop the key",
    ),
    "dispatch_longest_first": (
        _truthy,
        "gym_ray dispatches in planned order; split long tasks into their own input file to run them first",
    ),
    "retry_terminal_timeouts": (
        _truthy,
        "gym_ray never retries a terminal failure; move the rows to a new input file to run them again",
    ),
    "retry_invalid_judge_responses": (
        _truthy,
        "gym_ray does not migrate judged rows; filter invalid_judge_response rows into a new input file",
    ),
    "upload_rollouts_to_wandb": (
        _truthy,
        "gym_ray has no exporters (NeMo Gym's CLI ignores this alias too); upload the output files yourself",
    ),
    # Deployment keys that would change what 0.7's collector writes when they ask for something.
    "observability_enabled": (
        _truthy,
        "gym-ray run does not fold model-call captures into the rollouts (ng_model_call_capture); "
        "RolloutCollectionHelper.run_examples does, from the head server's config",
    ),
    "token_id_capture": (_enabled_block, "gym_ray does not capture training token ids; drop the block"),
    "telemetry": (
        _enabled_block,
        "gym_ray traces with its own tracing: block (OpenTelemetry); set tracing: {enabled: true, ...}",
    ),
}

_INTERPOLATION = re.compile(r"\$\{([^{}]*)\}")


def interpolation_targets(value: Any) -> set[str]:
    """Top-level keys that ``${...}`` interpolations anywhere in an unresolved config refer to.

    ``${a.b}`` refers to ``a``; ``${oc.select:a.b,default}`` to ``a``; resolvers such as ``${oc.env:X}``
    refer to no key.
    """
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, str) and "${" in item:
            for expr in _INTERPOLATION.findall(item):
                expr = expr.strip()
                if expr.startswith("oc.select:"):
                    expr = expr.removeprefix("oc.select:").split(",", 1)[0]
                elif ":" in expr:
                    continue
                head = expr.lstrip(".").split(".", 1)[0].split("[", 1)[0]
                if head:
                    found.add(head)
    return found


def _is_instance_block(value: Any) -> bool:
    return isinstance(value, Mapping) and any(k in keys.SERVER_TYPES for k in value)


def known_keys() -> set[str]:
    """Every top-level name the run config accepts by name (settings, structural and deployment keys)."""
    return set(RunSettings.model_fields) | set(STRUCTURAL_KEYS) | set(DEPLOYMENT_KEYS)


def deployment_keys(cfg: Mapping[str, Any], referenced: Iterable[str] = ()) -> tuple[str, ...]:
    """The NeMo Gym deployment keys (:data:`DEPLOYMENT_KEYS`) a run's config sets and collection does not
    use, sorted: an interpolation target (``policy_base_url`` in ``${policy_base_url}``) is used.

    Args:
        cfg: The run's own merged config.
        referenced: Top-level keys that interpolations refer to.
    """
    refs = set(referenced)
    return tuple(sorted(str(k) for k in cfg if k in DEPLOYMENT_KEYS and k not in refs))


def check_run_keys(cfg: Mapping[str, Any], referenced: Iterable[str] = ()) -> None:
    """Refuse unknown top-level keys and NeMo Gym options gym_ray does not honour.

    Args:
        cfg: The run's own merged config (before the head server's config is added).
        referenced: Top-level keys that interpolations refer to (allowed as plain values).

    Raises:
        ConfigError: One line naming every offending key, the closest known setting and where settings
            are documented; ``key`` is the first offending key.
    """
    allowed = known_keys()
    refs = set(referenced)
    problems: list[tuple[str, str]] = []
    for name, value in cfg.items():
        name = str(name)
        if name in REFUSED_OPTIONS:
            refuse, instead = REFUSED_OPTIONS[name]
            if refuse(value):
                problems.append((name, f"config key '{name}' ({value!r}) is not supported: {instead}"))
            continue
        if name in allowed or name in refs or _is_instance_block(value):
            continue
        hint = did_you_mean(name, sorted(allowed | set(REFUSED_OPTIONS)))
        problems.append(
            (
                name,
                f"config key '{name}' is not a setting, a server instance or a key an interpolation refers "
                f"to{hint}",
            )
        )
    mode = cfg.get(keys.ENVIRONMENT_ROUTING_MODE) or keys.ROUTING_AGENT
    if cfg.get(keys.ENVIRONMENT_SERVER_NAME) is not None and mode != keys.ROUTING_LEGACY:
        problems.append(
            (
                keys.ENVIRONMENT_SERVER_NAME,
                f"config key '{keys.ENVIRONMENT_SERVER_NAME}' is used only with "
                f"{keys.ENVIRONMENT_ROUTING_MODE}=legacy (now {mode!r}); add "
                f"+{keys.ENVIRONMENT_ROUTING_MODE}=legacy or drop it",
            )
        )
    if cfg.get("agent_name") is not None and mode == keys.ROUTING_LEGACY:
        problems.append(
            (
                "agent_name",
                "config key 'agent_name' has no effect with environment_routing_mode=legacy (rows go to "
                "environment_server_name and take its agent); drop agent_name or use "
                "environment_routing_mode=agent",
            )
        )
    if problems:
        text = "; ".join(message for _, message in problems)
        raise ConfigError(f"{text}. Settings are documented in {DOCS}", key=problems[0][0])
