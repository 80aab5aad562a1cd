"""Planning a run folder: cut validated, preprocessed rows into shards and write them to disk.

Durability promises (see RELIABILITY.md):

- Planning validates every row before anything is written to the run folder or dispatched
  (:func:`prepare_run`, :func:`iter_prepare_run`: a whole validation pass comes first), so bad input never
  leaves a half-written run folder. :func:`plan_run` on its own is all or nothing too: shards are cut into
  a staging folder and moved into place only when the whole input was read.
- Lazy planning (:func:`iter_plan`, :func:`iter_prepare_run`): after validation, each shard is committed
  (materialized inputs, then its manifest) and yielded as soon as it is cut, so the Ray driver hands out
  shard ``i`` while later shards are still being cut. The run manifest is written before the first shard
  (run id, config identity; shard count unknown) and completed after the last. A kill mid-planning
  leaves committed shards that a rerun verifies by digest and keeps.
- Planning is deterministic: the same input and settings cut the same shards. A rerun on the same folder
  re-plans, checks that every existing shard's materialized inputs are byte-identical to the new cut (else
  :class:`~gym_ray.errors.ResumeError`), and keeps them; only what is missing is dispatched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from gym_ray.config.run_config import RunConfig
from gym_ray.config.settings import RunSettings
from gym_ray.errors import GymRayError, RecordError, ResumeError, UsageError
from gym_ray.plan._commit import commit_new_shard
from gym_ray.plan._input_chunks import ChunkCheck
from gym_ray.plan._line_flags import LineFlags
from gym_ray.plan._proven_pass import proven_rows
from gym_ray.plan._spill_dedupe import DedupeReplay, SpillDedupe
from gym_ray.plan._stage import Staged, StampedLine, stage_shards
from gym_ray.plan.first_pass import (
    CheckedInput,
    adopt_parts,
    count_rows,
    first_pass,
    input_rows,
    numbers_in_memory,
    take_checked,
)
from gym_ray.plan.run_manifest import RUN_MANIFEST, open_run, read_run_manifest, write_run_manifest
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.shard_files import shard_paths

#: Largest automatic shard (rows); also the shard size of a plan cut without a known worker count.
DEFAULT_SHARD_SIZE = 1000
#: Largest automatic shard (rows) of a run folder on an object store: each shard costs about ten requests
#: to the store on top of its records' publications (:mod:`gym_ray.store.publish`).
STORE_SHARD_SIZE = 5000
#: Smallest automatic shard (rows): below it per-shard file and manifest costs dominate.
MIN_AUTO_SHARD_SIZE = 16
#: Shards per worker the automatic size aims for, so the pull-based hand-out can balance the tail.
SHARDS_PER_WORKER = 4


def auto_shard_size(run_rows: int, num_workers: int, *, cap: int = DEFAULT_SHARD_SIZE) -> int:
    """Rows per shard for a run of ``run_rows`` rows on ``num_workers`` workers (``shard_size`` unset).

    About :data:`SHARDS_PER_WORKER` shards per worker, within [:data:`MIN_AUTO_SHARD_SIZE`, ``cap``]: 800
    rows on 2 workers are 8 shards of 100, so both workers run.
    """
    wanted = -(-run_rows // (SHARDS_PER_WORKER * max(1, num_workers)))
    return max(MIN_AUTO_SHARD_SIZE, min(cap, wanted))


@dataclass(frozen=True)
class ShardSpec:
    """A unit of work: one shard of a run folder, already planned on disk."""

    run_dir: str
    shard: str
    run_id: str
    config_identity: str | None
    num_rows: int
    run_rows: int | None = None
    """Rows of the whole run when known (counted by the validation pass); None otherwise."""


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


def _shard_size(shard_size: int | None) -> int:
    size = shard_size or DEFAULT_SHARD_SIZE
    if size < 1:
        raise UsageError(f"shard_size must be >= 1, got {size}")
    return size


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
    emits them so unless ``interleave_repeats`` is set). Memory holds one shard at a time. All or nothing:
    every shard is cut into a staging folder first and moved into place once the whole input was read
    (:func:`iter_plan` is the lazy form, for input already validated).

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
    size = _shard_size(shard_size)
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    run_id, existing = open_run(root, config_identity, run_id)
    expected = existing.get("num_shards") if existing else None
    staging = root / f".staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        staged = list(stage_shards(rows, staging, size))
        if expected is not None and expected != len(staged):
            raise _shard_count_error(root, expected, len(staged))
        specs = [
            _commit_shard(
                item,
                staging,
                root,
                run_id=run_id,
                config_identity=config_identity,
                max_rollout_attempts=max_rollout_attempts,
            )
            for item in staged
        ]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    planned = sum(spec.num_rows for spec in specs)
    write_run_manifest(
        root,
        existing,
        run_id=run_id,
        config_identity=config_identity,
        shard_size=size,
        num_shards=len(specs),
        planned=planned,
    )
    return RunPlan(
        run_dir=str(root),
        run_id=run_id,
        config_identity=config_identity,
        planned=planned,
        shards=tuple(specs),
        resumed=existing is not None,
    )


def iter_plan(
    rows: Iterable[dict[str, Any]],
    run_dir: str | os.PathLike[str],
    *,
    config_identity: str | None,
    shard_size: int | None = None,
    max_rollout_attempts: int = 3,
    run_id: str | None = None,
    run_rows: int | None = None,
) -> Generator[ShardSpec, None, None]:
    """Cut rows into shards like :func:`plan_run`, committing and yielding each shard as soon as it is cut.

    For rows that were validated already (:func:`iter_prepare_run`): a consumer can dispatch shard ``i``
    while shard ``i + 1`` is being cut, and memory holds one shard's digest state, never the plan.
    Before the first shard the run manifest is written with ``num_shards``/``planned`` null (so the run
    id survives a kill during planning) and ``run_rows`` (the run's full size, when known); after the last
    shard it is rewritten with the totals. On resume
    each existing shard is checked against the new cut (digest of its materialized inputs) before it is
    yielded; a shard count that differs from the finished manifest's raises when it shows.

    Args:
        rows: Preprocessed, validated rows (see :func:`plan_run`).
        run_dir: The run folder; created if missing.
        config_identity: Digest of the config that decides results.
        shard_size: Rows per shard (cut at the next task boundary after this many rows).
        max_rollout_attempts: Recorded in each shard manifest.
        run_id: A fresh run's id; ignored when the folder already holds a run.
        run_rows: The run's total rows when known (copied onto every :class:`ShardSpec`).

    Yields:
        One committed :class:`ShardSpec` per shard, in input order.

    Raises:
        ResumeError: The folder holds a run whose config identity, inputs or shard count differ.
        RecordError: The folder cannot be written (disk full, permissions); the message names the path.
    """
    size = _shard_size(shard_size)
    root = Path(run_dir)
    try:
        yield from _iter_plan(
            rows,
            root,
            size=size,
            config_identity=config_identity,
            max_rollout_attempts=max_rollout_attempts,
            run_id=run_id,
            run_rows=run_rows,
        )
    except OSError as exc:
        if isinstance(exc, GymRayError):
            raise
        where = exc.filename or root
        raise RecordError(
            f"planning the run folder {root} failed writing {where}: {exc.strerror or exc}; free space on "
            "that disk (or pass an output_dir on a larger one), then rerun the same command"
        ) from exc


def _iter_plan(
    rows: Iterable[dict[str, Any]],
    root: Path,
    *,
    size: int,
    config_identity: str | None,
    max_rollout_attempts: int,
    run_id: str | None,
    run_rows: int | None,
) -> Generator[ShardSpec, None, None]:
    """:func:`iter_plan`'s body (which maps the file system's errors to one line naming the path)."""
    root.mkdir(parents=True, exist_ok=True)
    run_id, existing = open_run(root, config_identity, run_id)
    expected = existing.get("num_shards") if existing else None
    if existing is None or (run_rows is not None and existing.get("run_rows") != run_rows):
        write_run_manifest(
            root,
            existing,
            run_id=run_id,
            config_identity=config_identity,
            shard_size=size,
            num_shards=expected,
            planned=existing.get("planned") if existing else None,
            run_rows=run_rows,
        )
    staging = root / f".staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    count = planned = 0
    try:
        for item in stage_shards(rows, staging, size):
            if expected is not None and count >= expected:
                raise _shard_count_error(root, expected, f"more than {expected}")
            spec = _commit_shard(
                item,
                staging,
                root,
                run_id=run_id,
                config_identity=config_identity,
                max_rollout_attempts=max_rollout_attempts,
                run_rows=run_rows,
            )
            count += 1
            planned += spec.num_rows
            yield spec
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if expected is not None and expected != count:
        raise _shard_count_error(root, expected, count)
    write_run_manifest(
        root,
        existing,
        run_id=run_id,
        config_identity=config_identity,
        shard_size=size,
        num_shards=count,
        planned=planned,
        run_rows=run_rows,
    )


def _shard_count_error(root: Path, expected: int, got: int | str) -> ResumeError:
    return ResumeError(
        f"{root} holds a run of {expected} shards, but these inputs cut into {got}: the input rows or "
        "shard_size changed. Resume with the same inputs and shard_size, or pass a new output_dir"
    )


def _commit_shard(
    staged: Staged,
    staging: Path,
    root: Path,
    *,
    run_id: str,
    config_identity: str | None,
    max_rollout_attempts: int,
    run_rows: int | None = None,
) -> ShardSpec:
    """Move one staged shard into place (or, on resume, check the existing one is identical)."""
    label, num_rows, digest = staged.label, staged.num_rows, staged.digest
    paths = shard_paths(root, label)
    inputs_path = paths.materialized_inputs
    staged_path = staging / f"{label}.jsonl"
    if inputs_path.exists():
        if _file_sha256(inputs_path) != digest:
            raise ResumeError(
                f"shard {label} of {root} was planned from other inputs ({inputs_path} differs from "
                "the rows these inputs give): resume with the same input file and settings, or pass a "
                "new output_dir"
            )
        staged_path.unlink(missing_ok=True)
    else:
        inputs_path.parent.mkdir(parents=True, exist_ok=True)
        commit_new_shard(
            staged_path,
            paths,
            ShardManifest.of_plan(
                run_id=run_id,
                shard=label,
                config_identity=config_identity,
                inputs_digest=digest,
                attempt_plan=staged.attempt_plan,
                max_rollout_attempts=max_rollout_attempts,
            ),
        )
    return ShardSpec(
        run_dir=str(root),
        shard=label,
        run_id=run_id,
        config_identity=config_identity,
        num_rows=num_rows,
        run_rows=run_rows,
    )


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_run(
    run: RunConfig,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    num_workers: int = 1,
    stop: threading.Event | None = None,
) -> RunPlan:
    """Validate every input row against the config, then plan the whole run folder (no dispatch).

    :func:`iter_prepare_run` consumed to the end: two streaming passes over the input, the first
    validates (every problem reported together, before anything is written), the second cuts and writes
    shards. Memory holds the small shard specs, never rows.
    """
    root = Path(_output_dir(run.settings))
    resumed = (root / RUN_MANIFEST).exists()
    specs = tuple(iter_prepare_run(run, rows=rows, num_workers=num_workers, stop=stop))
    manifest = read_run_manifest(root) or {}
    return RunPlan(
        run_dir=str(root),
        run_id=str(manifest.get("run_id", specs[0].run_id if specs else "")),
        config_identity=run.topology.identity_digest(),
        planned=sum(spec.num_rows for spec in specs),
        shards=specs,
        resumed=resumed,
    )


def iter_prepare_run(
    run: RunConfig,
    *,
    rows: Iterable[Mapping[str, Any]] | None = None,
    num_workers: int = 1,
    checked: CheckedInput | None = None,
    stop: threading.Event | None = None,
) -> Generator[ShardSpec, None, None]:
    """Validate every input row, then plan the run folder lazily: yield each shard once it is committed.

    The validation pass runs on the first ``next()`` and reads the whole input (nothing is written
    before every row is validated; it also counts the rows, carried as ``ShardSpec.run_rows``). Then
    :func:`iter_plan` cuts, writes and yields one shard at a time, so a consumer hands out shard ``i``
    while the rest of the input is still being cut. Resume works as with :func:`prepare_run`. An input
    file of 64 MiB or more is validated over byte ranges in two processes (this one and a spawned one,
    :mod:`gym_ray.plan._parallel_pass`), with the same outcome: the same shards, the same errors.

    Memory does not grow with the number of distinct tasks: the validation pass records each row's content
    digest in sorted runs in a temporary folder (16 bytes per row on disk), and the planning pass numbers
    identical rows from that (:mod:`gym_ray.plan._spill_dedupe`). With ``task_ids`` or
    ``interleave_repeats`` both passes number tasks in memory instead. When the validation pass read a
    file, the planning pass proves it reads the same bytes (a hash per chunk read,
    :mod:`gym_ray.plan._input_chunks`) and numbers tasks by order, taking no content digest again.

    ``checked``: the first pass, already run by the caller before Ray started
    (:func:`gym_ray.plan.first_pass.validate_ahead`); taken over when it can be, else the pass runs here.
    ``stop``: once set (by the cancelled caller of the thread planning runs in), reading the input raises
    :class:`~gym_ray.plan.load.Stopped` within about a thousand rows (a shard being cut is not committed).

    Shard size: ``shard_size`` when set, else the size recorded by the folder's earlier plan (a resume
    cuts the same shards), else :func:`auto_shard_size` of the counted rows and ``num_workers``.

    Raises:
        UsageError: No ``output_dir`` or no input.
        RoutingError / ValidationError: From the validation pass (before anything is written).
        InputError: The input changed between the validation pass and the planning pass.
        ResumeError: The run folder holds another run (see :func:`iter_plan`).
    """
    settings, topology = run.settings, run.topology
    output_dir = _output_dir(settings)
    if settings.resume_from_cache is False and (Path(output_dir) / RUN_MANIFEST).exists():
        raise ResumeError(
            f"run folder {output_dir} already holds a run and resume_from_cache is false; gym_ray never "
            "deletes results: pass +resume_from_cache=true to resume it, or move the folder (and the "
            "output files) aside for a fresh run"
        )
    source = input_rows(settings, topology, rows, stop)

    def plan(rows: Iterator[Any], counted: int) -> Iterator[ShardSpec]:  # rows or StampedLines
        return iter_plan(
            rows,
            output_dir,
            config_identity=topology.identity_digest(),
            shard_size=_planned_shard_size(settings, output_dir, counted, num_workers, run.store_url),
            max_rollout_attempts=settings.max_rollout_attempts,
            run_rows=counted,
        )

    if numbers_in_memory(settings):  # both passes number tasks in memory: validate here again
        yield from plan(source(), count_rows(source(), topology))
        return
    with SpillDedupe() as dedupe:
        counted = take_checked(checked, settings, dedupe) if checked is not None else None
        if counted is None:
            parts = first_pass(settings, topology, rows, dedupe.folder, stop)
            adopt_parts(dedupe, (part for _count, part in parts))
            counted = sum(count for count, _part in parts)
        replay = dedupe.replay()
        check = dedupe.chunk_check() if rows is None else None
        if check is None:
            yield from plan(_checked(source(replay), replay), counted)
        else:  # pass 1 logged the bytes it read: pass 2 proves it reads them and numbers by order
            replay.trust_bytes()
            flags = dedupe.line_flags()  # pass 1's facts per line: a common line is parsed once
            again = proven_rows(settings, topology, stop, check.reader, replay, flags)
            if again is None:  # limit set, or knobs that rewrite rows: the general pass
                flags = None
                again = input_rows(settings, topology, None, stop, proven_by=check.reader)(replay)
            yield from plan(_checked(again, replay, check, flags), counted)


def _planned_shard_size(
    settings: RunSettings, output_dir: str, run_rows: int, num_workers: int, store_url: str | None
) -> int:
    """``shard_size`` when set; else the size a resumed folder was cut with; else :func:`auto_shard_size`
    (up to :data:`STORE_SHARD_SIZE` rows for a folder on an object store, where a shard costs requests)."""
    if settings.shard_size is not None:
        return settings.shard_size
    recorded = (read_run_manifest(Path(output_dir)) or {}).get("shard_size")
    if isinstance(recorded, int) and recorded >= 1:
        return recorded
    return auto_shard_size(
        run_rows, num_workers, cap=DEFAULT_SHARD_SIZE if store_url is None else STORE_SHARD_SIZE
    )


def _checked(
    rows: Iterator[dict[str, Any] | StampedLine],
    replay: DedupeReplay,
    check: ChunkCheck | None = None,
    flags: LineFlags | None = None,
) -> Iterator[dict[str, Any] | StampedLine]:
    """``rows``, then the check that the second pass numbered what the first pass saw."""
    yield from rows
    replay.finish()
    if check is not None:
        check.finish()
    if flags is not None:
        flags.finish()


def _output_dir(settings: RunSettings) -> str:
    output_dir = settings.output_dir
    if output_dir is None:
        raise UsageError("no output folder: set output_dir in the config (+output_dir=runs/r1)")
    return str(output_dir)
