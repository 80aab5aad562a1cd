"""Error helpers shared by the HTTP clients of :mod:`gym_ray.client` and :mod:`gym_ray.head`."""

from __future__ import annotations

import aiohttp

from gym_ray.errors import ServerConnectionError

__all__ = ["BODY_EXCERPT_CHARS", "CONNECT_ERRORS", "connection_error", "excerpt_of"]

#: Longest reply body quoted in an error (``body_excerpt``), in characters.
BODY_EXCERPT_CHARS = 2000
#: aiohttp errors raised when no connection could be established (nothing was sent).
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def excerpt_of(payload: bytes) -> str:
    """The reply body as text (undecodable bytes replaced), cut at ``BODY_EXCERPT_CHARS`` with an ellipsis."""
    text = payload.decode("utf-8", errors="replace")
    return text if len(text) <= BODY_EXCERPT_CHARS else text[:BODY_EXCERPT_CHARS] + "…"


def connection_error(
    kind: str, url: str, attempts: int, exc: BaseException, total_s: float | None
) -> ServerConnectionError:
    """The error for a request to ``url`` that got no full reply.

    Args:
        kind: ``"connect"`` (no connection), ``"timeout"`` (no reply within ``total_s``), else a broken
            connection.
        url: the request URL.
        attempts: how many attempts were made.
        exc: the last aiohttp / timeout error.
        total_s: the request timeout, quoted for ``"timeout"``.
    """
    cause = f"{type(exc).__name__}: {exc}"
    if kind == "connect":
        what = f"could not connect to {url} after {attempts} attempt(s) ({cause}); is the server running?"
    elif kind == "timeout":
        what = (
            f"no reply from {url} within the request timeout ({total_s} s) after {attempts} attempt(s); "
            "raise request_timeout_s / timeout_s or check the server"
        )
    else:
        what = (
            f"the connection to {url} broke before a full reply after {attempts} attempt(s) ({cause}); "
            "the server may have crashed or dropped the request"
        )
    return ServerConnectionError(what, url=url)
