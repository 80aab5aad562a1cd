"""Strict run config: every top-level key is known, and every NeMo Gym 0.7 option is honoured or refused.

A run's own config (YAML files, overrides, keyword settings; not the head server's published config) may
hold only:

- a run setting (a :class:`~gym_ray.config.settings.RunSettings` field),
- a server instance block (a mapping holding a server-type key such as ``responses_api_agents``),
- a structural key (``head_server``, ``tracing``, ``config_paths``, the routing keys),
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

__all__ = ["DOCS", "REFUSED_OPTIONS", "STRUCTURAL_KEYS", "check_run_keys", "interpolation_targets"]

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
    }
)

_QUALITY = (
    "gym_ray runs no post-run rollout-quality pass (NeMo Gym 0.7's 'health check' reads the written "
    "rollouts offline); run NeMo Gym's `gym eval health-check <folder> --rollouts-file <output_jsonl_fpath>` "
    "on the output instead. The check that servers are up before dispatch is gym_ray's own health_check "
    "setting (--no-health-check)"
)
_ZEROS = (
    "gym_ray scores only persisted successes and does not impute zero rewards; failed rollouts are listed "
    "in <stem>_failures.jsonl and missing ones are reported by `gym-ray status`; to score them as zero, run "
    "NeMo Gym's aggregation on the output"
)


def _truthy(value: Any) -> bool:
    return bool(value)


def _is_false(value: Any) -> bool:
    return value is False


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
    "health_check_workers": (lambda v: v is not None, _QUALITY),
    "health_check_ignored_checks": (_truthy, _QUALITY),
    "disable_health_check": (_is_false, _QUALITY),
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
    """Every top-level name the run config accepts by name (settings and structural keys)."""
    return set(RunSettings.model_fields) | set(STRUCTURAL_KEYS)


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
