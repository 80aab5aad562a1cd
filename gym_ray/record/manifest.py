"""A shard's manifest and progress files: what a shard is, and how far it got (PROTOCOL.md section 5).

:class:`ShardManifest` (``rollouts-<s>.manifest.json``) names the shard's rows by digest and range;
:class:`ShardProgress` (``rollouts-<s>.progress.json``) counts what its writer recorded. Both are replaced
atomically by :class:`~gym_ray.record.writer.ShardWriter`; :func:`read_manifest` reads one back.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

import pydantic
from pydantic import BaseModel, ConfigDict

from gym_ray import keys
from gym_ray.errors import InputError, validation_problems
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.shard_files import (
    Identity,
    file_sha256,
    record_identity,
    shard_paths,
)

__all__ = ["AttemptPlanEntry", "ShardManifest", "ShardProgress", "build_manifest", "read_manifest"]

#: ``(task_index, rollout_index, attempt_index)`` of one materialized row.
AttemptPlanEntry = tuple[int, int, int]


@functools.cache
def _gym_ray_version() -> str:
    try:
        return metadata.version("gym-ray")
    except metadata.PackageNotFoundError:
        return "unknown"


class ShardManifest(BaseModel):
    """What a shard was recorded from: identity, inputs digest and the attempt plan.

    ``attempt_plan`` holds one ``(task_index, rollout_index, attempt_index)`` per materialized row, in
    input order: the attempt each row runs with next (0 on a fresh shard; the number of failure attempts
    already recorded on a resumed one). ``inputs_digest`` is the sha256 of the materialized inputs file.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    format_version: int = 1
    run_id: str
    shard: str
    config_identity: str | None
    inputs_digest: str
    num_rows: int
    max_rollout_attempts: int
    created_at: float
    gym_ray_version: str
    attempt_plan: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(
        cls,
        *,
        run_id: str,
        shard: str,
        config_identity: str | None,
        inputs_path: str | os.PathLike[str],
        max_rollout_attempts: int = 3,
        prior_attempts: Mapping[Identity, int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> ShardManifest:
        """Build a shard's manifest from its materialized inputs file.

        Args:
            run_id: The run's id.
            shard: The shard label.
            config_identity: The config's identity digest, or None when it cannot be had (the manifest
                then verifies its inputs only).
            inputs_path: The materialized inputs file.
            max_rollout_attempts: The attempt cap resume applies.
            prior_attempts: Failure attempts already recorded per identity (``ResumePlan.attempts``);
                when given, each row's planned attempt is taken from it (0 when absent), else from the
                row's own ``_ng_attempt_index``.
            clock: Source of ``created_at``.

        Raises:
            InputError: The file is missing, or a line is not a JSON object with integer indices.
        """
        path = Path(inputs_path)
        if not path.exists():
            raise InputError(
                f"{path}: materialized inputs missing; write them (ShardWriter.write_materialized_inputs) "
                "before building the manifest",
                path=str(path),
            )
        digest = file_sha256(path)
        plan: list[AttemptPlanEntry] = []
        for line_no, row in JsonlReader(path, strict=True):
            identity = record_identity(row)
            if identity is None:
                raise InputError(
                    f"{path}:{line_no}: row has no integer {keys.TASK_INDEX}/{keys.ROLLOUT_INDEX} "
                    f"(got {row.get(keys.TASK_INDEX)!r}, {row.get(keys.ROLLOUT_INDEX)!r}); "
                    "materialized rows must be preprocessed",
                    path=str(path),
                    line=line_no,
                )
            if prior_attempts is not None:
                attempt = prior_attempts.get(identity, 0)
            else:
                own = row.get(keys.ATTEMPT_INDEX)
                attempt = own if type(own) is int else 0
            plan.append((identity[0], identity[1], attempt))
        return cls.of_plan(
            run_id=run_id,
            shard=shard,
            config_identity=config_identity,
            inputs_digest=digest,
            attempt_plan=plan,
            max_rollout_attempts=max_rollout_attempts,
            clock=clock,
        )

    @classmethod
    def of_plan(
        cls,
        *,
        run_id: str,
        shard: str,
        config_identity: str | None,
        inputs_digest: str,
        attempt_plan: Sequence[AttemptPlanEntry],
        max_rollout_attempts: int = 3,
        clock: Callable[[], float] = time.time,
    ) -> ShardManifest:
        """The manifest of inputs whose digest and attempt plan the caller already has.

        For a writer of the inputs (planning cuts each shard and knows every row's identity and the sha256
        of the bytes it wrote), so the file is not read back: the result equals :meth:`build` of that file.

        Args:
            run_id: The run's id.
            shard: The shard label.
            config_identity: The config's identity digest, or None.
            inputs_digest: The sha256 hex digest of the materialized inputs file.
            attempt_plan: ``(task_index, rollout_index, attempt_index)`` per materialized row, in file order.
            max_rollout_attempts: The attempt cap resume applies.
            clock: Source of ``created_at``.
        """
        return cls(
            run_id=run_id,
            shard=shard,
            config_identity=config_identity,
            inputs_digest=inputs_digest,
            num_rows=len(attempt_plan),
            max_rollout_attempts=max_rollout_attempts,
            created_at=clock(),
            gym_ray_version=_gym_ray_version(),
            attempt_plan=tuple(attempt_plan),
        )


class ShardProgress(BaseModel):
    """A shard's counts as they stand, for ``status``.

    ``planned`` is the number of materialized rows (None before they are written); ``succeeded`` counts
    distinct identities with a success line; ``failed`` counts failure lines by class; ``terminal_failed``
    those marked terminal; ``omitted`` the rows appended with ``_ng_no_persist`` (written or not);
    ``attempts`` every success and failure line. Counts include lines found when the writer opened.
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    shard: str
    planned: int | None
    succeeded: int
    failed: dict[str, int]
    terminal_failed: int
    omitted: int
    attempts: int
    updated_at: float


def build_manifest(
    run_dir: str | os.PathLike[str],
    shard: str,
    *,
    run_id: str,
    config_identity: str | None,
    max_rollout_attempts: int = 3,
    prior_attempts: Mapping[Identity, int] | None = None,
    clock: Callable[[], float] = time.time,
) -> ShardManifest:
    """:meth:`ShardManifest.build` for the materialized inputs of shard ``shard`` in ``run_dir``.

    Raises:
        InputError: The inputs file is missing, or a line is not a JSON object with integer indices.
    """
    return ShardManifest.build(
        run_id=run_id,
        shard=shard,
        config_identity=config_identity,
        inputs_path=shard_paths(run_dir, shard).materialized_inputs,
        max_rollout_attempts=max_rollout_attempts,
        prior_attempts=prior_attempts,
        clock=clock,
    )


def read_manifest(run_dir: str | os.PathLike[str], shard: str) -> ShardManifest | None:
    """Read a shard's manifest, or None when it has none.

    Raises:
        InputError: The file exists but is not a valid manifest (it is written atomically, so this means it
            was edited or the disk is damaged).
    """
    path = shard_paths(run_dir, shard).manifest
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return ShardManifest.model_validate_json(data)
    except pydantic.ValidationError as exc:
        raise InputError(
            f"{path}: not a valid shard manifest ({validation_problems(exc)}); restore it, or remove it to "
            "resume without verifying the inputs",
            path=str(path),
        ) from exc
    except ValueError as exc:
        raise InputError(
            f"{path}: not a valid shard manifest ({exc}); restore it, or remove it to resume without "
            "verifying the inputs",
            path=str(path),
        ) from exc
