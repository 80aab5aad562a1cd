"""What one rollout ended as: a result, a typed failure record, or a drained placeholder.

Every outcome a dispatch produces is classified here, inside the process that ran the request, so only
plain picklable data crosses a Ray actor boundary:

- :class:`CompletedRollout`: the raw ``/run`` result with its latency *beside* it (never inside it).
- :class:`RolloutFailureRecord`: a failed ``/run`` (HTTP error, no answer, bad JSON, a reply that is not an
  object), an episode failure, or a result that uses collector-reserved keys.
- :func:`drained_result`: the collector-built result of a row the dispatch budget never started.

:func:`build_record` / :func:`record_of` turn an outcome into the line recording writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict

from gym_ray import keys
from gym_ray.errors import ServerConnectionError, ServerHTTPError, ServerResponseError

#: Longest failure response body kept on a failure record, in characters (longer bodies end in "…").
MAX_RESPONSE_BODY_CHARS = 2000

_REQUEST_FAILURE_CLASSES = frozenset(
    {keys.FailureClass.AGENT_RUN_ERROR, keys.FailureClass.AGENT_REQUEST_FAILED}
)


def cap_body(body: str | bytes | None) -> str | None:
    """A response body as failure evidence: decoded with replacement, cut to 2000 characters plus "…".

    Args:
        body: The raw body (bytes are decoded as UTF-8 with replacement).

    Returns:
        None for an empty or missing body, else the (possibly cut) text.
    """
    if body is None:
        return None
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    if not text:
        return None
    if len(text) > MAX_RESPONSE_BODY_CHARS:
        return text[:MAX_RESPONSE_BODY_CHARS] + "…"
    return text


def failure_class_for_status(status: int | None) -> str:
    """``agent_run_error`` for an answered error status; ``agent_request_failed`` for none / a gateway one."""
    if status is not None and status not in keys.GATEWAY_STATUSES:
        return keys.FailureClass.AGENT_RUN_ERROR
    return keys.FailureClass.AGENT_REQUEST_FAILED


def is_expected_failure(exc: BaseException) -> bool:
    """True for the failures a dispatch turns into records (server misbehaviour), False for bugs."""
    return isinstance(
        exc, ServerConnectionError | ServerHTTPError | ServerResponseError | aiohttp.ClientError
    ) or (isinstance(exc, TimeoutError))


def _identity_of(row: Mapping[str, Any]) -> dict[str, Any]:
    agent_ref = row.get(keys.AGENT_REF)
    agent = agent_ref.get("name") if isinstance(agent_ref, Mapping) else None
    stamp = row.get(keys.ENVIRONMENT_SERVER)
    run_id = row.get(keys.RUN_ID)
    return {
        "task_index": row.get(keys.TASK_INDEX),
        "rollout_index": row.get(keys.ROLLOUT_INDEX),
        "attempt_index": row.get(keys.ATTEMPT_INDEX),
        "rollout_id": row.get(keys.ROLLOUT_ID),
        "environment_server": stamp if isinstance(stamp, str) else None,
        "agent": agent if isinstance(agent, str) else None,
        "run_id": run_id if isinstance(run_id, str) else None,
    }


class RolloutFailureRecord(BaseModel):
    """One failed rollout attempt, typed. Frozen and picklable (it crosses Ray actor boundaries).

    ``to_row()`` gives the failures-sidecar line: the ``_ng_failure_*`` fields plus the row's identity.
    A record is *terminal* (resume never retries it) only when ``terminal`` is true.
    """

    model_config = ConfigDict(frozen=True)

    failure_class: str
    failure_type: str | None = None
    message: str
    http_status: int | None = None
    response_body: str | None = None
    terminal: bool = False
    stage: str | None = None
    partial_response: Any = None
    task_index: int | None = None
    rollout_index: int | None = None
    attempt_index: int | None = None
    rollout_id: str | None = None
    environment_server: str | None = None
    agent: str | None = None
    run_id: str | None = None
    run_error: str | None = None
    requests: int | None = None
    request_errors: tuple[str, ...] | None = None

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        row: Mapping[str, Any],
        *,
        environment_server: str | None = None,
        run_error: bool = False,
        requests: int | None = None,
        request_errors: tuple[str, ...] | None = None,
    ) -> RolloutFailureRecord:
        """Classify a failed ``/run``.

        Args:
            exc: What the client raised: a gym_ray ``ServerError`` (or a raw aiohttp/timeout error).
            row: The row that was dispatched (its identity keys are copied).
            environment_server: The server the row was sent to (defaults to the row's stamp).
            run_error: Also keep ``"<Type>: <message>"`` as ``run_error`` (evidence of an unrouted failure).
            requests: ``/run`` requests the server may have seen for this attempt (the engine's count).
            request_errors: what each of them met, in order.

        Returns:
            ``agent_run_error`` for an answered non-gateway status (including a 200 with a bad body),
            else ``agent_request_failed``; never terminal.
        """
        status: int | None = None
        body: str | None = None
        if isinstance(exc, ServerHTTPError | ServerResponseError):
            status = exc.status
            body = exc.body_excerpt
        elif isinstance(exc, aiohttp.ClientResponseError):
            status = exc.status
        message = str(exc) or repr(exc)
        identity = _identity_of(row)
        if environment_server is not None:
            identity["environment_server"] = environment_server
        return cls(
            failure_class=failure_class_for_status(status),
            failure_type=type(exc).__name__,
            message=message,
            http_status=status,
            response_body=cap_body(body),
            run_error=f"{type(exc).__name__}: {message}" if run_error else None,
            requests=requests,
            request_errors=request_errors,
            **identity,
        )

    @classmethod
    def from_episode_failure(
        cls, failure: Mapping[str, Any], row: Mapping[str, Any], *, environment_server: str | None = None
    ) -> RolloutFailureRecord:
        """An episode reply's ``failure`` object as an ``environment_server_failed`` record.

        ``terminal`` is the failure's own ``terminal`` flag; ``failure_kind`` becomes ``failure_type``.
        """
        identity = _identity_of(row)
        if environment_server is not None:
            identity["environment_server"] = environment_server
        kind = failure.get(keys.FAILURE_KIND)
        stage = failure.get(keys.FAILURE_STAGE_FIELD)
        return cls(
            failure_class=keys.FailureClass.ENVIRONMENT_SERVER_FAILED,
            failure_type=kind if isinstance(kind, str) else None,
            message=str(failure.get(keys.FAILURE_REASON, "")),
            terminal=bool(failure.get(keys.FAILURE_TERMINAL_FIELD, False)),
            stage=stage if isinstance(stage, str) else None,
            partial_response=failure.get("partial_response"),
            **identity,
        )

    @classmethod
    def invalid_result(
        cls, message: str, row: Mapping[str, Any], *, environment_server: str | None = None
    ) -> RolloutFailureRecord:
        """A 200 reply the protocol forbids (reserved keys, malformed episode reply): ``invalid_result``."""
        identity = _identity_of(row)
        if environment_server is not None:
            identity["environment_server"] = environment_server
        return cls(
            failure_class=keys.FailureClass.INVALID_RESULT,
            failure_type="ServerResponseError",
            message=message,
            http_status=200,
            **identity,
        )

    def failure_fields(self) -> dict[str, Any]:
        """Only the ``_ng_failure_*`` fields (what ``run_examples`` hands back for a routed failure)."""
        out: dict[str, Any] = {keys.FAILURE_CLASS: self.failure_class}
        request_failure = self.failure_class in _REQUEST_FAILURE_CLASSES
        if self.failure_type is not None or request_failure:
            out[keys.FAILURE_TYPE] = self.failure_type
        out[keys.FAILURE_MESSAGE] = self.message
        if self.http_status is not None or request_failure:
            out[keys.FAILURE_HTTP_STATUS] = self.http_status
        if self.response_body is not None or request_failure:
            out[keys.FAILURE_RESPONSE_BODY] = self.response_body
        if self.terminal or self.failure_class == keys.FailureClass.ENVIRONMENT_SERVER_FAILED:
            out[keys.FAILURE_TERMINAL] = self.terminal
        if self.stage is not None:
            out[keys.FAILURE_STAGE] = self.stage
        if self.partial_response is not None:
            out[keys.FAILURE_PARTIAL_RESPONSE] = self.partial_response
        if self.requests is not None:
            out[keys.FAILURE_REQUESTS] = self.requests
        if self.request_errors is not None:
            out[keys.FAILURE_REQUEST_ERRORS] = list(self.request_errors)
        if self.run_error is not None:
            out[keys.RUN_ERROR] = self.run_error
        return out

    def to_row(self) -> dict[str, Any]:
        """The failures-sidecar line: :meth:`failure_fields` plus the identity keys that are known."""
        out = self.failure_fields()
        for key, value in (
            (keys.TASK_INDEX, self.task_index),
            (keys.ROLLOUT_INDEX, self.rollout_index),
            (keys.ATTEMPT_INDEX, self.attempt_index),
            (keys.ROLLOUT_ID, self.rollout_id),
            (keys.ENVIRONMENT_SERVER, self.environment_server),
            (keys.RUN_ID, self.run_id),
        ):
            if value is not None:
                out[key] = value
        if self.agent is not None:
            out[keys.AGENT_REF] = {"name": self.agent}
        return out


@dataclass(frozen=True, slots=True)
class CompletedRollout:
    """A ``/run`` that produced a result, with collector-side facts kept beside the result.

    Attributes:
        row: The row as dispatched.
        result: The result object (exactly what ``/run`` returned for a flat row; the flattened ``result``
            plus ``_ng_task_id`` for an episode reply; the drained dict for a drained row).
        rollout_latency_ms: Wall time of the ``/run`` request, None for a drained row.
        environment_server: The environment server the row went to.
        environment_server_type: That server's implementation name (recorded as ``_ng_result_type``).
    """

    row: dict[str, Any]
    result: dict[str, Any]
    rollout_latency_ms: float | None
    environment_server: str | None
    environment_server_type: str | None


def build_record(
    row: Mapping[str, Any],
    result: Mapping[str, Any] | RolloutFailureRecord,
    *,
    environment_server: str | None,
    result_type: str | None,
) -> dict[str, Any]:
    """The line recording writes for one outcome.

    Args:
        row: The dispatched row; its :data:`~gym_ray.keys.RECORDED_IDENTITY_KEYS` present on it are copied.
        result: The result dict, or a failure record (then its :meth:`RolloutFailureRecord.to_row`).
        environment_server: Written as ``_ng_environment_server`` when not None.
        result_type: Written as ``_ng_result_type`` when not None.

    Returns:
        A new dict; neither argument is modified.
    """
    if isinstance(result, RolloutFailureRecord):
        return result.to_row()
    record = dict(result)
    for key in keys.RECORDED_IDENTITY_KEYS:
        if key in row:
            record[key] = row[key]
    run_id = row.get(keys.RUN_ID)
    if run_id is not None:
        record[keys.RUN_ID] = run_id
    if environment_server is not None:
        record[keys.ENVIRONMENT_SERVER] = environment_server
    if result_type is not None:
        record[keys.RESULT_TYPE] = result_type
    return record


def record_of(row: Mapping[str, Any], outcome: CompletedRollout | RolloutFailureRecord) -> dict[str, Any]:
    """What recording writes for one dispatch outcome (collection and the helper's recording share it).

    Args:
        row: The dispatched row.
        outcome: A ``completed``-shape dispatch outcome.

    Returns:
        The failure-sidecar line of a failure record (:meth:`RolloutFailureRecord.to_row`), else the
        result with the row's identity (:func:`build_record`, with the server the row went to and its
        implementation as ``_ng_result_type``).
    """
    if isinstance(outcome, RolloutFailureRecord):
        return outcome.to_row()
    return build_record(
        row,
        outcome.result,
        environment_server=outcome.environment_server,
        result_type=outcome.environment_server_type,
    )


def drained_result(remaining_s: float, margin_s: float | None) -> dict[str, Any]:
    """The collector-built result of a row the dispatch budget did not start.

    Args:
        remaining_s: Seconds left in the budget when the row was considered.
        margin_s: The drain margin in force, or None when the budget itself ran out.

    Returns:
        ``{"_ng_failure_class": "cancelled", "_ng_no_persist": True, "_ng_dispatch_drained": True,
        "error_message": ...}``: never persisted, so resume runs the row again.
    """
    if margin_s is not None:
        message = (
            f"not dispatched: {remaining_s:.0f}s left in dispatch budget, "
            f"below the {margin_s:.0f}s drain margin"
        )
    else:
        message = "not dispatched: dispatch budget exhausted"
    return {
        keys.FAILURE_CLASS: keys.FailureClass.CANCELLED,
        keys.NO_PERSIST: True,
        keys.DISPATCH_DRAINED: True,
        keys.ERROR_MESSAGE: message,
    }


def reserved_keys_of(result: Mapping[str, Any]) -> list[str]:
    """The keys of a server result that a server must not send (sorted)."""
    return sorted(key for key in result if keys.is_reserved_result_key(key))


def is_materialized_row(row: Mapping[str, Any]) -> bool:
    """True for a materialized task row: ``task_id`` is an object and ``task_input`` is present."""
    return isinstance(row.get(keys.TASK_ID), Mapping) and keys.TASK_INPUT in row


def is_episode_reply(reply: Mapping[str, Any]) -> bool:
    """True when a reply is episode-shaped (carries ``episode_id`` and a ``result`` or ``failure``)."""
    return keys.EPISODE_ID in reply and (keys.RESULT in reply or keys.FAILURE in reply)


def classify_reply(
    row: Mapping[str, Any], reply: dict[str, Any], *, environment_server: str | None
) -> dict[str, Any] | RolloutFailureRecord:
    """A 200 ``/run`` object as collection sees it: a result to record, or a failure record.

    An episode reply to a materialized row becomes its ``result`` plus ``_ng_task_id`` or an
    ``environment_server_failed`` record; a result using reserved keys becomes an ``invalid_result`` record.
    """
    if is_materialized_row(row) and is_episode_reply(reply):
        failure = reply.get(keys.FAILURE)
        if failure is not None:
            if not isinstance(failure, Mapping):
                return RolloutFailureRecord.invalid_result(
                    f"episode reply 'failure' is a {type(failure).__name__}, not an object",
                    row,
                    environment_server=environment_server,
                )
            return RolloutFailureRecord.from_episode_failure(
                failure, row, environment_server=environment_server
            )
        inner = reply.get(keys.RESULT)
        if not isinstance(inner, dict):
            return RolloutFailureRecord.invalid_result(
                f"episode reply 'result' is a {type(inner).__name__}, not an object",
                row,
                environment_server=environment_server,
            )
        reply = {**inner, keys.TASK_ID_STAMP: reply.get(keys.TASK_ID)}
        reserved = reserved_keys_of(inner)
    else:
        reserved = reserved_keys_of(reply)
    if reserved:
        return RolloutFailureRecord.invalid_result(
            f"result uses keys reserved for rollout collection: {reserved}; a server must not send them",
            row,
            environment_server=environment_server,
        )
    return reply
