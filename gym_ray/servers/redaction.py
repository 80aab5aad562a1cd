"""Secrets in a published config: which keys are secret, how they are hidden, who may see them.

The head server publishes the whole global config (``/global_config_dict_yaml``). Values under keys that
look secret (:data:`DEFAULT_SECRET_PATTERNS`, matched case-insensitively against every key at any depth,
shell-style) are replaced by :data:`REDACTED` unless the request presents the head server's token as
``Authorization: Bearer <token>``. A head server bound to a non-loopback interface always has a token
(given, or generated and printed by ``gym-ray serve``); without a token nobody sees the secrets.
"""

from __future__ import annotations

import hmac
import ipaddress

from gym_ray import keys
from gym_ray._redact import DEFAULT_SECRET_PATTERNS, is_secret_key, redact

__all__ = [
    "DEFAULT_SECRET_PATTERNS",
    "REDACTED",
    "TOKEN_ENV",
    "bearer_matches",
    "is_loopback",
    "is_secret_key",
    "redact",
]

#: What a secret value is replaced with (the protocol's marker, :data:`gym_ray.keys.REDACTED`).
REDACTED = keys.REDACTED
#: Environment variable ``gym-ray serve`` reads the head server's token from.
TOKEN_ENV = "GYM_RAY_HEAD_TOKEN"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``); False for ``0.0.0.0``,
    ``::``, names and routable addresses."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_matches(authorization: str | None, token: str | None) -> bool:
    """True when an ``Authorization`` header value is ``Bearer <token>`` (constant-time compare)."""
    if not token or not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())
