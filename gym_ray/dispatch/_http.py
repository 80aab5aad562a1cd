"""HTTP helpers shared by :mod:`gym_ray.dispatch.client` and :mod:`gym_ray.dispatch.head`: errors, bodies,
replies."""

from __future__ import annotations

import email.utils
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import BinaryIO

import aiohttp

from gym_ray.errors import ConfigError, InputError, RecordError, ServerConnectionError

__all__ = [
    "BODY_EXCERPT_CHARS",
    "CONNECT_ERRORS",
    "JSON_HEADERS",
    "Backoff",
    "connection_error",
    "excerpt_of",
    "json_headers",
    "open_body",
    "parse_retry_after",
    "positive",
    "save_reply",
]

JSON_HEADERS: Mapping[str, str] = {"Content-Type": "application/json"}

#: Longest reply body quoted in an error (``body_excerpt``), in characters.
BODY_EXCERPT_CHARS = 2000
#: aiohttp errors raised when no connection could be established (nothing was sent).
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def positive(name: str, value: float | None, *, allow_none: bool = False) -> None:
    """Refuse ``value`` unless it is a positive finite number (or None, when ``allow_none``)."""
    if value is None and allow_none:
        return
    if value is None or not value > 0 or not math.isfinite(value):
        none_hint = " or None for no limit" if allow_none else ""
        raise ConfigError(f"{name}={value!r} is invalid: pass a positive finite number{none_hint}", key=name)


@dataclass(slots=True)
class Backoff:
    """Jittered doubling backoff: ``base_s`` doubled per retry and capped at ``max_s``, then scaled by a
    factor in [0.5, 1.0]; a ``Retry-After`` hint is honoured as it is, up to the cap."""

    base_s: float
    max_s: float
    rng: random.Random

    def delay(
        self, retry_index: int, retry_after_s: float | None = None, *, cap_s: float | None = None
    ) -> float:
        """Seconds to wait before retry ``retry_index`` (0 for the first); ``cap_s`` lowers the cap."""
        cap = self.max_s if cap_s is None else min(cap_s, self.max_s)
        if retry_after_s is not None:
            return min(retry_after_s, cap)
        return min(cap, self.base_s * (2.0**retry_index)) * (0.5 + 0.5 * self.rng.random())


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
    return ServerConnectionError(what, url=url, kind=kind if kind in ("connect", "timeout") else "broken")


def parse_retry_after(value: str | None, now_s: float) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP-date), or None when absent/invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now_s
    return max(0.0, seconds) if math.isfinite(seconds) else None


def json_headers(headers: Mapping[str, str] | None) -> Mapping[str, str]:
    if headers:
        return {**{k: v for k, v in headers.items() if k.lower() != "content-type"}, **JSON_HEADERS}
    return JSON_HEADERS


def open_body(path: Path, url: str) -> BinaryIO:
    # A local open does not wait on the network; aiohttp reads the file in its executor and sends it
    # with Content-Length (the size of an open regular file is known).
    try:
        return path.open("rb")
    except OSError as exc:
        raise InputError(
            f"the request body file {path} for {url} cannot be read ({exc}); write the body file "
            "before the call and keep it until the call returns",
            path=str(path),
        ) from exc


REPLY_CHUNK_BYTES = 1 << 16


async def save_reply(resp: aiohttp.ClientResponse, reply_path: Path, url: str) -> None:
    # Local writes of 64 KiB land in the page cache; they do not wait on the network. Only the file
    # operations are wrapped: aiohttp's ClientOSError is an OSError too and must stay a network failure.
    def failed(exc: OSError) -> RecordError:
        return RecordError(
            f"cannot write the reply of {url} to {reply_path} ({exc}); free space or fix permissions there "
            "and call again"
        )

    try:
        handle = reply_path.open("wb")
    except OSError as exc:
        raise failed(exc) from exc
    try:
        async for chunk in resp.content.iter_chunked(REPLY_CHUNK_BYTES):
            try:
                handle.write(chunk)
            except OSError as exc:
                raise failed(exc) from exc
    finally:
        try:
            handle.close()
        except OSError as exc:
            raise failed(exc) from exc
