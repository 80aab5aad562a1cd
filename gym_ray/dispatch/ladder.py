"""One rollout's retry ladder: every ``/run`` request the server may have seen, counted once.

With a :class:`~gym_ray.dispatch.health.ServerHealth` the dispatch engine is the only one that resends a
``/run`` (the HTTP client sends each request once). After a failed send, :meth:`Ladder.resend` decides:

- a timeout of a server that still answers one probe (``GET /``) is the rollout's: replayed when
  ``retry_requests``, up to ``max_request_retries`` times, then the rollout's failure record;
- any other infrastructure failure (see :func:`~gym_ray.dispatch.health.is_infrastructure_failure`), and a
  timeout of a server that does not answer its probe, is the server's: resent up to ``max_infra_retries``
  times while the health object holds the row back from a server that looks down;
- anything else (an answered error) is the failure record at once.

``errors`` lists what each request met, for the failure record (``_ng_failure_request_errors``); a request
is counted as it leaves, so one cancelled by an abort stays in the list as ``"cancelled"`` (the server may
have seen it). Only failures spend the budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gym_ray.dispatch.health import ServerHealth, is_infrastructure_failure
from gym_ray.errors import ServerConnectionError, ServerHTTPError, ServerResponseError

__all__ = ["CANCELLED", "RESEND_BACKOFF_CAP_S", "Ladder", "SendFailed", "request_error"]

#: What a send met when its task was cancelled before the reply (a stream's ``pause("abort")``).
CANCELLED = "cancelled"

#: Longest wait between two sends of one row's ``/run`` (the client's doubling backoff, capped lower).
RESEND_BACKOFF_CAP_S = 2.0


def request_error(exc: Exception) -> str | None:
    """What a failed send met, as the failure record lists it; None when nothing was sent (no connection)."""
    if isinstance(exc, ServerConnectionError):
        return None if exc.kind == "connect" else (exc.kind or "broken")
    if isinstance(exc, ServerHTTPError):
        return f"http_{exc.status}"
    return "bad_reply"


@dataclass(frozen=True, slots=True)
class SendFailed:
    """A send that failed in an expected way (decided after the semaphore is released: it may probe)."""

    exc: Exception


@dataclass(slots=True)
class Ladder:
    """One row's sends of ``/run`` in one dispatch (see the module docstring).

    Attributes:
        max_request_retries: replays allowed after timeouts of a live server.
        errors: what each request the server may have seen met, in order.
        infra: infrastructure resends spent.
        replays: replays after a timeout of a server that still answered its probe.
    """

    max_request_retries: int
    errors: list[str] = field(default_factory=list)
    infra: int = 0
    replays: int = 0

    @property
    def resends(self) -> int:
        return self.infra + self.replays

    async def resend(
        self,
        exc: Exception,
        url: str,
        server: str,
        health: ServerHealth,
        retry_requests: bool,
        max_infra_retries: int,
    ) -> bool:
        """Whether the row whose send failed with ``exc`` goes again; counts the budget it spends and
        tells ``health`` what the failure says about the server."""
        timed_out = isinstance(exc, ServerConnectionError) and exc.kind == "timeout"
        if timed_out and retry_requests and await health.answers_probe(url):
            health.answered(url)  # alive: the timeout is this rollout's
            if self.replays < self.max_request_retries:
                self.replays += 1
                return True
            return False
        if is_infrastructure_failure(exc, replay=retry_requests):
            health.failed(url, server, exc)
            if self.infra < max_infra_retries:
                self.infra += 1
                return True
            return False
        if isinstance(exc, ServerHTTPError | ServerResponseError):
            health.answered(url)
        return False
