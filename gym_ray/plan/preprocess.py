"""Preprocessing: from input rows to the stamped, repeated rows a run dispatches (PROTOCOL.md section 4).

Everything here runs before the first request: ``load_jsonl`` reads and checks an input file,
``iter_preprocess`` / ``preprocess_examples`` apply routing, ``agent_map``, ``fan_out``, ``num_repeats``,
seeds and ``task_ids``. Checking rows against the running config (``resolve_task_sources``,
``stamp_environment_agent_refs``, ``validate_rows``) lives in :mod:`gym_ray.plan.validation` and is
re-exported
here.

Memory promise: ``load_jsonl`` and ``iter_preprocess`` stream. ``iter_preprocess`` holds one input row at a
time plus two compact tables per *distinct task* (:mod:`gym_ray.plan._compact_index`): content digest ->
task index (about 17-25 bytes per task) and task index -> next rollout index (about 1-2 bytes per task while
task indices are dense; a dict entry for sparse caller-given ``_ng_task_index`` values), which identical-row
dedupe and the per-task rollout counter need. Planning a run (:mod:`gym_ray.plan.shards`) reads the input
twice and
numbers tasks on disk instead (``task_numbering``, :mod:`gym_ray.plan._spill_dedupe`), which leaves only
the 1-2 bytes per task of the counters. ``interleave_repeats`` is the exception: it reorders the whole
output, so it buffers it. Error reports list at most ``MAX_LISTED_ROWS`` rows per problem and count the
rest, so they stay bounded too.

Dedupe trade-off: a row's content digest is a 64-bit BLAKE2b digest (digest_size=8) of its canonical JSON, so
two *different* rows could share a task index if their digests collide. Among ``n`` distinct rows that
happens with probability about ``n**2 / 2**65``: 3e-8 for a million rows, 3e-4 for a hundred million.

Input rows are never mutated. Each input row is deep-copied once (planning from a file, whose parsed rows
nobody else sees, copies only the top level: ``from_json``); the copies of one task (its repeats and
fan-out targets) are separate top-level dicts that share nested values preprocessing does not write
(treat those as read-only). Nothing here is thread-safe; use one call per thread.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import orjson

from gym_ray import keys
from gym_ray.config.topology import Topology
from gym_ray.errors import ConfigError, InputError, RoutingError
from gym_ray.plan import _common_rows
from gym_ray.plan._compact_index import CompactIndex, DenseCounters
from gym_ray.plan.load import sorted_text
from gym_ray.plan.rows import (
    MAX_LISTED_ROWS,
    Problems,
    Row,
    SourceResolver,
    agent_of,
    bounded_listing,
    is_materialized_row,
    shape_problem,
    str_key,
    taskset_of,
    unresolved_error,
    where,
)
from gym_ray.plan.validation import resolve_task_sources, stamp_environment_agent_refs, validate_rows

# The row checks moved to gym_ray.plan.validation and gym_ray.plan.rows; they stay importable from here.
__all__ = [
    "MAX_LISTED_ROWS",
    "Row",
    "TaskNumbering",
    "is_materialized_row",
    "iter_preprocess",
    "preprocess_examples",
    "resolve_task_sources",
    "stamp_environment_agent_refs",
    "validate_rows",
]


class TaskNumbering(Protocol):
    """Numbers content digests for identical-row dedupe: ``add(digest)`` returns the digest's task index
    (the same index for the same digest, new digests numbered 0, 1, 2, ... in order of first sight).
    One whose ``ignores_keys`` is true (planning's second pass) gets 0: no digest is taken."""

    def add(self, key: int, /) -> int: ...


# --- row helpers --------------------------------------------------------------------------------


def _copy_json(value: Any) -> Any:
    """Deep copy of JSON-shaped data (objects become dicts, arrays lists); several times faster than
    ``copy.deepcopy``, which matters at one copy per input row."""
    if isinstance(value, dict | Mapping):
        return {key: _copy_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_copy_json(item) for item in value]
    return value


# --- preprocessing ------------------------------------------------------------------------------


def _check_fan_out(fan_out: Mapping[str, Any] | None) -> dict[str, tuple[str, ...]]:
    checked: dict[str, tuple[str, ...]] = {}
    for key, targets in (fan_out or {}).items():
        path = f"fan_out.{key}"
        if isinstance(targets, str) or not isinstance(targets, Sequence):
            raise ConfigError(f"{path} must be a list of agent names, got {targets!r}", key=path)
        if not targets:
            raise ConfigError(f"{path} is an empty list; name at least one agent or drop the key", key=path)
        if not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"{path} must list agent names (non-empty strings), got {targets!r}", key=path)
        if len(set(targets)) != len(targets):
            raise ConfigError(
                f"{path} lists the same agent more than once: {list(targets)!r}; list each agent once "
                "and use num_repeats for more rollouts",
                key=path,
            )
        checked[str(key)] = tuple(targets)
    return checked


def _check_count(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path} must be an integer >= 1, got {value!r}", key=path)
    return value


def _check_num_repeats(num_repeats: int | Mapping[str, int] | None) -> int | dict[str, int]:
    if num_repeats is None:
        return 1
    if isinstance(num_repeats, Mapping):
        return {str(k): _check_count(v, f"num_repeats.{k}") for k, v in num_repeats.items()}
    return _check_count(num_repeats, "num_repeats")


def _check_agent_map(agent_map: Mapping[str, Any] | None, topology: Topology | None) -> dict[str, str]:
    merged = dict(topology.agent_map) if topology is not None else {}
    for key, value in (agent_map or {}).items():
        if not isinstance(value, str) or not value:
            raise ConfigError(f"agent_map.{key} must be an agent name, got {value!r}", key=f"agent_map.{key}")
        merged[str(key)] = value
    return merged


def _check_task_ids(task_ids: Iterable[str | int] | None) -> set[str] | None:
    if task_ids is None:
        return None
    if isinstance(task_ids, str):
        raise ConfigError(f"task_ids must be a list of task ids, got the string {task_ids!r}", key="task_ids")
    selected: set[str] = set()
    for task_id in task_ids:
        if isinstance(task_id, bool) or not isinstance(task_id, str | int):
            raise ConfigError(f"task_ids entries must be strings or ints, got {task_id!r}", key="task_ids")
        selected.add(str(task_id))
    return selected


def _seeded_params(params: Mapping[str, Any], extra_body: dict[str, Any], seed: int) -> dict[str, Any]:
    metadata = dict(params.get(keys.METADATA) or {})
    metadata[keys.EXTRA_BODY] = json.dumps({**extra_body, "seed": seed})
    return {**params, keys.METADATA: metadata}


def _parse_extra_body(params: Mapping[str, Any]) -> dict[str, Any] | str:
    """The parsed ``metadata.extra_body`` object, or the problem text."""
    metadata = params.get(keys.METADATA)
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        return "has a responses_create_params.metadata that is not an object"
    body = metadata.get(keys.EXTRA_BODY)
    if body is None:
        return {}
    if isinstance(body, Mapping):
        return dict(body)
    if isinstance(body, str):
        try:
            parsed = json.loads(body or "{}")
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    return "has a responses_create_params.metadata.extra_body that is not a JSON object string"


class _Preprocessor:
    """One preprocessing pass: the checked knobs and the per-task counters."""

    def __init__(
        self,
        *,
        agent_map: Mapping[str, str] | None,
        fan_out: Mapping[str, Sequence[str]] | None,
        num_repeats: int | Mapping[str, int] | None,
        num_repeats_add_seed: bool,
        task_ids: Iterable[str | int] | None,
        responses_create_params: Mapping[str, Any] | None,
        topology: Topology | None,
        task_numbering: TaskNumbering | None = None,
        from_json: bool = False,
    ) -> None:
        self.topology = topology
        self.from_json = from_json
        self.agent_map = _check_agent_map(agent_map, topology)
        self.fan_out = _check_fan_out(fan_out)
        self.num_repeats = _check_num_repeats(num_repeats)
        self.add_seed = num_repeats_add_seed
        self.task_ids = _check_task_ids(task_ids)
        if responses_create_params is not None and not isinstance(responses_create_params, Mapping):
            raise ConfigError(
                f"responses_create_params must be an object, got {responses_create_params!r}",
                key="responses_create_params",
            )
        self.overrides = dict(responses_create_params or {})
        self.task_by_digest: TaskNumbering = task_numbering if task_numbering is not None else CompactIndex()
        numbering = self.task_by_digest
        self.number: Callable[[Mapping[str, Any]], int] = (
            (lambda _row: numbering.add(0)) if getattr(numbering, "ignores_keys", False) else self.task_index
        )
        self.next_rollout = DenseCounters()
        self.selected: set[tuple[str, str]] = set()
        self.keys_seen: set[str] = set()
        self.overridden: set[tuple[str, str]] = set()
        self.bad_rows = Problems()
        self.missing_repeats = Problems()
        self.resolver = SourceResolver(topology) if topology is not None else None
        self.envs = frozenset(topology.environment_servers()) if topology is not None else frozenset()
        self.unresolved = Problems()
        self.common: _common_rows.CommonRows | None = None
        repeats = self.num_repeats
        if _common_rows.ENABLED and from_json and isinstance(repeats, int) and self.knobs_keep_rows(topology):
            self.common = _common_rows.CommonRows(
                num_repeats=repeats,
                task_index=self.number,
                next_rollout=self.next_rollout,
                keys_seen=self.keys_seen,
            )

    def knobs_keep_rows(self, topology: Topology | None) -> bool:
        """True when no knob rewrites a flat row beyond its numbering (:mod:`._common_rows` applies)."""
        mode = topology.routing_mode if topology is not None else keys.ROUTING_AGENT
        return (
            mode == keys.ROUTING_AGENT
            and not (self.agent_map or self.fan_out or self.add_seed or self.overrides)
            and self.task_ids is None
        )

    def route(self, pos: int, row: Mapping[str, Any]) -> str | None:
        """The environment server chosen for ``row`` at preprocessing, or None (front of its agent)."""
        topology = self.topology
        taskset = taskset_of(row)
        if is_materialized_row(row):
            if topology is None:
                raise RoutingError(
                    f"row {pos} is a materialized task row of taskset '{taskset}', which routes by "
                    "environment_server_routes; pass global_config_dict= or topology= to preprocess it",
                    key=keys.ENVIRONMENT_SERVER_ROUTES,
                )
            try:
                return topology.env_server_for_taskset(str(taskset))
            except RoutingError as exc:
                raise RoutingError(f"{where(pos, row)}: {exc}", key=exc.key) from exc
        mode = topology.routing_mode if topology is not None else keys.ROUTING_AGENT
        if topology is not None and mode == keys.ROUTING_LEGACY:
            return topology.environment_server_name
        if mode == keys.ROUTING_TASKSET:
            raise RoutingError(
                f"{where(pos, row)} is a flat row, but environment_routing_mode=taskset routes only "
                "materialized task rows (task_id.taskset + task_input); use environment_routing_mode=agent "
                "to mix flat rows and tasksets",
                key=keys.ENVIRONMENT_ROUTING_MODE,
            )
        return str_key(row, keys.ENVIRONMENT_SERVER)

    def task_index(self, row: Mapping[str, Any]) -> int:
        canonical = _orjson_canonical(row) if self.from_json else None
        if canonical is None:
            text = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            canonical = text.encode("utf-8")
        digest = hashlib.blake2b(canonical, digest_size=8).digest()
        return self.task_by_digest.add(int.from_bytes(digest, "little"))

    def repeats_for(self, repeat_keys: list[str]) -> int | None:
        if isinstance(self.num_repeats, int):
            return self.num_repeats
        for key in repeat_keys:
            if key != keys.DEFAULT_KEY and key in self.num_repeats:
                return self.num_repeats[key]
        return self.num_repeats.get(keys.DEFAULT_KEY)

    def expand(self, pos: int, row: Any) -> list[Row]:
        """The output rows of input row ``pos`` (empty when it is skipped or bad)."""
        problem = shape_problem(row)
        if problem is not None:
            self.bad_rows.add(f"the row {problem}", pos)
            return []
        materialized = is_materialized_row(row)
        env = self.route(pos, row)
        agent, task_source = agent_of(row), str_key(row, keys.TASK_SOURCE)
        basis = (taskset_of(row) or task_source or env) if env is not None else (agent or task_source)
        # Rows just parsed from JSON are the pass's own: a top-level copy keeps them unmutated.
        base: Row = dict(row) if self.from_json else _copy_json(row)
        if env is None and self.agent_map:
            for key in (agent, task_source, keys.DEFAULT_KEY):
                if key is not None and key in self.agent_map:
                    mapped = self.agent_map[key]
                    if agent is not None and mapped != agent:
                        self.overridden.add((agent, mapped))
                    # As 0.7 does: a mapped row's agent_ref becomes exactly {"name": mapped}, also when
                    # it named that agent already (its other fields, e.g. "type", are dropped).
                    base[keys.AGENT_REF], agent = {"name": mapped}, mapped
                    break
        targets: Sequence[str | None]
        if env is not None:
            targets = [agent]
        elif basis is not None and basis in self.fan_out:
            targets = self.fan_out[basis]
        elif agent is not None or task_source is not None:
            targets = [agent]
        else:
            self.bad_rows.add(
                "the row names no agent: give it agent_ref or task_source, or pass agent_map with a "
                "'_default' entry",
                pos,
                row,
            )
            return []
        extra_body: dict[str, Any] | str = {}
        if materialized:
            for knob, value in (
                ("responses_create_params", self.overrides),
                ("num_repeats_add_seed", self.add_seed),
            ):
                if value:
                    raise ConfigError(
                        f"{knob} is not supported for materialized task rows ({where(pos, row)}); "
                        f"drop {knob} or run the materialized rows separately",
                        key=knob,
                    )
        else:
            base[keys.RESPONSES_CREATE_PARAMS] = {**base[keys.RESPONSES_CREATE_PARAMS], **self.overrides}
        task = row.get(keys.TASK_INDEX)
        if task is None:
            try:
                task = self.number(row)
            except (TypeError, ValueError) as exc:
                self.bad_rows.add(f"the row is not JSON-serializable ({exc})", pos)
                return []
        elif isinstance(task, bool) or not isinstance(task, int) or task < 0:
            self.bad_rows.add(f"the row's {keys.TASK_INDEX} must be an integer >= 0", pos, row)
            return []
        repeat_keys = [[k for k in dict.fromkeys((t, basis)) if k is not None] for t in targets]
        for group in repeat_keys:
            self.keys_seen.update(group)
        if self.task_ids is not None:
            selector = str(base[keys.TASK_ID][keys.TASK_ID]) if materialized else str(task)
            seen_key = (taskset_of(row) or "", selector) if materialized else ("", selector)
            if selector not in self.task_ids or seen_key in self.selected:
                return []
            self.selected.add(seen_key)
        base[keys.TASK_INDEX] = task
        if self.add_seed and not materialized:
            extra_body = _parse_extra_body(base[keys.RESPONSES_CREATE_PARAMS])
            if isinstance(extra_body, str):
                self.bad_rows.add(f"the row {extra_body}", pos, base)
                return []
        if env is not None:
            base[keys.ENVIRONMENT_SERVER] = env
        if targets == [None] and not self.give_agent(pos, base):
            return []
        out: list[Row] = []
        for target, group in zip(targets, repeat_keys, strict=True):
            count = self.repeats_for(group)
            if count is None:
                self.missing_repeats.add(f"routing keys {' / '.join(map(repr, group))}", pos, base)
                continue
            for _ in range(count):
                rollout = self.next_rollout.take(task)
                item = dict(base)
                if target is not None and target != agent_of(item):
                    item[keys.AGENT_REF] = {"name": target}
                item[keys.ROLLOUT_INDEX] = rollout
                if self.add_seed and isinstance(extra_body, dict):
                    item[keys.RESPONSES_CREATE_PARAMS] = _seeded_params(
                        item[keys.RESPONSES_CREATE_PARAMS], extra_body, rollout
                    )
                out.append(item)
        return out

    def give_agent(self, pos: int, base: Row) -> bool:
        """Give an agentless row its agent (task_source resolution, or the server's attributed agent)
        when a topology is known; False when its task_source does not resolve."""
        if self.topology is None or is_materialized_row(base):
            return True
        env = str_key(base, keys.ENVIRONMENT_SERVER)
        agent: str | None = None
        if env is not None:
            agent = self.topology.attributed_agent(env) if env in self.envs else None
        elif (source := str_key(base, keys.TASK_SOURCE)) is not None and self.resolver is not None:
            agent, problem = self.resolver.resolve(source)
            if agent is None:
                self.unresolved.add(f"'{source}': {problem}", pos, base)
                return False
        if agent is not None:
            base[keys.AGENT_REF] = {"name": agent}
        return True

    def finish(self) -> None:
        """Raise what the pass collected, or emit its warnings."""
        if self.bad_rows:
            raise InputError(
                self.bad_rows.message("Input rows cannot be preprocessed:", "Fix these rows and run again."),
                row=None,
            )
        if self.missing_repeats:
            listed = sorted(k for k in (self.num_repeats if isinstance(self.num_repeats, dict) else {}))
            raise ConfigError(
                self.missing_repeats.message(
                    "num_repeats has no entry for these rows and no '_default' fallback:",
                    f"Listed keys: {listed}. Add the keys or a '_default' entry.",
                ),
                key="num_repeats",
            )
        if self.unresolved:
            raise unresolved_error(self.unresolved)
        if self.task_ids is not None:
            found = {selector for _, selector in self.selected}
            missing = sorted(self.task_ids - found)
            if missing:
                raise ConfigError(
                    "task_ids names tasks the input does not contain: "
                    f"{bounded_listing(missing)}; select task ids "
                    "(task_id.task_id of materialized rows, else _ng_task_index) that are in the input",
                    key="task_ids",
                )
        if self.overridden:
            pairs = sorted(self.overridden)
            warnings.warn(
                f"agent_map overrode agent_ref values already present in the rows: {bounded_listing(pairs)}",
                UserWarning,
                stacklevel=3,
            )
        for knob, table in (("num_repeats", self.num_repeats), ("fan_out", self.fan_out)):
            unused = sorted(
                set(table if isinstance(table, dict) else ()) - self.keys_seen - {keys.DEFAULT_KEY}
            )
            if unused:
                warnings.warn(
                    f"{knob} keys never matched an input row (possible typo?): {bounded_listing(unused)}",
                    UserWarning,
                    stacklevel=3,
                )


def _orjson_canonical(row: Mapping[str, Any]) -> bytes | None:
    """Canonical JSON of a row parsed from JSON (sorted keys, compact), or None to use ``json``'s form.

    Several times faster than ``json.dumps(sort_keys=True)``. Which form a row gets depends only on its
    content (every row of a pass comes from one parser), so identical rows always share a digest: orjson
    refuses what it cannot encode exactly (integers past 64 bits, lone surrogates) and writes ``NaN`` /
    ``Infinity`` as ``null``, so any ``null`` sends the row to ``json``, which keeps them apart.
    """
    if (canonical := sorted_text(row)) is None:  # the reader's text of the row, when it made one
        try:
            canonical = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:
            return None
    return None if b"null" in canonical else canonical


def _topology_arg(global_config_dict: Mapping[str, Any] | None, topology: Topology | None) -> Topology | None:
    if global_config_dict is not None and topology is not None:
        raise ConfigError("pass global_config_dict or topology, not both", key="global_config_dict")
    if global_config_dict is not None:
        return Topology.from_config(global_config_dict)
    return topology


def iter_preprocess(
    examples: Iterable[Mapping[str, Any]],
    *,
    agent_map: Mapping[str, str] | None = None,
    fan_out: Mapping[str, Sequence[str]] | None = None,
    num_repeats: int | Mapping[str, int] | None = 1,
    num_repeats_add_seed: bool = False,
    interleave_repeats: bool = False,
    task_ids: Iterable[str | int] | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
    global_config_dict: Mapping[str, Any] | None = None,
    topology: Topology | None = None,
    task_numbering: TaskNumbering | None = None,
    from_json: bool = False,
) -> Iterator[Row]:
    """Stream the rows a run dispatches; the streaming form of :func:`preprocess_examples`.

    Same arguments and rules as :func:`preprocess_examples`. Rows are yielded as they are produced, and
    problems found in individual rows are raised together when the input is exhausted: a caller that gets
    an error from this iterator must discard what it already received. Bad knobs raise here, at the call;
    a taskset without a route raises when its row is reached. Memory: see the module docstring.

    ``task_numbering`` replaces the in-memory digest table that numbers tasks (see
    :class:`TaskNumbering`); planning passes the two-pass on-disk form of
    :mod:`gym_ray.plan._spill_dedupe` so that its memory does not grow with the input.

    ``from_json=True`` says the examples were just parsed from JSON (:func:`load_jsonl`: plain dicts and
    lists, string keys) and the caller never reads them again: each output row is then a top-level copy
    of its input row sharing nested values (no deep copy), and content digests take a faster encoder.
    The rows yielded are the same.
    """
    state = _Preprocessor(
        agent_map=agent_map,
        fan_out=fan_out,
        num_repeats=num_repeats,
        num_repeats_add_seed=num_repeats_add_seed,
        task_ids=task_ids,
        responses_create_params=responses_create_params,
        topology=_topology_arg(global_config_dict, topology),
        task_numbering=task_numbering,
        from_json=from_json,
    )
    return _interleaved(state, examples) if interleave_repeats else _in_order(state, examples)


def _in_order(state: _Preprocessor, examples: Iterable[Mapping[str, Any]]) -> Iterator[Row]:
    if state.common is None:
        for pos, row in enumerate(examples):
            yield from state.expand(pos, row)
    else:
        common = state.common.expand
        for pos, row in enumerate(examples):
            out = common(row)
            yield from state.expand(pos, row) if out is None else out
    state.finish()


def _interleaved(state: _Preprocessor, examples: Iterable[Mapping[str, Any]]) -> Iterator[Row]:
    # A stable sort by rollout index: every task's rollout 0, then every rollout 1, ...
    rounds: dict[int, list[Row]] = {}
    for pos, row in enumerate(examples):
        for item in state.expand(pos, row):
            rounds.setdefault(item[keys.ROLLOUT_INDEX], []).append(item)
    state.finish()
    for rollout in sorted(rounds):
        yield from rounds.pop(rollout)


def preprocess_examples(
    examples: Iterable[Mapping[str, Any]],
    *,
    agent_map: Mapping[str, str] | None = None,
    fan_out: Mapping[str, Sequence[str]] | None = None,
    num_repeats: int | Mapping[str, int] | None = 1,
    num_repeats_add_seed: bool = False,
    interleave_repeats: bool = False,
    task_ids: Iterable[str | int] | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
    global_config_dict: Mapping[str, Any] | None = None,
    topology: Topology | None = None,
) -> list[Row]:
    """Apply run-level routing and repetition to rows; return the stamped, repeated copies.

    Per input row, in order (PROTOCOL.md section 4): choose the environment route (a materialized row by
    ``environment_server_routes[taskset]``; ``legacy`` mode: ``environment_server_name``; a row's own
    ``_ng_environment_server`` stamp is kept) -> routing key (agent name, else ``task_source``; for routed
    rows the taskset, task_source or server) -> ``agent_map`` (unrouted flat rows only: the agent name,
    then ``task_source``, then ``_default``; replacing a row's own agent warns) -> targets (``fan_out`` for
    the routing key wins, else the agent, else ``task_source`` resolution) -> run-level
    ``responses_create_params`` merged over the row's (shallow, the override wins) -> task index (rows
    with identical canonical JSON share one; a caller's ``_ng_task_index`` is kept) -> ``task_ids``
    selection (each selected task once) -> environment stamp -> ``num_repeats`` copies per target, with
    one rollout counter per task across targets and duplicate rows -> optional seed (the rollout index)
    in ``responses_create_params.metadata.extra_body``, a JSON string. With a topology, task_source-only
    rows then get their agent (:func:`resolve_task_sources`) and routed agentless rows the server's
    attributed agent (:func:`stamp_environment_agent_refs`).

    Args:
        examples: Input rows (never mutated).
        agent_map: ``{agent or task_source: agent}``, ``_default`` allowed; merged over the config's own.
        fan_out: ``{routing key: [agents]}``; each row with that key runs on every listed agent.
        num_repeats: Copies per target: an int >= 1, or ``{target or routing key: int}`` with an optional
            ``_default``. A task_source-only row matches only its task_source key.
        num_repeats_add_seed: Stamp ``seed`` = rollout index into ``metadata.extra_body``.
        interleave_repeats: Emit every task's rollout 0, then every rollout 1, ... (a stable sort by
            rollout index) instead of each task's rollouts together.
        task_ids: Keep only these tasks: ``task_id.task_id`` of materialized rows, else the task index
            (compared as strings). An id that matches no row is an error.
        responses_create_params: Run-level overrides (flat rows only).
        global_config_dict: The merged config, to route materialized rows, honour ``routing_mode`` and
            resolve agents. Mutually exclusive with ``topology``.
        topology: The same, already built.

    Returns:
        The expanded rows, in input order with each task's rollouts together (or interleaved).

    Raises:
        ConfigError: A bad knob (``num_repeats`` < 1, empty or duplicate ``fan_out`` list, a dict
            ``num_repeats`` without an entry for some rows, unknown ``task_ids``, knobs that materialized
            rows do not support). RoutingError: a row cannot be routed. InputError: rows that are not
            valid rows or name no agent, all listed. ValidationError: task_sources that do not resolve.

    Example:
        >>> preprocess_examples(
        ...     [{"responses_create_params": {"input": "2+2?"}, "agent_ref": {"name": "math_agent"}}],
        ...     num_repeats=2,
        ... )[1]["_ng_rollout_index"]
        1
    """
    return list(
        iter_preprocess(
            examples,
            agent_map=agent_map,
            fan_out=fan_out,
            num_repeats=num_repeats,
            num_repeats_add_seed=num_repeats_add_seed,
            interleave_repeats=interleave_repeats,
            task_ids=task_ids,
            responses_create_params=responses_create_params,
            global_config_dict=global_config_dict,
            topology=topology,
        )
    )
