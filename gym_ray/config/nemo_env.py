"""What NeMo Gym 0.7 reads from the environment of a collection: ``env.yaml`` and the attempt cap.

- ``env.yaml``: 0.7 merges it into every CLI config, over the ``config_paths`` files and under the command
  line's overrides; it may name ``config_paths`` itself. It is looked up under each ``NEMO_GYM_EXTRA_ROOTS``
  folder (``os.pathsep``-separated), then the current folder; the first that has one wins. (0.7 also looks
  in its install folder, which gym_ray does not have.) :func:`find_env_yaml`; ``gym-ray run`` merges it.
- ``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS``: attempts per rollout before resume gives up on it (0.7's default 3).
  Unset or empty: the default; not an integer >= 1: a warning and the default, as 0.7 does.
  :func:`max_rollout_attempts_from_env`; the run setting ``max_rollout_attempts``, when the config sets it,
  wins over the variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "ENV_YAML",
    "EXTRA_ROOTS_VAR",
    "MAX_ROLLOUT_ATTEMPTS_VAR",
    "find_env_yaml",
    "max_rollout_attempts_from_env",
]

logger = logging.getLogger(__name__)

ENV_YAML = "env.yaml"
EXTRA_ROOTS_VAR = "NEMO_GYM_EXTRA_ROOTS"
MAX_ROLLOUT_ATTEMPTS_VAR = "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS"

# Values already warned about: the settings are read several times per run, the warning is given once.
_warned: set[str] = set()


def find_env_yaml(*, cwd: Path | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The ``env.yaml`` 0.7 would read: under the first ``NEMO_GYM_EXTRA_ROOTS`` folder that has one,
    else in the current folder; None when there is none."""
    env = os.environ if environ is None else environ
    roots = [Path(part) for part in env.get(EXTRA_ROOTS_VAR, "").split(os.pathsep) if part]
    for root in [*roots, cwd if cwd is not None else Path.cwd()]:
        candidate = root / ENV_YAML
        if candidate.is_file():
            return candidate
    return None


def max_rollout_attempts_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS`` as 0.7 reads it; None means 0.7's default (3)."""
    raw = (os.environ if environ is None else environ).get(MAX_ROLLOUT_ATTEMPTS_VAR)
    if raw is None or raw == "":
        return None
    try:
        attempts = int(raw)
    except ValueError:
        attempts = 0
    if attempts < 1:
        if raw in _warned:
            return None
        _warned.add(raw)
        logger.warning(
            "%s=%r is not an integer >= 1; using NeMo Gym's default of 3 attempts per rollout",
            MAX_ROLLOUT_ATTEMPTS_VAR,
            raw,
        )
        return None
    return attempts
