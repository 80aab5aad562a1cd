"""The request side of aggregation (stripping, grouping by server, spools, body files) and the file writer.

``group_results`` streams results into ``Grouping``: each persisted success is attributed to its
environment server, stripped (``strip_for_aggregation``) and appended to that server's spool.
``ServerSpools`` keeps each environment server's stripped results as compact JSON lines in a private
folder (``.aggregate-XXXXXX``, created beside the metrics file on the first line and removed by
``remove()``), so memory does not grow with the number of results. Each line is ``"<task> <rollout> "``
followed by the JSON text; the key prefix lets a spool whose lines did not arrive in (task, rollout)
order be sorted without parsing the JSON. ``write_body`` turns a spool into the file
``{"verify_responses":[...]}`` (the JSON value ``ServerClient.post_json`` would send for the list): an
ordered spool is streamed line by line; an unordered one is sorted in memory (that server's lines only;
the sort is stable, so equal keys keep their arrival order).

The reply side: ``ServerSpools.reply_path`` names the file a server's reply is streamed to;
``read_reply`` reads it with ``json_stream.iter_object``: the small members are kept, and each element of
``group_level_metrics`` / ``repeat_level_metrics`` is encoded at once as the metrics file will hold it
(indent 2, shifted to its nesting level) and appended to a per-server fragment file, so memory does not
grow with the number of tasks. ``write_metrics_atomic`` writes the metrics file entry by entry, copying
the fragments in chunks: byte for byte NeMo Gym 0.7's ``orjson.dumps(entries, option=OPT_INDENT_2)`` (no
newline at the end) with each fragment's list in place, through ``atomic_writer`` (temp file, fsync,
rename, fsync of the folder).

Concurrency: one ``ServerSpools`` is filled (``add``, ``finish``) from one thread; afterwards
``write_body`` may run for several servers at once in several threads (each touches only its own
server's files), and so may ``read_reply``. ``run_joined`` runs blocking work
in a worker thread and, when the awaiting task is cancelled, asks the work to stop (a
``threading.Event`` the work checks between rows or chunks) and waits for the thread before the
cancellation propagates, so nothing writes into the spool folder after its owner has moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from gym_ray import keys
from gym_ray.errors import (
    GymRayError,
    InputError,
    InternalError,
    RecordError,
    ServerResponseError,
    ValidationError,
)
from gym_ray.finalize._aggregate_fragments import STOP_CHECK_ROWS, FragmentWriter, Stopped, indented
from gym_ray.finalize.json_stream import EXCERPT_BYTES, StreamedList, iter_object
from gym_ray.plan.rows import MAX_LISTED_ROWS
from gym_ray.record.atomic import atomic_writer

if TYPE_CHECKING:
    from gym_ray.config.topology import Topology

__all__ = [
    "STOP_CHECK_ROWS",
    "STREAMED_REPLY_KEYS",
    "Fragment",
    "Grouping",
    "ReplyParts",
    "ServerSpools",
    "Stopped",
    "group_results",
    "run_joined",
    "strip_for_aggregation",
    "write_metrics_atomic",
]

logger = logging.getLogger("gym_ray.finalize.aggregate")

_T = TypeVar("_T")
_Encode = Callable[[Any], bytes]
# The settings of ServerClient.post_json's encoder, so a body file holds the bytes post_json would send.
_COMPACT = json.JSONEncoder(separators=(",", ":"))
_BUFFER_BYTES = 1 << 20
_BODY_HEAD = b'{"verify_responses":['
_BODY_TAIL = b"]}"
#: Reply members streamed element by element (one element per task or repeat: they grow with the run).
STREAMED_REPLY_KEYS = ("group_level_metrics", "repeat_level_metrics")
#: Reply bytes decoded at a time: the reader's buffer is a few times this, whatever the reply's size.
_REPLY_CHUNK_BYTES = 1 << 18
_MEMBER_INDENT = " " * 4
_HEAVY = frozenset(keys.HEAVY_RESULT_KEYS)  # one hash lookup per key instead of five comparisons
_INDENTED = json.JSONEncoder(indent=2, ensure_ascii=False, allow_nan=False)


async def run_joined(work: Callable[[threading.Event], _T]) -> _T:
    """Run ``work(stop)`` in the default executor; on cancellation set ``stop`` and join the thread.

    Args:
        work: blocking work; it should check ``stop.is_set()`` regularly and raise ``Stopped``.

    Returns:
        What ``work`` returned.

    Raises:
        Exception: whatever ``work`` raised.
        asyncio.CancelledError: the caller was cancelled (after the thread finished, unless the join
            itself was cancelled again).
    """
    stop = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(None, work, stop)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait({future})
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what propagates
        raise


def strip_for_aggregation(result: Mapping[str, Any]) -> dict[str, Any]:
    """The copy of a result that ``/aggregate_metrics`` receives.

    Drops ``keys.HEAVY_RESULT_KEYS`` (``response``, ``responses_create_params``, ``ng_trajectory``,
    ``ng_model_call_capture``, ``ng_agent_observations``), then puts back ``response.usage`` and
    ``response.incomplete_details`` when they are present and not ``None``. Every other key, including
    ``ng_perf`` and the ``_ng_*`` identity keys, stays. The input is not modified.
    """
    stripped = {k: v for k, v in result.items() if k not in _HEAVY}
    response = result.get(keys.RESPONSE)
    if isinstance(response, Mapping):
        kept = {k: response[k] for k in keys.KEPT_RESPONSE_KEYS if response.get(k) is not None}
        if kept:
            stripped[keys.RESPONSE] = kept
    return stripped


def _sort_key(row: Mapping[str, Any]) -> tuple[int, int]:
    task = row.get(keys.TASK_INDEX)
    rollout = row.get(keys.ROLLOUT_INDEX)
    return (task if isinstance(task, int) else 0, rollout if isinstance(rollout, int) else 0)


def _agent_name(row: Mapping[str, Any]) -> str | None:
    ref = row.get(keys.AGENT_REF)
    if isinstance(ref, Mapping):
        name = ref.get("name")
        if isinstance(name, str):
            return name
    return None


def _row_label(row: Mapping[str, Any], position: int) -> str:
    return f"result #{position} (task {row.get(keys.TASK_INDEX)}, rollout {row.get(keys.ROLLOUT_INDEX)})"


class Grouping:
    """Streams results into per-server spools of stripped entries; remembers the first agent per server.

    Rows that cannot be grouped are collected (not raised one by one) so that one error lists them all.
    A row that cannot be encoded as JSON becomes its server's error (that server is not called).
    """

    def __init__(self, topology: Topology, spools: ServerSpools, stop: threading.Event) -> None:
        self._topology = topology
        self._spools = spools
        self._stop = stop
        self._known = set(topology.environment_servers())
        # Configs without environment servers: an agent is its own front (PROTOCOL.md section 1).
        for agent in topology.agents():
            with contextlib.suppress(GymRayError):
                if topology.front_of(agent) == agent:
                    self._known.add(agent)
        self.counts: dict[str, int] = {}
        self.first_agent: dict[str, str | None] = {}
        self.errors: dict[str, InputError] = {}
        self._unknown: dict[str, str] = {}  # unknown stamp -> first row that carries it
        self._unattributable: list[str] = []
        self._unattributable_count = 0
        #: Records added through ``group_more`` so far (the position of the next one).
        self.positions = 0

    def watch(self, stop: threading.Event) -> None:
        """Check ``stop`` from now on (a grouping carried on by another caller)."""
        self._stop = stop

    def add(self, result: Mapping[str, Any], position: int, encode: _Encode | None = None) -> None:
        if position % STOP_CHECK_ROWS == 0 and self._stop.is_set():
            raise Stopped
        if result.get(keys.NO_PERSIST) or result.get(keys.FAILURE_CLASS) is not None:
            return  # only persisted successes are aggregated
        server = self._server_of(result, position)
        if server is None:
            return
        if server not in self.counts:
            agent = _agent_name(result)
            if agent is None and server in self._topology.environment_servers():
                agent = self._topology.attributed_agent(server)
            self.counts[server] = 0
            self.first_agent[server] = agent
        self.counts[server] += 1
        if server in self.errors:
            return
        try:
            self._spools.add(server, _sort_key(result), strip_for_aggregation(result), encode=encode)
        except (TypeError, ValueError) as exc:
            self._spools.discard(server)
            self.errors[server] = InputError(
                f"{_row_label(result, position)} cannot be sent to /aggregate_metrics of {server!r}: it "
                f"is not JSON-serialisable ({exc}); results must hold plain dicts/lists/str/int/float/"
                "bool/None",
                row=position,
            )

    def _server_of(self, result: Mapping[str, Any], position: int) -> str | None:
        stamp = result.get(keys.ENVIRONMENT_SERVER)
        if stamp is not None:
            if isinstance(stamp, str) and stamp in self._known:
                return stamp
            self._unknown.setdefault(str(stamp), _row_label(result, position))
            return None
        agent = _agent_name(result)
        try:
            if agent is not None:
                return self._topology.front_of(agent)
            # Materialized task rows carry no agent: their taskset's route (or legacy mode's server).
            return self._topology.environment_server_for_row(result)
        except GymRayError as exc:
            self._unattributable_count += 1
            if len(self._unattributable) < MAX_LISTED_ROWS:
                self._unattributable.append(f"{_row_label(result, position)}: {exc}")
            return None

    def raise_problems(self) -> None:
        if self._unknown:
            names = ", ".join(repr(name) for name in self._unknown)
            first = "; ".join(f"{name!r} first at {row}" for name, row in self._unknown.items())
            raise ValidationError(
                f"Result rows are stamped with environment server {names}, which is not in the running "
                f"config (available: {sorted(self._known)}); aggregate with the config that produced "
                f"them ({first})",
                problems=[
                    f"{row}: {keys.ENVIRONMENT_SERVER}={name!r}" for name, row in self._unknown.items()
                ],
            )
        if self._unattributable:
            more = self._unattributable_count - len(self._unattributable)
            raise ValidationError(
                f"{self._unattributable_count} result row(s) have no {keys.ENVIRONMENT_SERVER} stamp and "
                "cannot be attributed to an environment server; aggregate results recorded by gym_ray "
                "(they carry the stamp), or give the rows agent_ref.name: "
                + " | ".join(self._unattributable)
                + (f" | ... and {more} more" if more else ""),
                problems=list(self._unattributable),
            )


def group_results(
    results: Iterable[Mapping[str, Any]], topology: Topology, spools: ServerSpools, stop: threading.Event
) -> Grouping:
    """Group ``results`` into ``spools`` (then finished); raise the rows that cannot be grouped.

    Raises:
        ValidationError: unknown stamps or unattributable rows (every one listed).
        RecordError: a spool cannot be written.
        Stopped: ``stop`` was set.
    """
    grouping = Grouping(topology, spools, stop)
    for position, result in enumerate(results):
        grouping.add(result, position)
    spools.finish()
    grouping.raise_problems()
    return grouping


class _Spool:
    __slots__ = ("body", "handle", "in_order", "last_key", "path")

    def __init__(self, path: Path, body: Path, handle: BinaryIO) -> None:
        self.path = path
        self.body = body
        self.handle: BinaryIO | None = handle
        self.last_key: tuple[int, int] | None = None
        self.in_order = True


@dataclass(frozen=True)
class Fragment:
    """A streamed list of a reply, its elements encoded as the metrics file holds them, in a file."""

    path: Path
    count: int


@dataclass
class ReplyParts:
    """A reply read by ``ServerSpools.read_reply``: its small members, its streamed lists, an excerpt."""

    members: dict[str, Any] = field(default_factory=dict)
    fragments: dict[str, Fragment] = field(default_factory=dict)
    excerpt: str = ""


class ServerSpools:
    """Per-server spool files of compact JSON lines in a private folder beside the metrics file.

    Args:
        parent: the folder of the metrics file; the spool folder is created inside it (and ``parent``
            itself, when missing) when the first line is added.
    """

    def __init__(self, parent: Path) -> None:
        self._parent = parent
        self._folder: Path | None = None
        self._spools: dict[str, _Spool] = {}
        self._created = 0

    @property
    def folder(self) -> Path | None:
        """The spool folder, or ``None`` before the first line."""
        return self._folder

    def add(
        self, server: str, key: tuple[int, int], value: Mapping[str, Any], *, encode: _Encode | None = None
    ) -> None:
        """Append ``value`` to ``server``'s spool under its (task, rollout) ``key``.

        ``encode`` gives its compact JSON text when set (the same JSON value as ``post_json``'s encoder).

        Raises:
            TypeError, ValueError: ``value`` is not JSON-serialisable (nothing is written).
            RecordError: the spool cannot be written.
        """
        text = _COMPACT.encode(value).encode() if encode is None else encode(value)
        line = b"%d %d %s\n" % (key[0], key[1], text)
        spool = self._spools.get(server)
        try:
            if spool is None:
                folder = self._make_folder()
                self._created += 1
                path = folder / f"{self._created}-spool.jsonl"
                body = folder / f"{self._created}-body.json"
                spool = self._spools[server] = _Spool(path, body, path.open("wb", buffering=_BUFFER_BYTES))
            if spool.handle is None:
                raise InternalError(f"aggregation spool of {server!r}: add() after finish()")
            spool.handle.write(line)
        except OSError as exc:
            raise self._error("write", exc) from exc
        if spool.last_key is not None and key < spool.last_key:
            spool.in_order = False
        spool.last_key = key

    def discard(self, server: str) -> None:
        """Forget ``server``'s spool (its lines will not be sent)."""
        spool = self._spools.pop(server, None)
        if spool is not None:
            try:
                if spool.handle is not None:
                    spool.handle.close()
                spool.path.unlink(missing_ok=True)
            except OSError as exc:
                raise self._error("write", exc) from exc

    def finish(self) -> None:
        """Flush and close every spool; call once, after the last ``add``.

        Raises:
            RecordError: a spool cannot be flushed.
        """
        for spool in self._spools.values():
            handle, spool.handle = spool.handle, None
            if handle is not None:
                try:
                    handle.close()
                except OSError as exc:
                    raise self._error("write", exc) from exc

    def write_body(self, server: str, stop: threading.Event) -> Path:
        """Write ``{"verify_responses":[...]}`` of ``server``'s lines, sorted by key; drop the spool.

        Returns:
            The body file (inside the spool folder).

        Raises:
            Stopped: ``stop`` was set.
            RecordError: the spool cannot be read or the body file cannot be written.
        """
        spool = self._spools[server]
        body = spool.body
        try:
            with (
                spool.path.open("rb", buffering=_BUFFER_BYTES) as source,
                body.open("wb", buffering=_BUFFER_BYTES) as target,
            ):
                target.write(_BODY_HEAD)
                separator = b""
                for count, line in enumerate(source if spool.in_order else _sorted_lines(source)):
                    if count % STOP_CHECK_ROWS == 0 and stop.is_set():
                        raise Stopped
                    target.write(separator)
                    target.write(line.split(b" ", 2)[2].rstrip(b"\n"))
                    separator = b","
                target.write(_BODY_TAIL)
            spool.path.unlink()
        except OSError as exc:
            raise self._error("read or write", exc) from exc
        return body

    def reply_path(self, server: str) -> Path:
        """The file ``server``'s reply is to be streamed to (inside the spool folder)."""
        body = self._spools[server].body
        return body.with_name(body.name.replace("-body.json", "-reply.json"))

    def read_reply(
        self, server: str, stop: threading.Event, *, keep: Collection[str], what: str, hint: str
    ) -> ReplyParts:
        """Read ``server``'s reply file: stream ``STREAMED_REPLY_KEYS`` into fragments; delete the reply.

        Args:
            server: the server whose ``reply_path`` holds the reply.
            stop: set when the caller was cancelled.
            keep: the members to keep (others are read and dropped). A streamed key whose value is not
                a list (``null``, an object, ...) is kept as it is, for the caller to validate.
            what: names the reply in error messages.
            hint: what to do, appended to error messages.

        Returns:
            The kept members (a repeated key: the last value, as ``json.loads``), the fragments of the
            streamed lists present, and the first ``EXCERPT_BYTES`` bytes of the reply.

        Raises:
            ServerResponseError: the reply is not one JSON object, an element of a streamed list is not
                an object or holds NaN/infinity, or a streamed key appears twice.
            Stopped: ``stop`` was set.
            RecordError: the reply cannot be read or a fragment cannot be written.
        """
        reply = self.reply_path(server)
        prefix = reply.name.removesuffix("-reply.json")
        writers = {
            key: FragmentWriter(key, reply.with_name(f"{prefix}-{key}.part"), stop, what, hint)
            for key in STREAMED_REPLY_KEYS
        }
        parts = ReplyParts()
        try:
            with reply.open("rb") as handle:
                parts.excerpt = handle.read(EXCERPT_BYTES).decode("utf-8", errors="replace")
            try:
                members = iter_object(
                    reply, streamed=writers, what=what, hint=hint, chunk_bytes=_REPLY_CHUNK_BYTES
                )
                for key, value in members:
                    writer = writers.get(key)
                    if writer is not None:
                        if writer.done:
                            raise ServerResponseError(f"{what} that names {key!r} twice; {hint}")
                        writer.done = True
                        if isinstance(value, StreamedList):
                            parts.fragments[key] = Fragment(writer.path, value.count)
                            continue
                    if key in keep:
                        parts.members[key] = value
            except ServerResponseError as exc:
                exc.body_excerpt = parts.excerpt
                raise
            finally:
                for writer in writers.values():
                    if writer.handle is not None:
                        writer.handle.close()
            reply.unlink()
        except OSError as exc:
            raise self._error("read or write", exc) from exc
        return parts

    def remove(self) -> None:
        """Close every spool and delete the folder; a failure is logged, not raised (it is cleanup)."""
        folder, self._folder = self._folder, None
        spools, self._spools = list(self._spools.values()), {}
        for spool in spools:
            handle, spool.handle = spool.handle, None
            try:
                if handle is not None:
                    handle.close()
            except OSError:
                logger.warning("cannot close the aggregation spool %s", spool.path, exc_info=True)
        if folder is not None:
            try:
                shutil.rmtree(folder)
            except OSError:
                logger.warning("cannot remove the aggregation spool folder %s", folder, exc_info=True)

    def _make_folder(self) -> Path:
        if self._folder is None:
            self._parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(dir=self._parent, prefix=".aggregate-"))
        return self._folder

    def _error(self, action: str, exc: OSError) -> RecordError:
        where = self._folder if self._folder is not None else self._parent
        return RecordError(
            f"cannot {action} the aggregation spool in {where}: {exc}; free space or fix permissions "
            "there (it sits beside the metrics file), then run `gym-ray aggregate RUN_DIR CONFIG` again"
        )


def _sorted_lines(source: BinaryIO) -> list[bytes]:
    keyed = []
    for line in source:
        task, rollout, _ = line.split(b" ", 2)
        keyed.append(((int(task), int(rollout)), line))
    keyed.sort(key=lambda pair: pair[0])  # stable: equal keys keep their arrival order
    return [line for _, line in keyed]


class _Chunks:
    """Text written in encoded chunks of about ``_BUFFER_BYTES``."""

    def __init__(self, handle: BinaryIO, stop: threading.Event) -> None:
        self.handle, self.stop = handle, stop
        self.pending: list[str] = []
        self.size = 0

    def write(self, text: str) -> None:
        self.pending.append(text)
        self.size += len(text)
        if self.size >= _BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.stop.is_set():
            raise Stopped
        self.handle.write("".join(self.pending).encode("utf-8"))
        self.pending.clear()
        self.size = 0

    def copy(self, source: Path) -> None:
        self.flush()
        with source.open("rb") as handle:
            while chunk := handle.read(_BUFFER_BYTES):
                if self.stop.is_set():
                    raise Stopped
                self.handle.write(chunk)


def write_metrics_atomic(path: Path, entries: Sequence[Mapping[str, Any]], stop: threading.Event) -> None:
    """Replace ``path`` with ``orjson.dumps(entries, option=OPT_INDENT_2)``: NeMo Gym 0.7's metrics file.

    No newline at the end, numbers as orjson writes them (``1e-5``, where ``json`` writes ``1e-05``), as
    0.7 writes the file (``_aggregate_fragments.indented``). NaN and infinity are refused (as ``json``'s
    ``allow_nan=False``); an integer beyond 64 bits, which orjson cannot write (0.7 fails there), is
    written as ``json`` writes it.

    The entries are dicts; their values are JSON values or ``Fragment``s (a list of objects, already
    encoded at its nesting level by ``read_reply``), written as the list they hold. The text is written in
    chunks of about 1 MiB (fragments copied), never held whole; ``path``'s folder is created when missing.
    On any error (or ``stop``) the temp file is removed and ``path`` is untouched.

    Raises:
        OSError: creating, reading a fragment, writing, syncing or renaming failed.
        ValueError: a value holds NaN/infinity or is not JSON-serialisable.
        Stopped: ``stop`` was set.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path) as handle:
        out = _Chunks(handle, stop)
        out.write("[" if entries else "[]")
        for index, entry in enumerate(entries):
            out.write(",\n  {" if index else "\n  {")
            for position, (key, value) in enumerate(entry.items()):
                out.write(",\n" if position else "\n")
                out.write(f"{_MEMBER_INDENT}{indented(key).decode()}: ")
                if not isinstance(value, Fragment):
                    out.write(indented(value).decode().replace("\n", "\n" + _MEMBER_INDENT))
                elif value.count == 0:
                    out.write("[]")
                else:
                    out.write("[\n")
                    out.copy(value.path)
                    out.write(f"\n{_MEMBER_INDENT}]")
            out.write("\n  }" if entry else "}")
        out.write("\n]" if entries else "")
        out.flush()
