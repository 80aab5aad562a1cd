"""Planning a run folder: cut validated, preprocessed rows into shards and write them to disk.

Durability promises (see RELIABILITY.md):

- Planning validates every row before anything is written to the run folder or dispatched
  (:func:`prepare_run`): shards are cut into a staging folder and moved into place only when the whole input
  was read, so bad input never leaves a half-written run folder.
- Planning is deterministic: the same input and settings cut the same shards. A rerun on the same folder
  re-plans, checks that every existing shard's materialized inputs are byte-identical to the new cut (else
  :class:`~gym_ray.errors.ResumeError`), and keeps them; only what is missing is dispatched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from gym_ray import keys
from gym_ray._internal.atomic import atomic_write_bytes
from gym_ray.config import RunSettings
from gym_ray.errors import ResumeError, UsageError
from gym_ray.preprocess import iter_preprocess, load_jsonl
from gym_ray.records import ShardManifest, ShardWriter
from gym_ray.topology import Topology
from gym_ray.validation import validate_rows

RUN_MANIFEST = "run_manifest.json"
DEFAULT_SHARD_SIZE = 1000


@dataclass(frozen=True)
class ShardSpec:
    """A unit of work: one shard of a run folder, already planned on disk."""

    run_dir: str
    shard: str
    run_id: str
    config_identity: str | None
    num_rows: int


class RunPlan(BaseModel):
    """The planned shards of a run folder."""

    model_config = ConfigDict(frozen=True)

    run_dir: str
    run_id: str
    config_identity: str | None
    planned: int
    shards: tuple[ShardSpec, ...]
    resumed: bool


# --------------------------------------------------------------------------------------------------
# planning


def _shard_label(index: int) -> str:
    return f"{index:05d}"


def _row_line(row: Mapping[str, Any]) -> bytes:
    return (json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _read_run_manifest(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / RUN_MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ResumeError(
            f"{path} is not a readable run manifest ({exc}); move the folder aside or pass a new output_dir"
        ) from exc
    if not isinstance(data, dict):
        raise ResumeError(
            f"{path} does not hold a JSON object; move the folder aside or pass a new output_dir"
        )
    return data


def plan_run(
    rows: Iterable[dict[str, Any]],
    run_dir: str | os.PathLike[str],
    *,
    config_identity: str | None,
    shard_size: int | None = None,
    max_rollout_attempts: int = 3,
    run_id: str | None = None,
) -> RunPlan:
    """Cut preprocessed, validated rows into shards of contiguous rows and write them to ``run_dir``.

    A task's rollouts stay in one shard when they are contiguous in ``rows`` (``preprocess_examples``
    emits them so unless ``interleave_repeats`` is set). Memory holds one shard at a time.

    Args:
        rows: Preprocessed rows carrying ``_ng_task_index`` and ``_ng_rollout_index``. Validation errors
            raised while iterating leave the run folder untouched.
        run_dir: The run folder; created if missing.
        config_identity: Digest of the config that decides results (``Topology.identity_digest``).
        shard_size: Rows per shard (cut at the next task boundary after this many rows).
        max_rollout_attempts: Recorded in each shard manifest.
        run_id: A fresh run's id; ignored when the folder already holds a run (its id is kept).

    Returns:
        The plan: one :class:`ShardSpec` per shard, in input order.

    Raises:
        ResumeError: The folder holds a run whose config identity or inputs differ from these.
    """
    size = shard_size or DEFAULT_SHARD_SIZE
    if size < 1:
        raise UsageError(f"shard_size must be >= 1, got {size}")
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    existing = _read_run_manifest(root)
    if existing is not None:
        old_identity = existing.get("config_identity")
        if old_identity and config_identity and old_identity != config_identity:
            raise ResumeError(
                f"{root} was collected with another configuration (identity {old_identity[:12]}..., now "
                f"{config_identity[:12]}...): servers, routing or sampling settings changed. Resume with the "
                "config that started the run, or pass a new output_dir"
            )
        run_id = str(existing["run_id"])
    run_id = run_id or uuid.uuid4().hex[:12]

    staging = root / f".staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        staged = _stage_shards(rows, staging, size)
        specs = _commit_shards(
            staged,
            staging,
            root,
            run_id=run_id,
            config_identity=config_identity,
            max_rollout_attempts=max_rollout_attempts,
            expected_shards=existing.get("num_shards") if existing else None,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    planned = sum(spec.num_rows for spec in specs)
    manifest = {
        "run_id": run_id,
        "config_identity": config_identity,
        "num_shards": len(specs),
        "planned": planned,
        "shard_size": size,
        "created_at": existing.get("created_at") if existing else time.time(),
    }
    atomic_write_bytes(root / RUN_MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return RunPlan(
        run_dir=str(root),
        run_id=run_id,
        config_identity=config_identity,
        planned=planned,
        shards=tuple(specs),
        resumed=existing is not None,
    )


def _stage_shards(rows: Iterable[dict[str, Any]], staging: Path, size: int) -> list[tuple[str, int, str]]:
    """Write each shard's rows to ``staging``; returns (label, rows, sha256) per shard."""
    staged: list[tuple[str, int, str]] = []
    index = 0
    count = 0
    last_task: Any = object()
    digest = hashlib.sha256()
    out = None
    try:
        for position, row in enumerate(rows):
            task = row.get(keys.TASK_INDEX)
            if out is not None and count >= size and task != last_task:
                out.close()
                staged.append((_shard_label(index), count, digest.hexdigest()))
                index, count, out = index + 1, 0, None
            if out is None:
                out = open(staging / f"{_shard_label(index)}.jsonl", "wb")
                digest = hashlib.sha256()
            if not isinstance(task, int) or not isinstance(row.get(keys.ROLLOUT_INDEX), int):
                raise UsageError(
                    f"row {position} has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX}; "
                    "pass rows through preprocess_examples before planning a run"
                )
            line = _row_line(row)
            out.write(line)
            digest.update(line)
            count += 1
            last_task = task
        if out is not None:
            out.close()
            out = None
            staged.append((_shard_label(index), count, digest.hexdigest()))
    finally:
        if out is not None:
            out.close()
    return staged


def _commit_shards(
    staged: list[tuple[str, int, str]],
    staging: Path,
    root: Path,
    *,
    run_id: str,
    config_identity: str | None,
    max_rollout_attempts: int,
    expected_shards: int | None,
) -> list[ShardSpec]:
    if expected_shards is not None and expected_shards != len(staged):
        raise ResumeError(
            f"{root} holds a run of {expected_shards} shards, but these inputs cut into {len(staged)}: the "
            "input rows or shard_size changed. Resume with the same inputs and shard_size, or pass a new "
            "output_dir"
        )
    specs: list[ShardSpec] = []
    for label, num_rows, digest in staged:
        writer = ShardWriter(root, label, run_id=run_id, config_identity=config_identity)
        inputs_path = writer.paths.materialized_inputs
        if inputs_path.exists():
            if _file_sha256(inputs_path) != digest:
                raise ResumeError(
                    f"shard {label} of {root} was planned from other inputs ({inputs_path} differs from "
                    "the rows these inputs give): resume with the same input file and settings, or pass a "
                    "new output_dir"
                )
        else:
            inputs_path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / f"{label}.jsonl", inputs_path)
            with writer:
                writer.write_manifest(
                    ShardManifest.build(
                        run_id=run_id,
                        shard=label,
                        config_identity=config_identity,
                        inputs_path=inputs_path,
                        max_rollout_attempts=max_rollout_attempts,
                    )
                )
        specs.append(
            ShardSpec(
                run_dir=str(root),
                shard=label,
                run_id=run_id,
                config_identity=config_identity,
                num_rows=num_rows,
            )
        )
    return specs


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_rows(
    settings: RunSettings,
    topology: Topology,
    rows: Iterable[Mapping[str, Any]] | None = None,
) -> Callable[[], Iterator[dict[str, Any]]]:
    """A re-iterable source of the run's preprocessed rows (the input is read once per call).

    Rows come from ``rows`` (a re-iterable collection) or the settings' ``input_jsonl_fpath``.
    """
    if rows is None:
        if settings.input_jsonl_fpath is None:
            raise UsageError(
                "no input rows: set input_jsonl_fpath in the config (+input_jsonl_fpath=rows.jsonl) "
                "or pass rows"
            )
        path = settings.input_jsonl_fpath

        def source() -> Iterable[Mapping[str, Any]]:
            return load_jsonl(path)
    else:
        if iter(rows) is rows:
            raise UsageError("rows must be a re-iterable collection (a list), not a one-shot iterator")
        fixed = rows

        def source() -> Iterable[Mapping[str, Any]]:
            return fixed

    def preprocessed() -> Iterator[dict[str, Any]]:
        return iter_preprocess(
            source(),
            agent_map=settings.agent_map,
            fan_out=settings.fan_out,
            num_repeats=settings.num_repeats,
            num_repeats_add_seed=settings.num_repeats_add_seed,
            interleave_repeats=settings.interleave_repeats,
            task_ids=settings.task_ids,
            responses_create_params=settings.responses_create_params,
            topology=topology,
        )

    return preprocessed


def prepare_run(
    cfg: dict[str, Any],
    topology: Topology,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
) -> RunPlan:
    """Validate every input row against the config, then plan the run folder (no dispatch).

    Two streaming passes over the input: the first validates (every problem reported together, before
    anything is written), the second cuts and writes shards. Memory does not grow with the input.
    """
    settings = RunSettings.from_config(cfg)
    if settings.output_dir is None:
        raise UsageError("no output folder: set output_dir in the config (+output_dir=runs/r1)")
    source = input_rows(settings, topology, rows)
    validate_rows(source(), topology)
    return plan_run(
        source(),
        settings.output_dir,
        config_identity=topology.identity_digest(),
        shard_size=settings.shard_size,
        max_rollout_attempts=settings.max_rollout_attempts,
    )
