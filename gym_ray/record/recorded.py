"""Which rollouts a run folder already holds as done, for ``gym_ray.stream(..., resume=True)``.

Reads the shards' success and failure files as they are (corrupt lines, e.g. a torn last line, are
skipped); it takes no lock, so call it before writers start on the folder.
"""

from __future__ import annotations

import os

from gym_ray import keys
from gym_ray.record.jsonl import JsonlReader
from gym_ray.record.shard_files import list_shards, record_identity, shard_paths

__all__ = ["recorded_keys"]


def recorded_keys(record_dir: str | os.PathLike[str]) -> set[tuple[int, int]]:
    """``(task, rollout)`` keys recorded as done in a run folder: a success or a terminal failure."""
    done: set[tuple[int, int]] = set()
    for shard in list_shards(record_dir):
        paths = shard_paths(record_dir, shard)
        for path, need_terminal in ((paths.successes, False), (paths.failures, True)):
            for _, record in JsonlReader(path):
                key = record_identity(record)
                if key is not None and (not need_terminal or record.get(keys.FAILURE_TERMINAL) is True):
                    done.add(key)
    return done
