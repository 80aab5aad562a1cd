"""Enriched results: rollout identity, model-call capture, ``ng_trajectory`` and ``ng_perf``.

:func:`enrich_run_result` turns one ``/run`` result into what collection records plus the standardized
observability fields (PROTOCOL.md section 3 lists them as collector-owned keys):

- the row's rollout identity (:data:`gym_ray.keys.RECORDED_IDENTITY_KEYS`, ``_ng_environment_server``);
- ``ng_model_call_capture`` (only when the global config sets ``observability_enabled``): the model calls
  the environment server captured for this rollout, read from the file the result names in
  ``model_call_capture_path``; request and response bodies are dropped when
  ``include_model_call_payloads`` is false; ``delete_model_call_capture`` removes the file once merged;
- ``ng_trajectory``: derived from the result's ``response.output`` items and the capture (one invocation =
  the ``/run``; turns, model calls, tool calls, token stats, gaps);
- ``ng_perf`` (NeMo Gym 0.7 section 8.1 fields): ``num_turns``, ``num_tool_calls``,
  ``token_observability_coverage``, token sums present only when some call has them, ``total_latency_ms``.

A result carrying ``_ng_failure_class`` (a failure row or a drained row) gets the identity only. The
function never mutates its arguments. It reads (and may delete) one small file: call it off the event
loop when a capture path is present (:func:`needs_io` tells).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gym_ray import keys
from gym_ray.errors import InputError, UsageError

__all__ = [
    "MODEL_CALL_CAPTURE_PATH",
    "OBSERVABILITY_ENABLED",
    "TRAJECTORY_VERSION",
    "build_ng_perf",
    "build_trajectory",
    "check_capture_options",
    "enrich_run_result",
    "needs_io",
]

#: Result field where an environment server names the file holding this rollout's model-call capture.
MODEL_CALL_CAPTURE_PATH = "model_call_capture_path"
#: Global config key that turns on model-call capture.
OBSERVABILITY_ENABLED = "observability_enabled"
TRAJECTORY_VERSION = 1

_TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")
_PAYLOAD_FIELDS = ("request", "response")
_MODEL_ITEMS = frozenset({"message", "reasoning", "function_call"})


def check_capture_options(*, include_model_call_payloads: bool, delete_model_call_capture: bool) -> None:
    """Reject ``delete_model_call_capture`` without the payloads (the file would be the only copy).

    Raises:
        UsageError: ``delete_model_call_capture=True`` with ``include_model_call_payloads=False``.
    """
    if delete_model_call_capture and not include_model_call_payloads:
        raise UsageError(
            "delete_model_call_capture=True needs include_model_call_payloads=True: deleting the capture "
            "file would lose the request/response bodies; keep the payloads or keep the files"
        )


def needs_io(result: Mapping[str, Any], *, observability_enabled: bool) -> bool:
    """True when enriching ``result`` reads a capture file."""
    return observability_enabled and isinstance(result.get(MODEL_CALL_CAPTURE_PATH), str)


def enrich_run_result(
    row: Mapping[str, Any],
    result: Mapping[str, Any],
    *,
    include_model_call_payloads: bool = True,
    observability_enabled: bool = False,
    delete_model_call_capture: bool = False,
    total_latency_ms: float | None = None,
) -> dict[str, Any]:
    """One result with the row's identity, ``ng_model_call_capture``, ``ng_trajectory`` and ``ng_perf``.

    Args:
        row: The dispatched row (identity keys are copied from it when present).
        result: The ``/run`` result (or a record already carrying the identity).
        include_model_call_payloads: Keep each captured call's ``request`` / ``response`` bodies.
        observability_enabled: The global config's ``observability_enabled``; without it no capture is
            read or attached (the trajectory then comes from ``response`` alone).
        delete_model_call_capture: Remove the capture file after it is merged (the returned result then
            has no ``model_call_capture_path``).
        total_latency_ms: Wall time of the ``/run`` (``ng_perf.total_latency_ms``; absent when None).

    Returns:
        A new dict. Failure / drained results (``_ng_failure_class``) get the identity only.

    Raises:
        UsageError: ``delete_model_call_capture`` without ``include_model_call_payloads``.
        InputError: The capture file cannot be read or is not a JSON object with a ``model_calls`` list
            (the message names the file and the rollout).
    """
    check_capture_options(
        include_model_call_payloads=include_model_call_payloads,
        delete_model_call_capture=delete_model_call_capture,
    )
    out = dict(result)
    for key in keys.RECORDED_IDENTITY_KEYS:
        if key in row:
            out[key] = row[key]
    stamp = row.get(keys.ENVIRONMENT_SERVER)
    if isinstance(stamp, str) and keys.ENVIRONMENT_SERVER not in out:
        out[keys.ENVIRONMENT_SERVER] = stamp
    if keys.FAILURE_CLASS in out:
        return out
    calls: list[dict[str, Any]] | None = None
    path = result.get(MODEL_CALL_CAPTURE_PATH)
    if observability_enabled and isinstance(path, str):
        capture = _read_capture(path, row)
        calls = capture["model_calls"]
        kept = [_strip_payloads(c, include_model_call_payloads) for c in calls]
        out[keys.NG_MODEL_CALL_CAPTURE] = {**capture, "model_calls": kept}
        if delete_model_call_capture:
            Path(path).unlink(missing_ok=True)
            out.pop(MODEL_CALL_CAPTURE_PATH, None)
    trajectory = build_trajectory(result.get(keys.RESPONSE), calls)
    if trajectory is None:
        return out
    out[keys.NG_TRAJECTORY] = trajectory
    perf = build_ng_perf(trajectory, total_latency_ms=total_latency_ms)
    if perf is not None:
        out[keys.NG_PERF] = perf
    return out


def _rollout_label(row: Mapping[str, Any]) -> str:
    rid = row.get(keys.ROLLOUT_ID)
    if isinstance(rid, str):
        return rid
    return f"task {row.get(keys.TASK_INDEX)!r} rollout {row.get(keys.ROLLOUT_INDEX)!r}"


def _read_capture(path: str, row: Mapping[str, Any]) -> dict[str, Any]:
    where = f"model-call capture {path} of {_rollout_label(row)}"
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise InputError(
            f"{where} cannot be read ({exc.strerror or exc}); the environment server's capture dir must be "
            "readable from the collector (same machine or a shared filesystem)",
            path=path,
        ) from exc
    except ValueError as exc:
        raise InputError(f"{where} is not JSON ({exc})", path=path) from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_calls"), list):
        raise InputError(f"{where} is not an object with a 'model_calls' list", path=path)
    if not all(isinstance(c, dict) for c in data["model_calls"]):
        raise InputError(f"{where}: every entry of 'model_calls' must be an object", path=path)
    return data


def _strip_payloads(call: Mapping[str, Any], keep: bool) -> dict[str, Any]:
    if keep:
        return dict(call)
    return {k: v for k, v in call.items() if k not in _PAYLOAD_FIELDS}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage_tokens(usage: Any) -> dict[str, int]:
    """Token stats from a Responses ``usage`` object (missing values left out)."""
    if not isinstance(usage, Mapping):
        return {}
    input_details = usage.get("input_tokens_details")
    output_details = usage.get("output_tokens_details")
    pairs = {
        "prompt_tokens": _int(usage.get("input_tokens")),
        "cached_tokens": _int(input_details.get("cached_tokens"))
        if isinstance(input_details, Mapping)
        else None,
        "completion_tokens": _int(usage.get("output_tokens")),
        "reasoning_tokens": (
            _int(output_details.get("reasoning_tokens")) if isinstance(output_details, Mapping) else None
        ),
    }
    return {k: v for k, v in pairs.items() if v is not None}


def _call_record(call: Mapping[str, Any], index: int) -> dict[str, Any]:
    response = call.get("response")
    response = response if isinstance(response, Mapping) else {}
    stats = call.get("token_stats")
    tokens = (
        {k: v for k in _TOKEN_FIELDS if (v := _int(stats.get(k))) is not None}
        if isinstance(stats, Mapping)
        else _usage_tokens(response.get(keys.USAGE))
    )
    record: dict[str, Any] = {
        "model_call_id": call.get("model_call_id") if isinstance(call.get("model_call_id"), str) else None,
        "model_ref": call.get("model_ref", response.get("model")),
        "response_id": call.get("response_id", response.get("id")),
        "index": index,
        "token_stats": tokens,
    }
    latency = call.get("latency_ms")
    if isinstance(latency, int | float) and not isinstance(latency, bool):
        record["latency_ms"] = float(latency)
    return record


def build_trajectory(response: Any, calls: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The ``ng_trajectory`` of one ``/run``, or None when ``response`` has no ``output`` list.

    Turns: maximal runs of model items (``message``, ``reasoning``, ``function_call``) between tool
    outputs (``function_call_output``). Tool calls: the ``function_call`` items, each with whether an
    output answered it. Model calls: the captured ``calls`` when given, else the response itself as one
    call. Gaps name what could not be observed: ``no_model_call_capture``, ``no_token_usage``,
    ``tool_call_without_output:<call_id>``, ``turns_without_model_call:<n>``.
    """
    if not isinstance(response, Mapping) or not isinstance(response.get("output"), list):
        return None
    turns: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    answered: set[str] = set()
    current: dict[str, Any] | None = None
    for item in response["output"]:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "function_call_output":
            current = None
            call_id = item.get("call_id")
            if isinstance(call_id, str):
                answered.add(call_id)
            continue
        if kind not in _MODEL_ITEMS:
            continue
        if current is None:
            current = {"index": len(turns), "items": [], "tool_calls": 0}
            turns.append(current)
        current["items"].append(kind)
        if kind == "function_call":
            current["tool_calls"] += 1
            tool_calls.append({"call_id": item.get("call_id"), "name": item.get("name")})
    for tool_call in tool_calls:
        tool_call["answered"] = tool_call["call_id"] in answered
    gaps: list[str] = []
    if calls is None:
        gaps.append("no_model_call_capture")
        model_calls = [_call_record({"response": response}, 0)] if turns else []
    else:
        model_calls = [_call_record(c, i) for i, c in enumerate(calls)]
    token_stats: dict[str, int] = {}
    for call in model_calls:
        for field, value in call["token_stats"].items():
            token_stats[field] = token_stats.get(field, 0) + value
    if model_calls and not token_stats:
        gaps.append("no_token_usage")
    gaps.extend(f"tool_call_without_output:{t['call_id']}" for t in tool_calls if not t["answered"])
    if len(model_calls) < len(turns):
        gaps.append(f"turns_without_model_call:{len(turns) - len(model_calls)}")
    refs = [
        {"model_call_id": c["model_call_id"]}
        if c["model_call_id"] is not None
        else {"model_ref": c["model_ref"], "response_id": c["response_id"]}
        for c in model_calls
    ]
    return {
        "version": TRAJECTORY_VERSION,
        "invocations": [{"turns": len(turns), "model_calls": refs, "tool_calls": len(tool_calls)}],
        "turns": turns,
        "model_calls": model_calls,
        "tool_calls": tool_calls,
        "token_stats": token_stats,
        "gaps": gaps,
    }


def _matched_calls(trajectory: Mapping[str, Any], refs: list[Any]) -> list[Mapping[str, Any]]:
    """Calls matched uniquely by ``model_call_id`` or the exact ``(model_ref, response_id)``; each once."""
    calls = [c for c in trajectory.get("model_calls", []) if isinstance(c, Mapping)]
    matched: list[Mapping[str, Any]] = []
    used: set[int] = set()
    for ref in refs:
        if not isinstance(ref, Mapping):
            continue
        if ref.get("model_call_id") is not None:
            hits = [i for i, c in enumerate(calls) if c.get("model_call_id") == ref["model_call_id"]]
        else:
            pair = (ref.get("model_ref"), ref.get("response_id"))
            hits = [i for i, c in enumerate(calls) if (c.get("model_ref"), c.get("response_id")) == pair]
        if len(hits) == 1 and hits[0] not in used:
            used.add(hits[0])
            matched.append(calls[hits[0]])
    return matched


def build_ng_perf(
    trajectory: Mapping[str, Any], *, total_latency_ms: float | None = None
) -> dict[str, Any] | None:
    """``ng_perf`` of a trajectory (None without invocations), following NeMo Gym 0.7 section 8.1.

    ``num_turns`` sums, per invocation, its turn count, else its matched-call count, else 1;
    ``token_observability_coverage`` = min(1, matched calls / num_turns); ``prompt_tokens``,
    ``cached_prompt_tokens``, ``completion_tokens``, ``reasoning_tokens`` are sums over matched calls,
    each present only when some call has it; ``total_latency_ms`` is the ``/run`` wall time when known.
    """
    invocations = trajectory.get("invocations")
    if not isinstance(invocations, list) or not invocations:
        return None
    num_turns = num_tools = 0
    matched: list[Mapping[str, Any]] = []
    for inv in invocations:
        if not isinstance(inv, Mapping):
            continue
        refs = inv.get("model_calls")
        found = _matched_calls(trajectory, refs if isinstance(refs, list) else [])
        matched.extend(found)
        turns = _int(inv.get("turns"))
        num_turns += turns if turns else (len(found) or 1)
        num_tools += _int(inv.get("tool_calls")) or 0
    perf: dict[str, Any] = {
        "num_turns": num_turns,
        "num_tool_calls": num_tools,
        "token_observability_coverage": min(1.0, len(matched) / num_turns) if num_turns else 0.0,
    }
    for source, name in (
        ("prompt_tokens", "prompt_tokens"),
        ("cached_tokens", "cached_prompt_tokens"),
        ("completion_tokens", "completion_tokens"),
        ("reasoning_tokens", "reasoning_tokens"),
    ):
        values = [
            v
            for c in matched
            if isinstance(c.get("token_stats"), Mapping)
            and (v := _int(c["token_stats"].get(source))) is not None
        ]
        if values:
            perf[name] = sum(values)
    if total_latency_ms is not None:
        perf["total_latency_ms"] = float(total_latency_ms)
    return perf
