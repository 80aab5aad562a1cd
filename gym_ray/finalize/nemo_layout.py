"""NeMo Gym's output layout: the merged run files published under ``output_jsonl_fpath`` (PROTOCOL.md s5).

With ``output_jsonl_fpath=P`` NeMo Gym 0.7 writes ``P`` (successes), ``<stem>_failures.jsonl``,
``<stem>_materialized_inputs.jsonl`` and ``<stem>_aggregate_metrics.json`` beside it, where ``<stem>`` is
``P`` without its last suffix (``out/a.b.jsonl`` -> ``out/a.b_failures.jsonl``). :func:`nemo_gym_paths`
names them exactly as 0.7 does; :func:`publish_nemo_gym_layout` puts a finished run folder's merged files
there, so NeMo Gym's tooling reads a gym_ray run unchanged. Shard files and manifests stay in the run folder.

Durability: each file appears atomically (a temp file in ``P``'s folder, then ``os.replace``). The merged
files are hard-linked when the run folder is on the same file system (no copy), else copied. A published
file is never rewritten in place: a later merge replaces the run folder's file and the next publish replaces
the link, so a reader of ``P`` sees the old or the new file, never a partial one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from gym_ray.record.shard_files import list_shards, shard_paths

__all__ = ["NemoGymPaths", "nemo_gym_paths", "publish_nemo_gym_layout"]


@dataclass(frozen=True)
class NemoGymPaths:
    """The files NeMo Gym 0.7 derives from ``output_jsonl_fpath``."""

    rollouts: Path
    failures: Path
    materialized_inputs: Path
    aggregate_metrics: Path


def nemo_gym_paths(output_jsonl_fpath: str | os.PathLike[str]) -> NemoGymPaths:
    """The paths NeMo Gym 0.7 writes for ``output_jsonl_fpath`` (only the last suffix is stripped).

    Example:
        >>> nemo_gym_paths("results/rollouts.jsonl").failures
        PosixPath('results/rollouts_failures.jsonl')
    """
    path = Path(output_jsonl_fpath)
    return NemoGymPaths(
        rollouts=path,
        failures=path.with_name(path.stem + "_failures.jsonl"),
        materialized_inputs=path.with_name(path.stem + "_materialized_inputs.jsonl"),
        aggregate_metrics=path.with_name(path.stem + "_aggregate_metrics.json"),
    )


def _temp_beside(target: Path) -> Path:
    return target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")


def _publish_file(source: Path, target: Path) -> None:
    temp = _temp_beside(target)
    try:
        try:
            os.link(source, temp)
        except OSError:
            shutil.copyfile(source, temp)
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)


def _publish_concatenation(sources: list[Path], target: Path) -> None:
    temp = _temp_beside(target)
    try:
        with open(temp, "wb") as out:
            for source in sources:
                with open(source, "rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)


def publish_nemo_gym_layout(
    run_dir: str | os.PathLike[str],
    output_jsonl_fpath: str | os.PathLike[str],
    *,
    rollouts: str | os.PathLike[str],
    failures: str | os.PathLike[str],
    metrics: str | os.PathLike[str] | None,
) -> NemoGymPaths:
    """Publish a finished run folder's merged files under NeMo Gym's names.

    Args:
        run_dir: The run folder (its shards' materialized inputs are concatenated in shard order, which is
            the planned order).
        output_jsonl_fpath: NeMo Gym's ``P``; its folder is created if missing.
        rollouts: The run folder's merged successes (published as ``P``).
        failures: The run folder's merged failures (published as ``<stem>_failures.jsonl``).
        metrics: The run's metrics file, or None when aggregation did not run: then a metrics file left at
            ``<stem>_aggregate_metrics.json`` by an earlier run is removed, so it never describes another
            run.

    Returns:
        The published paths.
    """
    paths = nemo_gym_paths(output_jsonl_fpath)
    paths.rollouts.parent.mkdir(parents=True, exist_ok=True)
    root = Path(run_dir)
    _publish_concatenation(
        [shard_paths(root, shard).materialized_inputs for shard in list_shards(root)],
        paths.materialized_inputs,
    )
    _publish_file(Path(failures), paths.failures)
    _publish_file(Path(rollouts), paths.rollouts)
    if metrics is not None:
        _publish_file(Path(metrics), paths.aggregate_metrics)
    else:
        paths.aggregate_metrics.unlink(missing_ok=True)
    return paths
