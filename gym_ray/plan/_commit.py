"""Committing one planned shard: its materialized inputs, then its manifest, durably and cheaply.

:func:`gym_ray.plan.shards.iter_plan` commits each shard it cuts. A shard is committed when its manifest
is in place; the manifest is renamed into place only after the inputs file's bytes and its name in the run
folder are on disk, so a committed shard always has the inputs its manifest's digest names. A kill before
that rename leaves the shard's inputs without a manifest (or only the staging folder), which a rerun
verifies and keeps, as before.

The sequence for a new shard (four fsyncs, where opening a :class:`~gym_ray.record.writer.ShardWriter`
only to write the manifest took six and left the inputs' bytes unsynced):

1. fsync the staged inputs file; rename it into the run folder; create the shard's empty results files
   and lock file (what a writer's ``open`` creates, so a planned folder holds the same names);
2. fsync the run folder (the inputs' name and the empty files are on disk);
3. write the manifest with :func:`~gym_ray.record.atomic.atomic_write_bytes` (a temporary file, fsynced,
   renamed into place, the run folder fsynced again): the shard is committed.

The bytes written are those the writer writes: the manifest is ``model_dump_json(indent=2)`` and a newline.
"""

from __future__ import annotations

import os
from pathlib import Path

from gym_ray.record.atomic import atomic_write_bytes, fsync_dir
from gym_ray.record.manifest import ShardManifest
from gym_ray.record.shard_files import ShardPaths

__all__ = ["commit_new_shard"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_new_shard(staged: Path, paths: ShardPaths, manifest: ShardManifest) -> None:
    """Move the staged inputs file ``staged`` into place as shard ``paths``' inputs, then commit its manifest.

    The shard must not have an inputs file yet (the caller checked). See the module docstring for the order
    of writes and syncs.

    Raises:
        OSError: A write, rename or sync failed (its ``filename`` names the file); the manifest is then not
            in place.
    """
    _fsync_file(staged)
    os.replace(staged, paths.materialized_inputs)
    for path in (paths.successes, paths.failures, paths.lock):
        os.close(os.open(path, _CREATE, 0o644))
    # The inputs' name, the empty files: on disk before the manifest names the shard (then it is committed).
    fsync_dir(paths.run_dir)
    atomic_write_bytes(paths.manifest, manifest.model_dump_json(indent=2).encode() + b"\n")
