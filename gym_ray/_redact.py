"""Which config keys hold secrets and how their values are hidden: the head server's patterns.

Kept apart from :mod:`gym_ray.servers.redaction` (which re-exports these names with the head server's
token rules) so that a run can redact what it writes to its folder (:mod:`gym_ray.record.run_record`)
without importing the reference servers.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from gym_ray import keys

__all__ = ["DEFAULT_SECRET_PATTERNS", "is_secret_key", "redact"]

#: Key patterns whose values are secret (``fnmatch``, case-insensitive): API keys, tokens, passwords,
#: secrets, ``Authorization`` headers, credentials, private keys and access keys.
DEFAULT_SECRET_PATTERNS: tuple[str, ...] = (
    "*api_key*",
    "*apikey*",
    "*token*",
    "*password*",
    "*secret*",
    "*authorization*",
    "*credential*",
    "*private_key*",
    "*privatekey*",
    "*access_key*",
    "*accesskey*",
)


def is_secret_key(key: object, patterns: Iterable[str] = DEFAULT_SECRET_PATTERNS) -> bool:
    """True when the key's text matches one of ``patterns`` (case-insensitive)."""
    text = str(key).lower()
    return any(fnmatch.fnmatchcase(text, pattern.lower()) for pattern in patterns)


def redact(value: Any, patterns: Iterable[str] = DEFAULT_SECRET_PATTERNS) -> Any:
    """A copy of ``value`` with the value of every secret-looking key replaced by :data:`keys.REDACTED`.

    A secret key's whole value is replaced, nested mappings and lists included; ``None`` stays ``None``
    (there is nothing to hide, and it shows the key is unset).
    """
    patterns = tuple(patterns)
    if isinstance(value, Mapping):
        return {
            k: (keys.REDACTED if v is not None and is_secret_key(k, patterns) else redact(v, patterns))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, patterns) for v in value]
    return value
