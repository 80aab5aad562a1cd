"""Aggregate metrics once per environment server, and the strict run's completion rejection.

``aggregate_metrics`` groups persisted successes by the environment server each rollout ran through
(its ``_ng_environment_server`` stamp, else the front of its agent), strips the heavy fields, POSTs
``{"verify_responses": [...]}`` to every server's ``/aggregate_metrics`` concurrently and writes one JSON
list with one entry per server (PROTOCOL.md section 5).

Differences from NeMo Gym 0.7, on purpose:

* Entries are ordered by server name, not by completion order, so two runs over the same results write
  byte-identical files.
* A server whose call failed keeps an entry with empty collections and ``"aggregation_error"``; the
  other servers' metrics are saved before any error is raised.

Memory: the request side does not grow with the number of results. ``results`` is consumed once, as
a stream (``aggregate_run``: the merged ``rollouts.jsonl``, read once by ``_aggregate_read``, which
spools the lines orjson read with orjson's text); each stripped result goes to its server's spool
file (compact JSON lines) in a private folder ``.aggregate-XXXXXX`` beside the metrics file, removed
when ``aggregate_metrics`` returns, raises or is cancelled (``gym_ray.finalize._aggregate_spool``).
Each server's body ``{"verify_responses": [...]}`` is assembled from its spool into a file, streamed
when its results arrived sorted by (task, rollout) (the merged file is), else sorted in memory: that
server's stripped lines only, the one case where memory grows with the results. The body file is sent
with ``ServerClient.post_json_file``. The reply side does not grow with the number of tasks either: each
reply is streamed to a file in the spool folder (``post_json_file(..., reply_path=...)``) and read back
with ``gym_ray.finalize.json_stream``: the small members (``agent_metrics``, ``key_metrics``,
``perf_summary``) are validated as ``AggregateMetricsReply``, while each element of
``group_level_metrics`` / ``repeat_level_metrics`` (one per task) is encoded as the metrics file holds it
and appended to a fragment file, at most one buffer's elements in memory. The metrics file is written entry
by entry, the fragments copied in chunks (the bytes NeMo Gym 0.7's ``orjson.dumps(entries,
option=OPT_INDENT_2)`` would give).
Durability: the metrics file is replaced atomically (temp file, fsync, rename, fsync of the folder).
Concurrency: one task per server in an ``asyncio.TaskGroup``; each task records its own outcome;
cancellation cancels every request, waits for the worker thread in use (it stops at its next row),
removes the spool folder and propagates.

Order: callers decide ``completion_rejection`` *before* computing the aggregate, so a rejected run
publishes no score.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic

from gym_ray import keys
from gym_ray.errors import (
    AggregationError,
    GymRayError,
    InputError,
    RecordError,
    RunRejectedError,
    ServerResponseError,
    UsageError,
    validation_problems,
)
from gym_ray.finalize._aggregate_read import group_merged
from gym_ray.finalize._aggregate_spool import (
    STREAMED_REPLY_KEYS,
    Fragment,
    Grouping,
    ReplyParts,
    ServerSpools,
    group_results,
    run_joined,
    write_metrics_atomic,
)
from gym_ray.finalize._aggregate_spool import strip_for_aggregation as strip_for_aggregation
from gym_ray.finalize.metrics_summary import (
    forget_written_summary,
    note_written_summary,
)
from gym_ray.finalize.metrics_summary import read_metrics_summary as read_metrics_summary

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology
    from gym_ray.dispatch.client import ServerClient

__all__ = [
    "AGGREGATE_ERRORS_FILE",
    "AGGREGATE_FILE_NAME",
    "AggregateEntry",
    "AggregateMetricsReply",
    "aggregate_metrics",
    "aggregate_run",
    "completion_rejection",
    "label_runs",
    "raise_for_aggregation_errors",
    "raise_for_completion_rejection",
    "read_metrics_summary",
    "strip_for_aggregation",
]

#: Name of the metrics file inside a run folder.
AGGREGATE_FILE_NAME = "rollouts_aggregate_metrics.json"
#: Beside the metrics file: the entries of the last aggregate, when it failed (``gym-ray aggregate`` keeps
#: the metrics file then); removed by the next aggregate that writes a metrics file.
AGGREGATE_ERRORS_FILE = "rollouts_aggregate_metrics.errors.json"
_MERGED_FILE_NAME = "rollouts.jsonl"
_AGGREGATE_PATH = "/aggregate_metrics"
_STRICT = json.JSONEncoder(allow_nan=False)


logger = logging.getLogger(__name__)


class AggregateMetricsReply(pydantic.BaseModel):
    """The body ``/aggregate_metrics`` answers with (NeMo Gym's ``AggregateMetrics``).

    Unknown keys are ignored; ``perf_summary: null`` is the same as an absent ``perf_summary``.
    """

    model_config = pydantic.ConfigDict(extra="ignore", frozen=True)

    group_level_metrics: list[dict[str, Any]]
    agent_metrics: dict[str, Any]
    key_metrics: dict[str, Any]
    repeat_level_metrics: list[dict[str, Any]] | None = None
    perf_summary: dict[str, Any] | None = None


class AggregateEntry(pydantic.BaseModel):
    """One entry of the metrics file: one environment server's metrics, or its aggregation error.

    ``to_json()`` gives the file's shape: ``agent_ref``, ``_ng_environment_server``, ``agent_metrics``,
    ``key_metrics``, ``group_level_metrics``, then ``repeat_level_metrics`` / ``perf_summary`` /
    ``aggregation_error`` when set.
    """

    model_config = pydantic.ConfigDict(frozen=True)

    agent_ref: dict[str, str]
    environment_server: str = pydantic.Field(
        validation_alias=pydantic.AliasChoices(keys.ENVIRONMENT_SERVER, "environment_server"),
        serialization_alias=keys.ENVIRONMENT_SERVER,
    )
    agent_metrics: dict[str, Any] = pydantic.Field(default_factory=dict)
    key_metrics: dict[str, Any] = pydantic.Field(default_factory=dict)
    group_level_metrics: list[dict[str, Any]] = pydantic.Field(default_factory=list)
    repeat_level_metrics: list[dict[str, Any]] | None = None
    perf_summary: dict[str, Any] | None = None
    aggregation_error: str | None = None

    @property
    def label(self) -> str:
        """The run label (``agent_ref.name``)."""
        return self.agent_ref["name"]

    def to_json(self) -> dict[str, Any]:
        """The entry as written to the file (absent optional keys are left out)."""
        return self.model_dump(by_alias=True, exclude_none=True)


# --- labels -------------------------------------------------------------------------------------------


def label_runs(agents_by_server: Mapping[str, str | None]) -> dict[str, str]:
    """Label each environment server's metrics: the agent name when it identifies one server.

    A server is labelled with its agent's name when that agent labels no other server and the name
    does not clash with another entry's label; otherwise (shared agent, clash, no agent) with its own
    name. Example (NeMo Gym 0.7 ``label_runs``)::

        >>> label_runs({"env_a": "ag1", "env_b": "ag1", "env_c": "ag2", "env_multi": None})
        {'env_a': 'env_a', 'env_b': 'env_b', 'env_c': 'ag2', 'env_multi': 'env_multi'}

    Args:
        agents_by_server: environment server -> the agent it ran (or ``None``).

    Returns:
        environment server -> label, in the mapping's order; labels are unique.
    """
    uses: dict[str, int] = {}
    for agent in agents_by_server.values():
        if agent is not None:
            uses[agent] = uses.get(agent, 0) + 1
    by_agent = {s for s, a in agents_by_server.items() if a is not None and uses[a] == 1}
    # A label that equals another server's name would be ambiguous; fall back until stable.
    while True:
        fixed = {s for s in agents_by_server if s not in by_agent}
        clashing = {s for s in by_agent if agents_by_server[s] in fixed}
        if not clashing:
            break
        by_agent -= clashing
    return {s: (a if s in by_agent and a is not None else s) for s, a in agents_by_server.items()}


# --- the calls ----------------------------------------------------------------------------------------


_SHAPE_HINT = (
    "the server must answer group_level_metrics (list), agent_metrics (object) and key_metrics (object)"
)


def _what(server: str) -> str:
    return f"/aggregate_metrics on {server!r} answered a body"


def _validate_reply(server: str, parts: ReplyParts) -> AggregateMetricsReply:
    """Validate the small members; the streamed lists stand in as empty lists (their elements are objects)."""
    reply: dict[str, Any] = dict(parts.members)
    for key in parts.fragments:
        reply[key] = []
    try:
        validated = AggregateMetricsReply.model_validate(reply)
    except pydantic.ValidationError as exc:
        raise ServerResponseError(
            f"{_what(server)} that is not AggregateMetrics ({validation_problems(exc)}); {_SHAPE_HINT}",
            body_excerpt=parts.excerpt,
        ) from exc
    try:
        _STRICT.encode(validated.model_dump(exclude={"group_level_metrics", "repeat_level_metrics"}))
    except ValueError as exc:
        raise ServerResponseError(
            f"{_what(server)} that is not strict JSON ({exc}); the server must answer finite numbers",
            body_excerpt=parts.excerpt,
        ) from exc
    return validated


class _Outcome:
    __slots__ = ("error", "fragments", "reply")

    def __init__(self) -> None:
        self.reply: AggregateMetricsReply | None = None
        self.fragments: dict[str, Fragment] = {}
        self.error: Exception | None = None


async def _call_one(client: ServerClient, server: str, spools: ServerSpools, outcome: _Outcome) -> None:
    # Each task reports its own outcome instead of raising, so one failed server does not make the
    # TaskGroup cancel the others. CancelledError is a BaseException and propagates.
    try:
        body = await run_joined(lambda stop: spools.write_body(server, stop))
        reply_path = spools.reply_path(server)
        await client.post_json_file(server, _AGGREGATE_PATH, body, reply_path=reply_path)
        parts = await run_joined(
            lambda stop: spools.read_reply(
                server, stop, keep=AggregateMetricsReply.model_fields, what=_what(server), hint=_SHAPE_HINT
            )
        )
        outcome.reply = _validate_reply(server, parts)
        outcome.fragments = parts.fragments
    except Exception as exc:
        outcome.error = exc


def _entry(server: str, label: str, outcome: _Outcome) -> AggregateEntry:
    agent_ref = {"name": label}
    if outcome.reply is None:
        error = outcome.error
        text = f"{type(error).__name__}: {error}" if error is not None else "InternalError: no reply"
        return AggregateEntry(agent_ref=agent_ref, environment_server=server, aggregation_error=text)
    reply = outcome.reply
    # The reply was validated once (AggregateMetricsReply); the entry shares its collections. Its
    # streamed lists are empty stand-ins here: their elements are in the outcome's fragments.
    return AggregateEntry.model_construct(
        agent_ref=agent_ref,
        environment_server=server,
        agent_metrics=reply.agent_metrics,
        key_metrics=reply.key_metrics,
        group_level_metrics=reply.group_level_metrics,
        repeat_level_metrics=reply.repeat_level_metrics,
        perf_summary=reply.perf_summary,
    )


def _file_shape(entry: AggregateEntry) -> dict[str, Any]:
    """``entry.to_json()`` without copying the collections: same keys, same order, ``None`` left out."""
    shape: dict[str, Any] = {}
    for name, field in AggregateEntry.model_fields.items():
        value = getattr(entry, name)
        if value is not None:
            shape[field.serialization_alias or name] = value
    return shape


def _file_entry(server: str, label: str, outcome: _Outcome) -> dict[str, Any]:
    """The entry as the file holds it; a streamed list is its ``Fragment`` (same key, same place)."""
    # The streamed keys have no alias; each is present (an empty stand-in) when it has a fragment.
    return {**_file_shape(_entry(server, label, outcome)), **outcome.fragments}


async def aggregate_metrics(
    results: Iterable[Mapping[str, Any]],
    topology: Topology,
    client: ServerClient,
    *,
    output_path: str | os.PathLike[str],
    raise_on_error: bool = True,
) -> Path | None:
    """Call ``/aggregate_metrics`` on each environment server the results ran through; write one file.

    Results without ``_ng_environment_server`` are attributed to the environment server that fronts
    their agent (materialized task rows: the route of their taskset). Failure records
    (``_ng_failure_class``) and never-persisted rows (``_ng_no_persist``) are skipped. Each server
    receives its results stripped (``strip_for_aggregation``) and sorted by (task, rollout); the
    servers are called concurrently, once each.

    The file is a JSON list (indent 2) with one ``AggregateEntry`` per server, ordered by server name.
    A server whose call failed keeps an entry with empty collections and
    ``"aggregation_error": "<ExceptionType>: <message>"``.

    Example::

        rows = (record for _, record in JsonlReader(run_dir / "rollouts.jsonl"))
        path = await aggregate_metrics(rows, topology, client,
                                       output_path=run_dir / "rollouts_aggregate_metrics.json")

    Args:
        results: recorded results (dicts), consumed once.
        topology: the running config (the one that produced the results).
        client: the client the servers are called through.
        output_path: the metrics file to write (replaced atomically).
        raise_on_error: after saving the file, re-raise the first failed server's original exception
            (servers in name order; the same object, traceback kept). With ``False`` the call returns
            normally; use ``raise_for_aggregation_errors`` for one summary error.

    Returns:
        The path written, or ``None`` (and no file) when there is no success to aggregate.

    Raises:
        ValidationError: results stamped with servers absent from ``topology``, or results that cannot
            be attributed to any environment server; every one is listed (raised before any request).
        ServerError: with ``raise_on_error``, the first server's failure (``ServerHTTPError``,
            ``ServerConnectionError``, ``ServerResponseError`` for a reply of the wrong shape).
        InputError: with ``raise_on_error``, a result that is not JSON-serialisable (its server is
            not called and keeps an error entry naming the result).
        RecordError: the spool folder beside ``output_path`` or the metrics file cannot be written.
    """
    return await _aggregate(
        lambda spools, stop: group_results(results, topology, spools, stop), client, Path(output_path),
        raise_on_error,
    )  # fmt: skip


async def _aggregate(
    fill: Callable[[ServerSpools, threading.Event], Grouping],
    client: ServerClient,
    path: Path,
    raise_: bool,
    spools: ServerSpools | None = None,
) -> Path | None:
    spools = spools if spools is not None else ServerSpools(path.parent)
    try:
        # Reading (often a file) and writing run in worker threads so the event loop stays responsive.
        grouping = await run_joined(lambda stop: fill(spools, stop))
        if not grouping.counts:
            return None
        servers = sorted(grouping.counts)
        labels = label_runs({s: grouping.first_agent[s] for s in servers})
        outcomes = {s: _Outcome() for s in servers}
        async with asyncio.TaskGroup() as group:
            for server in servers:
                outcome = outcomes[server]
                outcome.error = grouping.errors.get(server)
                if outcome.error is None:
                    group.create_task(
                        _call_one(client, server, spools, outcome), name=f"aggregate_metrics[{server}]"
                    )
        shapes = [_file_entry(s, labels[s], outcomes[s]) for s in servers]
        await run_joined(lambda stop: _atomic_write_json(path, shapes, stop))
    finally:
        spools.remove()
    errors = [error for s in servers if (error := outcomes[s].error) is not None]
    if errors and raise_:
        raise errors[0]
    # A non-gym_ray exception is a bug, not a server failure: never leave it only in the file.
    bugs = [error for error in errors if not isinstance(error, GymRayError)]
    if bugs:
        raise bugs[0]
    return path


def _read_entries(path_or_entries: str | os.PathLike[str] | Iterable[Any]) -> list[AggregateEntry]:
    source: Any = path_or_entries
    if isinstance(path_or_entries, str | os.PathLike):
        source = read_metrics_summary(path_or_entries)  # the per-task lists are not needed here
    entries = []
    for index, item in enumerate(source):
        try:
            entries.append(item if isinstance(item, AggregateEntry) else AggregateEntry.model_validate(item))
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            raise InputError(
                f"aggregate entry #{index} is not an aggregate entry: {first['msg']} at {first['loc']}",
                row=index,
            ) from exc
    return entries


def raise_for_aggregation_errors(path_or_entries: str | os.PathLike[str] | Iterable[Any]) -> None:
    """Raise one ``AggregationError`` naming every server whose ``/aggregate_metrics`` failed.

    Args:
        path_or_entries: the metrics file, or its entries (dicts or ``AggregateEntry``).

    Raises:
        AggregationError: ``servers`` maps each failed server to its ``aggregation_error`` text.
        InputError: the file cannot be read or is not a list of entries.
    """
    failed = {
        e.environment_server: e.aggregation_error
        for e in _read_entries(path_or_entries)
        if e.aggregation_error is not None
    }
    if not failed:
        return
    listing = "; ".join(f"{server}: {text}" for server, text in failed.items())
    raise AggregationError(
        f"/aggregate_metrics failed on {len(failed)} environment server(s): {listing}. The metrics of "
        "the other servers are saved; fix the server(s) and run `gym-ray aggregate RUN_DIR CONFIG` again",
        servers=failed,
    )


def _merged_file(folder: Path) -> Path | None:
    if not folder.is_dir():
        raise UsageError(f"run folder {folder} does not exist; pass the folder a run wrote")
    merged = folder / _MERGED_FILE_NAME
    if not merged.exists():
        from gym_ray.finalize.merge import merge_shards

        merge_shards(folder)
    return merged if merged.exists() else None


async def aggregate_run(
    run_dir: str | os.PathLike[str],
    topology: Topology,
    client: ServerClient,
    *,
    raise_on_error: bool = False,
    output_path: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Aggregate a run folder: read ``rollouts.jsonl`` (merging the shards first when it is missing).

    Writes ``<run_dir>/rollouts_aggregate_metrics.json`` (or ``output_path``). The merged file is streamed.

    Args:
        run_dir: the run folder.
        topology: the config that produced the run.
        client: the client the servers are called through.
        raise_on_error: see ``aggregate_metrics``; by default failures stay in the file (call
            ``raise_for_aggregation_errors`` on the returned path).

    Returns:
        The metrics file, or ``None`` when the run has no success.
    """
    from gym_ray.finalize import aggregate_ahead

    folder = Path(run_dir)
    ahead = aggregate_ahead.claim(folder)  # the coordinator's grouping of the prefix, if any
    try:
        merged = await asyncio.to_thread(_merged_file, folder)
    except BaseException:
        if ahead is not None:
            ahead.discard()
        raise
    target = Path(output_path) if output_path is not None else folder / AGGREGATE_FILE_NAME
    if ahead is not None and merged is not None and ahead.covers(merged) and ahead.spools is not None:
        logger.info("aggregate: %d rows of %s were grouped while the run went on", ahead.rows_grouped, merged)
        carried = ahead
        return await _aggregate(
            lambda _spools, stop: carried.finish(merged, stop), client, target, raise_on_error,
            spools=ahead.spools,
        )  # fmt: skip
    if ahead is not None:
        ahead.discard()
    if merged is None:
        return None
    # Strict: a corrupt line in the merged file is an error naming file and line, not a silent gap.
    return await _aggregate(
        lambda spools, stop: group_merged(merged, topology, spools, stop), client, target, raise_on_error,
    )  # fmt: skip


def _atomic_write_json(path: Path, entries: list[dict[str, Any]], stop: threading.Event) -> None:
    summary = [{k: v for k, v in e.items() if k not in STREAMED_REPLY_KEYS} for e in entries]
    forget_written_summary()
    try:
        write_metrics_atomic(path, entries, stop)
        note_written_summary(path, json.dumps(summary, allow_nan=False))
    except OSError as exc:
        raise RecordError(
            f"cannot write the metrics file {path}: {exc}; free space or fix permissions, then run "
            "`gym-ray aggregate RUN_DIR CONFIG` again"
        ) from exc


# --- completion rejection -------------------------------------------------------------------------------


def completion_rejection(
    *,
    expected: int,
    completed: int,
    final_zero_rows: int = 0,
    can_retry: bool,
    made_progress: bool,
    strict: bool,
) -> RunRejectedError | None:
    """The error that rejects a strict run's unfinished work, or ``None``.

    Omissions alongside completed rollouts are allowed: when nothing left can be retried (terminal
    failures, attempts used up), a strict run that completed at least one rollout is accepted.
    Collection decides this *before* it computes the aggregate, so a rejected run publishes no score.

    Decision, with ``settled = completed + final_zero_rows``:

    * not ``strict``, or ``settled >= expected``: ``None``.
    * nothing can be retried (``can_retry=False``): ``None`` when ``settled > 0`` (omissions are
      allowed); rejected when no rollout completed at all.
    * retryable work left and this attempt made progress: rejected, the message says to resume.
    * retryable work left but no progress: rejected, the message says another attempt as-is would not
      help and to fix the cause first.

    Drivers must pass ``can_retry`` (some unfinished rollout can still run again) and
    ``made_progress`` (this invocation saved outcomes that settled rollouts, not just interruptions)
    truthfully: assuming either can restart a driver forever that has no work left or makes no progress.

    Args:
        expected: rollouts planned (materialized input rows).
        completed: distinct rollouts with a persisted success.
        final_zero_rows: failure rows that settle their rollout as a scored zero (resume does not run
            them again, so they count as completed). Pass 0 when ``completed`` already counts them.
        can_retry: whether any unfinished rollout can still be retried.
        made_progress: whether this invocation saved outcomes that made progress.
        strict: whether the run requires completion (``require_complete``).

    Returns:
        The ``RunRejectedError`` to raise, or ``None``.

    Raises:
        UsageError: a negative count.
    """
    if min(expected, completed, final_zero_rows) < 0:
        raise UsageError(
            f"completion_rejection: counts must be >= 0, got expected={expected}, completed={completed}, "
            f"final_zero_rows={final_zero_rows}"
        )
    if not strict:
        return None
    settled = completed + final_zero_rows
    if settled >= expected:
        return None
    unfinished = expected - settled
    done = f"{settled}/{expected} rollouts completed"
    if final_zero_rows:
        done += f" ({final_zero_rows} of them failures scored as zero)"
    if not can_retry:
        if settled > 0:
            return None
        return RunRejectedError(
            f"RUN REJECTED: {done}; none of the {expected} planned rollouts completed and none can be "
            "retried, so no score is published. Inspect the failures sidecars (`gym-ray status RUN_DIR`), "
            "fix the servers or inputs, then start a fresh run"
        )
    if made_progress:
        return RunRejectedError(
            f"RUN REJECTED: {done}; {unfinished} unfinished rollout(s) can still be retried, so no score "
            "is published yet. Resume the run (run the same config with the same run folder) to finish "
            "them; only the unfinished rollouts run again"
        )
    return RunRejectedError(
        f"RUN REJECTED: {done}; {unfinished} unfinished rollout(s) can still be retried, but this attempt "
        "saved no outcome that made progress, so another attempt as-is would not help. Inspect the "
        "failures (`gym-ray status RUN_DIR`) and the environment servers, fix the cause, then resume"
    )


def raise_for_completion_rejection(
    *,
    expected: int,
    completed: int,
    final_zero_rows: int = 0,
    can_retry: bool,
    made_progress: bool,
    strict: bool,
) -> None:
    """Raise the strict run's rejection, if any; see ``completion_rejection`` for the arguments.

    Raises:
        RunRejectedError: the run is rejected.
    """
    rejection = completion_rejection(
        expected=expected,
        completed=completed,
        final_zero_rows=final_zero_rows,
        can_retry=can_retry,
        made_progress=made_progress,
        strict=strict,
    )
    if rejection is not None:
        raise rejection
