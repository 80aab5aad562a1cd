"""Config loading: YAML files and CLI overrides merged by OmegaConf, then run settings as a pydantic model.

``load_config(paths, overrides)`` is the one place a run's global config is assembled: every YAML file in
order (later files win), then every override (``key=value`` changes an existing key, ``+key=value`` adds a
new one, ``++key=value`` adds or changes), then interpolations are resolved and a plain dict comes back.
``RunSettings.from_config(cfg)`` reads the top-level run knobs from that dict once, at the edge; server
instances and routing keys are read by :class:`gym_ray.config.topology.Topology`.

Every failure is a :class:`~gym_ray.errors.ConfigError` naming the file and line, the override, or the
dotted key, with the bad value and what is allowed. Nothing here does I/O other than reading the files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pydantic
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gym_ray import keys
from gym_ray.config._hydra import FlowSyntaxError, parse_flow_value
from gym_ray.config._paths import PATH_SETTINGS, check_path_setting, check_store_folder_alone
from gym_ray.errors import ConfigError

__all__ = [
    "CONFIG_PATHS",
    "RunSettings",
    "load_config",
    "merge_config",
    "resolve_config",
    "run_concurrency_cap",
]

#: The key that names more YAML files to merge under the config (NeMo Gym's ``config_paths``).
CONFIG_PATHS = "config_paths"

_ADD = "+"
_FORCE = "++"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load_file(path: Path) -> DictConfig:
    """One YAML file as a DictConfig; any problem is a ConfigError naming the file (and line)."""
    if not path.is_file():
        where = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file '{path}' {where}; pass the path of a YAML file")
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.context_mark is not None and exc.problem:
            problem += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise ConfigError(f"config file '{path}'{line}: {problem}; fix the YAML there") from exc
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or None
        where = f" at key '{key}'" if key else ""
        raise ConfigError(
            f"config file '{path}'{where}: {_first_line(exc)}; fix the value there", key=key
        ) from exc
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {_first_line(exc)}") from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"config file '{path}' holds a {type(loaded).__name__} at the top level; a config file must be "
            "a mapping of keys (e.g. 'head_server: {host: 127.0.0.1, port: 11000}')"
        )
    return loaded


def _kind_conflict(old: Any, new: Any, prefix: str = "") -> str | None:
    """The first dotted key where ``new`` puts a mapping over a list or a list over a mapping."""
    for key, value in new.items() if isinstance(new, dict) and isinstance(old, dict) else ():
        path = f"{prefix}{key}"
        if key in old:
            before = old[key]
            if isinstance(before, dict) != isinstance(value, dict) and (
                isinstance(before, list) or isinstance(value, list)
            ):
                return path
            found = _kind_conflict(before, value, f"{path}.")
            if found is not None:
                return found
    return None


def _exists(container: Any, parts: list[str]) -> bool:
    """True when the dotted path is present in a plain container (a ``???`` value counts as present)."""
    node = container
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _parse_override(override: str) -> tuple[str, str, Any]:
    """``(mode, key, value)`` of ``[+|++]key=value``; the value is read as YAML (OmegaConf's loader)."""
    form = "write key=value (change), +key=value (add) or ++key=value (add or change)"
    if not isinstance(override, str):
        raise ConfigError(f"override {override!r} is not a string; {form}")
    mode = _FORCE if override.startswith(_FORCE) else _ADD if override.startswith(_ADD) else ""
    body = override[len(mode) :]
    key, sep, text = body.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not part or part != part.strip() for part in parts):
        raise ConfigError(f"override {override!r} is malformed; {form}, with a dotted key", key=key or None)
    if key.startswith(("+", "~")):
        raise ConfigError(f"override {override!r} has an unknown prefix; {form}", key=key)
    if text.lstrip().startswith(("{", "[")):
        # Hydra's flow syntax ({_default:X}, [a,b]), which YAML would read as something else.
        try:
            return mode, key, parse_flow_value(text.strip())
        except FlowSyntaxError as exc:
            raise ConfigError(
                f"override {override!r} has a value that does not parse ({exc}); write e.g. "
                f"{mode}{key}={{a:1,b:2}} or {mode}{key}=[x,y], quoting values that hold , ] or }}",
                key=key,
            ) from exc
    try:
        holder = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) and exc.problem else _first_line(exc)
        raise ConfigError(
            f"override {override!r} has a value that is not valid YAML ({problem}); quote it, "
            f"e.g. {mode}{key}='...'",
            key=key,
        ) from exc
    assert isinstance(holder, dict)
    return mode, key, holder["value"]


def _apply_override(cfg: DictConfig, override: str) -> None:
    mode, key, value = _parse_override(override)
    present = _exists(OmegaConf.to_container(cfg, resolve=False), key.split("."))
    if key == CONFIG_PATHS:
        mode = _FORCE  # NeMo Gym users write config_paths=[...] with or without a +
    if mode == "" and not present:
        raise ConfigError(
            f"override {override!r} changes '{key}', which is not in the config; to add it write "
            f"+{override} (or ++{override} to add or change)",
            key=key,
        )
    if mode == _ADD and present:
        raise ConfigError(
            f"override {override!r} adds '{key}', which is already in the config; to change it write "
            f"{override[1:]} (or +{override} to add or change)",
            key=key,
        )
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)
    except (OmegaConfBaseException, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"override {override!r} cannot be applied: {_first_line(exc)}; check that every part of '{key}' "
            "but the last names a mapping",
            key=key,
        ) from exc


def _merge_files(paths: Sequence[str | os.PathLike[str]]) -> DictConfig:
    merged: DictConfig = OmegaConf.create({})
    for path in paths:
        part = _load_file(Path(path))
        try:
            merged = cast(DictConfig, OmegaConf.merge(merged, part))
        except (OmegaConfBaseException, TypeError, ValueError) as exc:
            key = _kind_conflict(
                OmegaConf.to_container(merged, resolve=False), OmegaConf.to_container(part, resolve=False)
            )
            raise ConfigError(
                f"config file '{path}' does not merge onto the files before it at '{key}': "
                f"{_first_line(exc)}; make the value's kind (mapping, list, scalar) agree",
                key=key,
            ) from exc
    return merged


def _config_paths(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError(
            f"{CONFIG_PATHS} in {where} must be a list of YAML paths, got {value!r}; write "
            f"+{CONFIG_PATHS}=[a.yaml,b.yaml]",
            key=CONFIG_PATHS,
        )
    return list(value)


def _plain(cfg: DictConfig) -> dict[str, Any]:
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))


def _included_files(top: DictConfig) -> list[str]:
    """The files ``config_paths`` names, transitively (each file's own ``config_paths`` after it)."""
    found: list[str] = []
    queue = _config_paths(_plain(top).get(CONFIG_PATHS), "the config")
    while queue:
        path = queue.pop(0)
        if path in found:
            continue
        found.append(path)
        nested = _plain(_load_file(Path(path)))
        queue.extend(_config_paths(nested.get(CONFIG_PATHS), f"config file '{path}'"))
    return found


def merge_config(
    paths: Sequence[str | os.PathLike[str]],
    overrides: Sequence[str] = (),
    *,
    env_file: str | os.PathLike[str] | None = None,
) -> DictConfig:
    """Merge a run's YAML files and overrides without resolving interpolations (see :func:`load_config`).

    Files named by ``config_paths`` (in the files, the overrides or ``env_file``, transitively) are merged
    first, under the given files and overrides, as NeMo Gym does. ``env_file`` (NeMo Gym's ``env.yaml``,
    :func:`gym_ray.config.nemo_env.find_env_yaml`) goes over the ``config_paths`` files and under the given
    files and overrides, as 0.7 merges it; an override may add (``+key``) a key it sets.

    Raises:
        ConfigError: As :func:`load_config`, except for interpolations (not resolved here).
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if isinstance(overrides, str):
        overrides = [overrides]
    merged = _merge_files(paths)
    for override in overrides:
        _apply_override(merged, override)
    env = _merge_files([env_file]) if env_file is not None else None
    included = _included_files(merged if env is None else cast(DictConfig, OmegaConf.merge(env, merged)))
    layers = ([_merge_files(included)] if included else []) + ([env] if env is not None else [])
    if layers:
        merged = cast(DictConfig, OmegaConf.merge(*layers, merged))
    if included:
        merged[CONFIG_PATHS] = included
    return merged


def resolve_config(merged: DictConfig) -> dict[str, Any]:
    """The plain dict of a merged config, every interpolation resolved.

    Raises:
        ConfigError: An interpolation that cannot be resolved (``key`` = its dotted path).
    """
    try:
        container = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(
            f"config key '{key}' has an interpolation that cannot be resolved: {_first_line(exc)}; define "
            "the key it refers to (or the environment variable), or fix the ${...} expression",
            key=key,
        ) from exc
    assert isinstance(container, dict)
    return cast(dict[str, Any], container)


def load_config(paths: Sequence[str | os.PathLike[str]], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load, merge and resolve a run's global config.

    Args:
        paths: YAML files, merged in order (a later file wins key by key). A single path is accepted too.
        overrides: ``key=value`` (change an existing key), ``+key=value`` (add a new key) or
            ``++key=value`` (add or change); dotted keys, values read as YAML (``n=3`` is an int,
            ``m={a: 1}`` a mapping, ``s='3'`` a string, ``x=`` null). A mapping value merges into a
            mapping already there. A value starting with ``{`` or ``[`` is read with Hydra's flow rules,
            as NeMo Gym users write it (``+agent_map={_default:X}``, ``+l=[a,b]``). ``config_paths=[...]``
            (with or without ``+``) names more YAML files, merged under everything else.

    Returns:
        The merged config as plain dicts and lists, every interpolation resolved.

    Raises:
        ConfigError: a missing file, a YAML syntax error (file and line), a malformed override, or an
            interpolation that cannot be resolved (``key`` = its dotted path).

    Example:
        >>> cfg = load_config(["env.yaml"], ["+num_repeats=4", "++head_server.port=11001"])
    """
    return resolve_config(merge_config(paths, overrides))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def run_concurrency_cap(data: Mapping[str, Any]) -> int | None:
    """The smaller of ``num_samples_in_parallel`` and ``max_resident_rollout_tasks`` that are valid counts."""
    caps = [data.get(k) for k in ("num_samples_in_parallel", "max_resident_rollout_tasks")]
    counts = [int(c) for c in caps if c is not None and _is_count(c)]
    return min(counts) if counts else None


#: What a field accepts, where its annotation alone does not say it.
_ALLOWED = {
    "num_repeats": f"an int >= 1, or {{routing key: int >= 1}} with an optional {keys.DEFAULT_KEY}",
    "fan_out": "{routing key: [distinct agent names]} or null",
}


def _describe_allowed(name: str, info: Any) -> str:
    if name in _ALLOWED:
        return _ALLOWED[name]
    annotation = info.annotation
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    text = text.replace("typing.", "").replace("NoneType", "None")
    for constraint in info.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(constraint, attr, None)
            if bound is not None:
                text += f" ({symbol} {bound})"
    return text


class RunSettings(BaseModel):
    """The run-level knobs of a config (top-level keys that are not server instances).

    Values are checked strictly (a YAML string ``"3"`` is not an int). Unknown keys are ignored: they are
    server instances, routing keys, or settings of other tools.

    Attributes:
        input_jsonl_fpath: input rows, or None (rows passed in by the caller).
        output_dir: the run folder, or None.
        num_repeats: rollouts per task: an int >= 1, or ``{routing key: int >= 1}`` with ``_default``.
        agent_map: ``{agent name or task_source or _default: agent}`` for unrouted flat rows.
        fan_out: ``{routing key: [agents]}``: each task runs on every listed agent.
        num_repeats_add_seed: put the rollout index as ``seed`` in ``metadata.extra_body``.
        interleave_repeats: order rows round by round (abcabc) instead of task by task (aabbcc).
        task_ids: keep only these tasks (each once, before repetition).
        responses_create_params: run-level overrides merged into every flat row's create params.
        max_resident_tasks: rollouts in flight per worker (admission bound).
        max_connections: HTTP connection pool limit per worker; unset or null takes ``max_resident_tasks``.
        request_timeout_s / connect_timeout_s: per request / per connect. A ``/run`` that times out on a
            server that still answers ``GET /`` is sent at most 3 times, then recorded as failed.
        dispatch_budget_s: stop admitting after this many seconds and drain, or None (no budget).
        drain_margin_s: time kept back from the budget for draining, or None (automatic).
        route_failures_to_sidecar: write failure records to ``*_failures.jsonl``.
        retry_requests: resend a ``/run`` the server may have received (timeout, dropped connection,
            429/502/503/504); false sends each once (a connection that was never made is still retried).
        max_rollout_attempts: (unset: ``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS`` when set, as in NeMo Gym 0.7)
            attempts per rollout before resume gives up on it (rollouts the server
            answered with a failure; infrastructure failures do not count).
        store_publish_every / store_publish_interval_s: with ``output_dir`` on an object store, a worker
            publishes a shard's new records every this many records or seconds, whichever comes first, and
            when the shard ends (:mod:`gym_ray.store.publish`); records not yet published when a worker
            dies run again.
        max_infra_retries: resends of one rollout after infrastructure failures (connection refused or
            reset, timeout, 429/502/503/504) while its server still looked up; waiting for a down server
            spends none. Keep it >= 3 (the failures in a row that make a server look down) so that an
            outage alone never turns a row into a failure record.
        server_outage_timeout_s: how long an environment server may look down (its rows held back while a
            probe checks it) before the run stops, resumable, with ``ServerOutageError``.
        shard_size: rows per shard, or None (automatic).
        num_workers: worker actors, or None (automatic).
        strict: refuse to publish metrics when work is left unfinished.
        no_progress_timeout_s: fail the run when nothing finished for this long.
        seed: run seed, or None.
        output_jsonl_fpath: NeMo Gym's output path ``P``: the merged rollouts go to ``P`` and the side files
            beside it under NeMo Gym's names; the run folder defaults to ``<P.parent>/<P.stem>_run``.
        agent_name: NeMo Gym's ``agent_name``: folded into ``agent_map._default`` (it re-routes every
            unrouted flat row, as NeMo Gym 0.7 does).
        limit: only the first ``limit`` input rows (0 or None: all), before anything else.
        num_samples_in_parallel: rollouts in flight for the whole run, across all workers.
        max_resident_rollout_tasks: NeMo Gym's task bound; caps rollouts in flight like
            ``num_samples_in_parallel`` (the smaller one wins).
        disable_aggregation: skip ``/aggregate_metrics``; no metrics file is written.
        require_complete: fail the run (after writing its files) when a planned rollout has no success.
        resume_from_cache: True resumes the run folder (gym_ray's behaviour anyway); False refuses a folder
            that already holds a run (gym_ray never deletes results); None: resume.
        retain_results_in_memory / upload_rollouts: accepted for NeMo Gym command lines (see
            docs/nemo-gym.md).
        disable_health_check: NeMo Gym 0.7's post-run rollout-quality pass (``quality_summary.json`` and
            ``rollout_verdicts.jsonl`` beside the rollouts, :mod:`gym_ray.finalize.quality`): False runs it,
            True skips it, None runs it with ``output_jsonl_fpath`` (0.7's layout and default) and skips
            it with ``output_dir`` alone. It never runs with ``disable_aggregation``, as in 0.7.
        health_check_workers: 0.7's process count for that pass; accepted (gym_ray runs it in one).
        health_check_ignored_checks: check ids that pass leaves out (a list, or one comma-separated
            string); an unknown id is refused with the known ones.
        health_check: before anything starts, probe every environment server the config routes to
            (``GET /``) and refuse the run when one is unreachable or unhealthy.
        max_failed_fraction: failed rows (of the planned rows) a run may end with and still count as
            complete (exit status 0); 0.0 = none.
        strict_json: refuse input rows that name a key twice in one object (Python's ``json`` keeps the
            last one; JSON leaves it undefined), with the file and line; False accepts them (the last
            duplicate wins). What JSON cannot carry to a server (``NaN`` / ``Infinity``, numbers that
            overflow a double; in rows passed as Python objects, ``nan`` / ``inf`` floats) is refused
            either way, with the file and line or the row: nothing sends it on.
        control_actors_resource: the name of a custom Ray resource: the run's driver and coordinator
            actors go to a node holding it instead of the caller's node (a job submitted from a machine
            that is not a cluster node; e.g. ``ray start --resources='{"gym_ray_control": 1}'`` on the
            head). None: the caller's node.
        control_actor_restarts: how many times Ray restarts the run's driver or coordinator actor when its
            process dies; the new process takes up the dead one's state from the run folder and the run
            goes on in the same call (:mod:`gym_ray.distributed.journal`). Once they are spent the run
            stops, resumable, naming the actor. 0: never restart.
        use_new_config: resume a run folder whose recorded servers (``gym_ray_run.json``) are at other
            addresses than this config resolves to (``gym-ray run --use-new-config``); without it such a
            resume is refused before anything starts. The config's identity must match either way.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    input_jsonl_fpath: str | None = None
    output_dir: str | None = None
    num_repeats: int | dict[str, int] = 1
    agent_map: dict[str, str] | None = None
    fan_out: dict[str, list[str]] | None = None
    num_repeats_add_seed: bool = False
    interleave_repeats: bool = False
    task_ids: list[int | str] | None = None
    responses_create_params: dict[str, Any] | None = None
    max_resident_tasks: int = Field(256, ge=1)
    max_connections: int = Field(256, ge=1)
    request_timeout_s: float = Field(900.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    dispatch_budget_s: float | None = Field(None, gt=0)
    drain_margin_s: float | None = Field(None, ge=0)
    route_failures_to_sidecar: bool = True
    retry_requests: bool = True
    max_rollout_attempts: int = Field(3, ge=1)
    max_infra_retries: int = Field(10, ge=0)
    store_publish_every: int = Field(1000, ge=1)
    store_publish_interval_s: float = Field(30.0, gt=0)
    server_outage_timeout_s: float = Field(300.0, gt=0)
    shard_size: int | None = Field(None, ge=1)
    num_workers: int | None = Field(None, ge=1)
    strict: bool = False
    no_progress_timeout_s: float = Field(600.0, gt=0)
    seed: int | None = None
    output_jsonl_fpath: str | None = None
    agent_name: str | None = None
    limit: int | None = Field(None, ge=0)
    num_samples_in_parallel: int | None = Field(None, ge=1)
    max_resident_rollout_tasks: int | None = Field(None, ge=1)
    disable_aggregation: bool = False
    require_complete: bool = False
    resume_from_cache: bool | None = None
    retain_results_in_memory: bool = True
    upload_rollouts: bool = True
    disable_health_check: bool | None = None
    health_check_workers: int | None = Field(None, ge=1)
    health_check_ignored_checks: tuple[str, ...] = ()
    health_check: bool = True
    max_failed_fraction: float = Field(0.0, ge=0.0, le=1.0)
    strict_json: bool = True
    use_new_config: bool = False
    control_actors_resource: str | None = Field(None, min_length=1)
    control_actor_restarts: int = Field(3, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        cap = run_concurrency_cap(data)
        resident = data.get("max_resident_tasks")
        if cap is not None and (resident is None or (_is_count(resident) and resident > cap)):
            # A whole-run cap bounds one process's admission too (the distributed run splits it).
            data["max_resident_tasks"] = cap
        if data.get("max_connections") is None:
            resident = data.get("max_resident_tasks", 256)
            data["max_connections"] = resident if _is_count(resident) else 256
        agent_name = data.get("agent_name")
        if agent_name is not None:
            agent_map = data.get("agent_map")
            if agent_map is not None and not isinstance(agent_map, Mapping):
                return data  # the agent_map field check names the problem
            mapped = dict(agent_map or {})
            default = mapped.get(keys.DEFAULT_KEY)
            if default is not None and default != agent_name:
                raise ValueError(
                    f"agent_name={agent_name!r} conflicts with agent_map.{keys.DEFAULT_KEY}={default!r}; "
                    "set only one of them"
                )
            mapped[keys.DEFAULT_KEY] = agent_name
            data["agent_map"] = mapped
        output = data.get("output_jsonl_fpath")
        if data.get("output_dir") is None and isinstance(output, str) and output:
            path = Path(output)
            data["output_dir"] = str(path.parent / f"{path.stem}_run")
        if "max_rollout_attempts" not in data:  # unset here: NeMo Gym 0.7's environment variable, if any
            from gym_ray.config.nemo_env import max_rollout_attempts_from_env

            attempts = max_rollout_attempts_from_env()
            if attempts is not None:
                data["max_rollout_attempts"] = attempts
        return data

    @property
    def concurrency_cap(self) -> int | None:
        """Rollouts in flight for the whole run (``num_samples_in_parallel`` /
        ``max_resident_rollout_tasks``, the smaller), or None when neither is set."""
        return run_concurrency_cap(self.model_dump())

    @field_validator(*PATH_SETTINGS)
    @classmethod
    def _check_local_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        return check_path_setting(str(info.field_name), value)

    @model_validator(mode="after")
    def _store_folder_alone(self) -> RunSettings:
        check_store_folder_alone(self.output_dir, self.output_jsonl_fpath)
        return self

    @field_validator("num_repeats", mode="before")
    @classmethod
    def _check_num_repeats(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            bad = {k: v for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
            if not value:
                raise ValueError("a num_repeats mapping must not be empty")
            if bad:
                raise ValueError(f"every value of a num_repeats mapping must be an int >= 1, got {bad}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"num_repeats must be an int >= 1, got {value!r}")
        return value

    @field_validator("health_check_ignored_checks", mode="before")
    @classmethod
    def _check_ignored_checks(cls, value: Any) -> tuple[str, ...]:
        from gym_ray.finalize.quality import normalize_ignored_checks  # the check ids live with the pass

        return normalize_ignored_checks(value)

    @property
    def runs_quality_pass(self) -> bool:
        """Whether the run ends with 0.7's rollout-quality pass (see ``disable_health_check``)."""
        if self.disable_aggregation:
            return False
        if self.disable_health_check is None:
            return self.output_jsonl_fpath is not None
        return not self.disable_health_check

    @field_validator("responses_create_params")
    @classmethod
    def _check_create_params(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from gym_ray.plan.load import non_finite_problem  # planning's check, for what joins every row

        problem = None if value is None else non_finite_problem(value, at="responses_create_params")
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("fan_out")
    @classmethod
    def _check_fan_out(cls, value: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        for key, agents in (value or {}).items():
            if not agents:
                raise ValueError(
                    f"fan_out[{key!r}] is an empty list; list at least one agent or drop the key"
                )
            if len(set(agents)) != len(agents):
                raise ValueError(f"fan_out[{key!r}] lists the same agent more than once: {agents}")
        return value

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RunSettings:
        """Read the run settings from a merged config's top-level keys.

        Args:
            cfg: the plain config dict (``load_config``'s result).

        Returns:
            The frozen settings; keys absent from ``cfg`` take their defaults.

        Raises:
            ConfigError: a value of the wrong type or out of range; the message names every bad key, its
                value and what is allowed, and ``key`` is the first bad key.
        """
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"the global config must be a mapping, got {type(cfg).__name__}")
        try:
            return cls.model_validate(dict(cfg))
        except pydantic.ValidationError as exc:
            problems: dict[str, list[str]] = {}
            for error in exc.errors():
                top = str(error["loc"][0]) if error["loc"] else ""
                message = str(error["msg"]).removeprefix("Value error, ")
                if message not in problems.setdefault(top, []):
                    problems[top].append(message)
            lines = []
            for top, messages in problems.items():
                if not top:  # a check across keys (agent_name vs agent_map): its message names them
                    lines.extend(messages)
                    continue
                info = cls.model_fields.get(top)
                path_only = top in PATH_SETTINGS  # its check says what to give
                allowed = (
                    f"; allowed: {_describe_allowed(top, info)}" if info is not None and not path_only else ""
                )
                value = cfg.get(top, "<unset>")
                lines.append(f"config key '{top}' is {value!r}: {' / '.join(messages)}{allowed}")
            raise ConfigError("; ".join(lines), key=next(iter(problems)) or None) from exc
